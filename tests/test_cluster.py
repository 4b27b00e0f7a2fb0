"""Safe multi-process start: a launcher's environment starts ONE run (fake SLURM,
Open MPI and JAX_COORDINATOR_ADDRESS variables), and one live run per workdir
(an flock on WORKDIR/trjax.lock; a second real process, also in another PID namespace)."""
import fcntl
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


@pytest.mark.job
def test_fake_srun_starts_one_run_of_two_processes(tmp_path):
    job = _free_slurm_job_id()
    procs = [subprocess.Popen(
        [sys.executable, *TRAIN, "--workdir", str(tmp_path), "--config.cpu_devices=2",
         # num_epochs only sets the schedule here (halted at step 2): the programs of
         # test_multihost's launcher run (2 processes x 2 devices), compiled once a session
         "--config.num_epochs=100", "--config.halt_after_steps=2",
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
    assert _free(tmp_path)  # released at the end


HOLDER = """
import sys, time
from trjax.train.workdir import WorkdirLock
WorkdirLock(sys.argv[1]).acquire()
print("held", flush=True)
time.sleep(120)
"""


def _free(workdir) -> bool:
    """Whether nobody holds the workdir's lock (taken and given back here) and the
    release removed the lock file."""
    with WorkdirLock(str(workdir)) as lock:
        assert lock.held
    return not (workdir / LOCK_NAME).exists()


def _start_holder(workdir, *prefix):
    holder = subprocess.Popen([*prefix, sys.executable, "-c", HOLDER, str(workdir)], cwd=ROOT,
                              stdout=subprocess.PIPE, text=True, env=_env(PYTHONPATH=ROOT))
    assert holder.stdout.readline().strip() == "held"
    return holder


@pytest.mark.job
def test_second_writer_is_refused_while_the_first_lives(tmp_path):
    holder = _start_holder(tmp_path)
    try:
        note = json.loads((tmp_path / LOCK_NAME).read_text())
        assert (note["pid"], note["host"]) == (holder.pid, socket.gethostname())
        assert note["command"] == f"-c {tmp_path}"  # python -c's argv
        with pytest.raises(WorkdirBusy, match="^" + re.escape(
                f"workdir '{tmp_path}' is in use by pid {holder.pid} on host "
                f"{socket.gethostname()} since {note['started']}; wait for it or use another "
                f"--workdir (its command: -c {tmp_path})")):
            WorkdirLock(str(tmp_path)).acquire()
        t0 = time.monotonic()  # a real second process: scripts/train.py
        out = subprocess.run([sys.executable, *TRAIN, "--workdir", str(tmp_path)],
                             capture_output=True, text=True, timeout=120, env=_env())
        assert out.returncode == 1, out.stdout[-1000:] + out.stderr[-2000:]
        assert f"error: workdir {str(tmp_path)!r} is in use by pid {holder.pid} on host " \
            f"{socket.gethostname()} since " in out.stderr
        assert "compile" not in out.stdout  # refused before anything was built
        assert time.monotonic() - t0 < 60
        assert sorted(os.listdir(tmp_path)) == [LOCK_NAME]
        assert json.loads((tmp_path / LOCK_NAME).read_text()) == note  # nothing written
    finally:
        holder.kill()  # SIGKILL: no release, no clean-up
        holder.wait()
    # the kernel dropped the dead holder's lock: taken at once, its note replaced
    lock = WorkdirLock(str(tmp_path), log=pytest.fail).acquire()
    assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == os.getpid()
    again = WorkdirLock(str(tmp_path)).acquire()  # this process may take it again
    assert again.held
    again.release()  # the nested one leaves the lock to the first
    fd = os.open(tmp_path / LOCK_NAME, os.O_RDWR)  # a real flock: another open file of
    with pytest.raises(BlockingIOError):  # this process is refused too
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    os.close(fd)
    lock.release()
    assert _free(tmp_path)


def _unshare_pid():
    cmd = ["unshare", "--pid", "--fork", "--kill-child", "--map-root-user"]
    try:
        ok = subprocess.run([*cmd, "true"], capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        ok = False
    if not ok:
        pytest.skip("no unshare --pid --map-root-user here")
    return cmd


def test_a_holder_in_another_pid_namespace_is_seen(tmp_path):
    """The field failure: a holder in a container's PID namespace writes its own pid (1
    there), which is another, live process here; its lock still refuses a second run."""
    holder = _start_holder(tmp_path, *_unshare_pid())
    try:
        note = json.loads((tmp_path / LOCK_NAME).read_text())
        assert note["pid"] == 1  # the namespace's first process
        with pytest.raises(WorkdirBusy, match=r"is in use by pid 1 on host "):
            WorkdirLock(str(tmp_path)).acquire()
    finally:
        holder.kill()
        holder.wait()
    deadline = time.monotonic() + 30  # --kill-child: the namespace ends with unshare
    while time.monotonic() < deadline:
        try:
            assert _free(tmp_path)
            break
        except WorkdirBusy:
            time.sleep(0.1)
    else:
        pytest.fail("the lock outlived its holder's namespace")


@pytest.mark.parametrize("content", ["", "garbage{{", "[1, 2]",
                                     '{"host": "node-b", "pid": 17, "started": "yesterday"}'])
def test_a_lock_file_nobody_holds_is_taken_whatever_it_says(tmp_path, content):
    """No stale-lock judgement: a note left by a killed run (any host, any pid) or any
    other content is no lock; only a live flock is."""
    path = tmp_path / LOCK_NAME
    path.write_text(content)
    with WorkdirLock(str(tmp_path), log=pytest.fail) as lock:
        assert lock.held and json.loads(path.read_text())["pid"] == os.getpid()
    assert not path.exists()  # removed by its holder, while still locked
    fresh = tmp_path / "new"  # a new workdir is made
    with WorkdirLock(str(fresh)):
        assert fresh.is_dir() and os.listdir(fresh) == [LOCK_NAME]
    assert not fresh.exists()  # made by the lock and left empty: removed with it
    with WorkdirLock(str(fresh)):
        (fresh / "metrics.jsonl").write_text("{}\n")
    assert os.listdir(fresh) == ["metrics.jsonl"]  # something written: the folder stays


def test_a_failed_start_leaves_no_lock_file(tmp_path, monkeypatch):
    """A start refused before compiling (here: a model path that does not import) leaves
    neither a lock file nor, in a workdir it made, the folder; in a workdir that exists,
    what was there."""
    from helpers import small_config
    from trjax import aot
    from trjax.train import train_and_evaluate
    monkeypatch.setattr(aot, "compile_step", lambda *a, **k: pytest.fail("compiled"))
    bad = small_config(model="no_such_package_trjax.nets:Net")
    fresh = tmp_path / "runs" / "new"
    with pytest.raises(ValueError, match="no_such_package_trjax"):
        train_and_evaluate(bad, str(fresh))
    assert not fresh.exists() and os.listdir(tmp_path / "runs") == []
    old = tmp_path / "old"
    old.mkdir()
    (old / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="no_such_package_trjax"):
        train_and_evaluate(bad, str(old))
    assert os.listdir(old) == ["notes.txt"]
    assert _free(old)  # and nobody holds it


def test_a_lock_file_removed_by_its_releasing_holder_is_not_held(tmp_path):
    """The race that removing the file opens: a run opens the lock file, its holder
    releases (removing it), the run locks the removed file. It must see that the path no
    longer names its file and lock the path again, else a third run would lock a new
    file beside it."""
    path = tmp_path / LOCK_NAME
    holder = os.open(path, os.O_RDWR | os.O_CREAT)  # another process's holder, as WorkdirLock
    fcntl.flock(holder, fcntl.LOCK_EX | fcntl.LOCK_NB)  # holds and releases it
    real_flock, calls = fcntl.flock, []

    def flock_after_release(fd, op):  # the holder releases between our open and our flock
        if not calls:
            os.unlink(path)
            os.close(holder)
        calls.append(os.fstat(fd).st_ino)
        return real_flock(fd, op)

    fcntl.flock = flock_after_release
    try:
        lock = WorkdirLock(str(tmp_path), log=pytest.fail).acquire()
    finally:
        fcntl.flock = real_flock
    assert len(calls) == 2 and calls[1] == os.stat(path).st_ino  # the removed file, then
    assert json.loads(path.read_text())["pid"] == os.getpid()   # the one the path names
    fd = os.open(tmp_path / LOCK_NAME, os.O_RDWR)
    with pytest.raises(BlockingIOError):  # the file at the path is the one held
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    os.close(fd)
    lock.release()
    assert _free(tmp_path)


@pytest.mark.parametrize("note", ["", "garbage{{"])
def test_a_holder_whose_note_cannot_be_read_is_still_refused(tmp_path, note):
    path = tmp_path / LOCK_NAME
    path.write_text(note)
    fd = os.open(path, os.O_RDWR)  # a holder (another open file) with that note
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        why = "it is empty" if not note else "it is not a note trjax wrote"
        with pytest.raises(WorkdirBusy, match=rf"is in use by another process \(its note in "
                                              rf".*trjax.lock cannot be read: {why}\); wait"):
            WorkdirLock(str(tmp_path)).acquire()
    finally:
        os.close(fd)
    assert path.read_text() == note  # a refused lock changes nothing


def test_a_lock_path_that_is_a_folder_is_a_clear_error(tmp_path):
    from trjax.train.workdir import WorkdirError
    (tmp_path / LOCK_NAME).mkdir()
    with pytest.raises(WorkdirError, match=r"cannot be used: Is a directory \(.*trjax.lock\)"):
        WorkdirLock(str(tmp_path)).acquire()


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
