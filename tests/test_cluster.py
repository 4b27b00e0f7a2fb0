"""Safe multi-process start: a launcher's environment starts ONE run (fake SLURM,
Open MPI and JAX_COORDINATOR_ADDRESS variables), and one live run per workdir
(a lock file with host and pid; two local processes)."""
import json
import os
import re
import socket
import subprocess
import sys
import time

import pytest

from trjax.train.distributed import Launch, detect_launch, resolve_launch
from trjax.train.workdir import LOCK_NAME, WorkdirBusy, WorkdirLock

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
TRAIN = [os.path.join(ROOT, "scripts", "train.py"), "--config",
         os.path.join(ROOT, "configs", "default.py"), "--config.model=resnet8",
         "--config.progress=False"]


def slurm(ntasks=4, procid=2, localid=0, nodes=2, **more):
    return {"SLURM_JOB_ID": "4242", "SLURM_STEP_NODELIST": "gpu[003-004]",
            "SLURM_NTASKS": str(ntasks), "SLURM_PROCID": str(procid),
            "SLURM_LOCALID": str(localid), "SLURM_STEP_NUM_NODES": str(nodes), **more}


def test_detect_launch_from_fake_environments():
    assert detect_launch({}) is None
    assert detect_launch(slurm()) == Launch("SLURM", None, 4, 2, None)
    # one task per node: the process takes every GPU of its node, not just GPU 0
    assert detect_launch(slurm(ntasks=2, procid=1, nodes=2, CUDA_VISIBLE_DEVICES="0,1,2,3")) == \
        Launch("SLURM", None, 2, 1, (0, 1, 2, 3))
    assert detect_launch(slurm(ntasks=1, procid=0, nodes=1)) is None  # one task: one process
    partial = slurm()
    del partial["SLURM_STEP_NODELIST"]  # an allocation without a step (salloc shell)
    assert detect_launch(partial) is None
    assert detect_launch(slurm(JAX_COORDINATOR_ADDRESS="gpu003:1234")) == \
        Launch("SLURM", "gpu003:1234", 4, 2, None)
    ompi = {"OMPI_MCA_orte_hnp_uri": "1234.0;tcp://10.0.0.5:5555", "OMPI_COMM_WORLD_SIZE": "8",
            "OMPI_COMM_WORLD_RANK": "5", "OMPI_COMM_WORLD_LOCAL_SIZE": "4"}
    assert detect_launch(ompi) == Launch("Open MPI", None, 8, 5, None)
    del ompi["OMPI_MCA_orte_hnp_uri"]  # Open MPI 5 (PMIx): jax cannot find rank 0
    with pytest.raises(ValueError, match="OMPI_MCA_orte_hnp_uri.*JAX_COORDINATOR_ADDRESS"):
        detect_launch(ompi)
    assert detect_launch({**ompi, "JAX_COORDINATOR_ADDRESS": "10.0.0.5:7777"}) == \
        Launch("Open MPI", "10.0.0.5:7777", 8, 5, None)
    env = {"JAX_COORDINATOR_ADDRESS": "h0:99", "JAX_NUM_PROCESSES": "3", "JAX_PROCESS_ID": "1"}
    assert detect_launch(env) == Launch("JAX_COORDINATOR_ADDRESS", "h0:99", 3, 1, None)
    with pytest.raises(ValueError, match="JAX_NUM_PROCESSES and JAX_PROCESS_ID"):
        detect_launch({"JAX_COORDINATOR_ADDRESS": "h0:99"})
    # explicit config wins; auto=False ignores the environment
    assert resolve_launch("h1:5", 2, 1, env=slurm()) == Launch("config", "h1:5", 2, 1)
    assert resolve_launch(auto=False, env=slurm()) is None
    assert resolve_launch(env=slurm()).source == "SLURM"
    with pytest.raises(ValueError, match="process_id=2 must be in"):
        resolve_launch("h1:5", 2, 2)


def test_our_slurm_variables_are_jaxs(monkeypatch):
    """jax's own detection reads the same variables: given the process count and
    index, it fills in the coordinator from SLURM_STEP_NODELIST and the job id."""
    from jax._src import clusters
    for k in [k for k in os.environ if k.startswith(("SLURM_", "OMPI_", "JAX_COORD"))]:
        monkeypatch.delenv(k)
    for k, v in slurm().items():
        monkeypatch.setenv(k, v)
    launch = detect_launch()
    coord, n, i, local = clusters.ClusterEnv.auto_detect_unset_distributed_params(
        launch.coordinator, launch.num_processes, launch.process_id, None, None, 10)
    assert (coord, n, i, list(local)) == (f"gpu003:{4242 % 4096 + 61440}", 4, 2, [0])


def _free_slurm_job_id():
    """A SLURM job id whose coordinator port (jax: 61440 + id % 4096) is free here."""
    for job in range(4096):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", 61440 + job))
                return job
            except OSError:
                continue
    pytest.skip("no free port in 61440-65535")


def _env(**more):
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "OMPI_", "JAX_COORD"))}
    env.pop("XLA_FLAGS", None)  # each process simulates its own devices
    return {**env, "PYTHONUNBUFFERED": "1", **more}


def test_fake_srun_starts_one_run_of_two_processes(tmp_path):
    job = _free_slurm_job_id()
    procs = [subprocess.Popen(
        [sys.executable, *TRAIN, "--workdir", str(tmp_path), "--config.cpu_devices=2",
         "--config.num_epochs=1", "--config.halt_after_steps=2",
         "--config.distributed.heartbeat_timeout_s=10"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env=_env(SLURM_JOB_ID=str(job), SLURM_STEP_NODELIST="localhost", SLURM_NTASKS="2",
                 SLURM_PROCID=str(i), SLURM_LOCALID=str(i), SLURM_STEP_NUM_NODES="1"))
        for i in range(2)]
    try:
        logs = [p.communicate(timeout=240)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert [p.returncode for p in procs] == [0, 0], logs[0][-2000:] + logs[1][-2000:]
    assert "SLURM launch detected: process 0 of 2" in logs[0]
    assert "SLURM launch detected: process 1 of 2" in logs[1]
    assert re.search(r"world_size=4 devices=\[.*\] \(cpu, 2 process\(es\)\)", logs[0])
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["process_count"] == 2 and summary["world_size"] == 4 and summary["steps"] == 2
    assert not (tmp_path / LOCK_NAME).exists()  # released at the end


HOLDER = """
import sys, time
from trjax.train.workdir import WorkdirLock
WorkdirLock(sys.argv[1]).acquire()
print("held", flush=True)
time.sleep(120)
"""


def test_second_writer_is_refused_while_the_first_lives(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path)], cwd=ROOT,
                              stdout=subprocess.PIPE, text=True, env=_env(PYTHONPATH=ROOT))
    try:
        assert holder.stdout.readline().strip() == "held"
        lock = json.loads((tmp_path / LOCK_NAME).read_text())
        assert lock["pid"] == holder.pid and lock["host"] == socket.gethostname()
        with pytest.raises(WorkdirBusy,
                           match=rf"held by a live run \(pid {holder.pid} on this host"):
            WorkdirLock(str(tmp_path)).acquire()
        t0 = time.monotonic()
        out = subprocess.run([sys.executable, *TRAIN, "--workdir", str(tmp_path)],
                             capture_output=True, text=True, timeout=120, env=_env())
        assert out.returncode == 1, out.stdout[-1000:] + out.stderr[-2000:]
        assert f"error: workdir {str(tmp_path)!r} is held by a live run (pid {holder.pid}" \
            in out.stderr
        assert "compile" not in out.stdout  # refused before anything was built
        assert time.monotonic() - t0 < 60
        assert sorted(os.listdir(tmp_path)) == [LOCK_NAME]
    finally:
        holder.kill()
        holder.wait()
    # the holder died (killed: no release): its lock is stale and is taken over
    msgs = []
    lock = WorkdirLock(str(tmp_path), log=msgs.append).acquire()
    assert len(msgs) == 1 and f"no longer running (pid {holder.pid}" in msgs[0]
    assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == os.getpid()
    assert WorkdirLock(str(tmp_path)).acquire().held  # the holder may take it again
    lock.release()
    assert not (tmp_path / LOCK_NAME).exists()


def test_lock_of_another_host_or_a_recycled_pid(tmp_path):
    path = tmp_path / LOCK_NAME
    path.write_text(json.dumps({"host": "node-b", "pid": 17, "started": "yesterday"}))
    with pytest.raises(WorkdirBusy, match=r"held by a run on host 'node-b' .*delete .*trjax.lock"):
        WorkdirLock(str(tmp_path)).acquire()
    # our parent's pid is alive, but with another start time it is another process
    path.write_text(json.dumps({"host": socket.gethostname(), "pid": os.getppid(),
                                "start": "1", "started": "long ago"}))
    msgs = []
    with WorkdirLock(str(tmp_path), log=msgs.append):
        assert "no longer running" in msgs[0]
    assert not path.exists()
    path.write_text(json.dumps({"host": socket.gethostname()}))  # no pid: never "all processes"
    with WorkdirLock(str(tmp_path), log=msgs.append):
        assert "no longer running (pid None" in msgs[1]
    fresh = tmp_path / "new"  # a lock in a new workdir that was never written leaves nothing
    with WorkdirLock(str(fresh)):
        assert fresh.is_dir()
    assert not fresh.exists()


@pytest.mark.parametrize("content", ["", "garbage{{", "[1, 2]", '{"host": "h", "pid": "abc"}',
                                     "a folder"])
def test_a_lock_trjax_did_not_write_is_named_not_misread(tmp_path, content):
    path = tmp_path / LOCK_NAME
    if content == "a folder":
        path.mkdir()
    else:
        path.write_text(content)
    with pytest.raises(WorkdirBusy, match=r"trjax.lock is not a lock trjax can read .*if no run "
                                          r"uses this workdir, delete it"):
        WorkdirLock(str(tmp_path)).acquire()
    assert path.exists()  # nothing removed: the user decides


def test_a_workdir_that_cannot_be_a_folder_is_a_clear_error(tmp_path):
    from trjax.train.workdir import WorkdirError
    afile = tmp_path / "afile"
    afile.write_text("x")
    for bad in (afile, afile / "sub"):
        with pytest.raises(WorkdirError, match=rf"workdir '{bad}' cannot be used: .*pass a "
                                               r"writable folder as --workdir"):
            WorkdirLock(str(bad)).acquire()
    assert afile.read_text() == "x"


def test_an_unwritable_checkpoint_folder_is_refused_before_training(tmp_path, monkeypatch):
    from helpers import small_config
    from trjax import aot
    from trjax.train import train_and_evaluate
    from trjax.train.workdir import WorkdirError, check_writable
    check_writable(str(tmp_path / "new" / "checkpoints"))  # made, probed, left empty
    assert os.listdir(tmp_path / "new" / "checkpoints") == []
    (tmp_path / "checkpoints").write_text("a file where the folder goes")
    monkeypatch.setattr(aot, "compile_step", lambda *a, **k: pytest.fail("compiled"))
    with pytest.raises(WorkdirError, match=r"cannot write in .*checkpoints'.*make it writable"):
        train_and_evaluate(small_config(), str(tmp_path))
