"""trjax.comm's HLO reader on the forms XLA:GPU prints: async collective pairs,
generic async wrappers, collectives inside fusions and loop bodies, cuDNN
weight-gradient convolutions, and a backend that gives no HLO text.

The modules below are written by hand in XLA's HLO text syntax (as printed by
``HloModule::ToString``: ``%name = type opcode(operands), attributes``; async
pairs ``all-reduce-start``/``all-reduce-done``, ``all-gather-start`` whose
result is the tuple (operand, output), ``collective-permute-start`` with two
``u32[]`` context values, the generic ``async-start``/``async-done`` with
``calls=`` a computation that wraps one collective)."""
import jax
import numpy as np
from jax.sharding import PartitionSpec as P

from trjax import comm
from trjax.world import make_world

GPU_MODULE = """\
HloModule jit_train_step, is_scheduled=true, entry_computation_layout={(f32[1000]{0})->f32[1000]{0}}

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %sum = f32[] add(f32[] %x, f32[] %y)
}

%fused_computation.1 (param_0: f32[64]) -> f32[64] {
  %param_0 = f32[64]{0} parameter(0)
  %all-reduce.9 = f32[64]{0} all-reduce(f32[64]{0} %param_0), channel_id=9, replica_groups={{0,1}}, to_apply=%add
  ROOT %multiply.2 = f32[64]{0} multiply(f32[64]{0} %all-reduce.9, f32[64]{0} %all-reduce.9)
}

%async_computation (p0: f32[1024]) -> f32[128] {
  %p0 = f32[1024]{0} parameter(0)
  ROOT %reduce-scatter.3 = f32[128]{0} reduce-scatter(f32[1024]{0} %p0), channel_id=3, replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}, to_apply=%add
}

%while_body (loop: (s32[], f32[8])) -> (s32[], f32[8]) {
  %loop = (s32[], f32[8]{0}) parameter(0)
  %i = s32[] get-tuple-element((s32[], f32[8]{0}) %loop), index=0
  %v = f32[8]{0} get-tuple-element((s32[], f32[8]{0}) %loop), index=1
  %collective-permute.4 = f32[8]{0} collective-permute(f32[8]{0} %v), channel_id=6, source_target_pairs={{0,1},{1,0}}
  ROOT %tuple.1 = (s32[], f32[8]{0}) tuple(s32[] %i, f32[8]{0} %collective-permute.4)
}

%while_cond (loop.1: (s32[], f32[8])) -> pred[] {
  %loop.1 = (s32[], f32[8]{0}) parameter(0)
  %i.1 = s32[] get-tuple-element((s32[], f32[8]{0}) %loop.1), index=0
  %c = s32[] constant(3)
  ROOT %lt = pred[] compare(s32[] %i.1, s32[] %c), direction=LT
}

ENTRY %main.42 (Arg_0.1: f32[1000], Arg_1.2: f32[8,8,8,1], Arg_2.3: f32[8,8,8,16]) -> f32[1000] {
  %Arg_0.1 = f32[1000]{0} parameter(0)
  %Arg_1.2 = f32[8,8,8,1]{3,2,1,0} parameter(1)
  %Arg_2.3 = f32[8,8,8,16]{3,2,1,0} parameter(2)
  %all-reduce-start = f32[1000]{0} all-reduce-start(f32[1000]{0} %Arg_0.1), channel_id=1, replica_groups={{0,1}}, use_global_device_ids=true, to_apply=%add
  %cudnn-conv-bw-filter.1 = (f32[3,3,1,16]{3,2,1,0}, u8[0]{0}) custom-call(f32[8,8,8,1]{3,2,1,0} %Arg_1.2, f32[8,8,8,16]{3,2,1,0} %Arg_2.3), window={size=3x3 pad=1_1x1_1}, dim_labels=b01f_01io->b01f, custom_call_target="__cudnn$convBackwardFilter"
  %all-reduce-done = f32[1000]{0} all-reduce-done(f32[1000]{0} %all-reduce-start)
  %all-reduce-start.1 = (f32[144]{0}, f32[10]{0}) all-reduce-start(f32[144]{0} %a, f32[10]{0} %b), channel_id=2, replica_groups={{0,1}}, to_apply=%add
  %all-gather-start = (f32[128]{0}, f32[1024]{0}) all-gather-start(f32[128]{0} %c), channel_id=4, replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}, use_global_device_ids=true
  %all-reduce-done.1 = (f32[144]{0}, f32[10]{0}) all-reduce-done((f32[144]{0}, f32[10]{0}) %all-reduce-start.1)
  %all-gather-done = f32[1024]{0} all-gather-done((f32[128]{0}, f32[1024]{0}) %all-gather-start)
  %collective-permute-start = (f32[8]{0}, f32[8]{0}, u32[], u32[]) collective-permute-start(f32[8]{0} %d), channel_id=5, source_target_pairs={{0,1},{1,0}}
  %collective-permute-done = f32[8]{0} collective-permute-done((f32[8]{0}, f32[8]{0}, u32[], u32[]) %collective-permute-start)
  %reduce-scatter-start = ((f32[1024]{0}), f32[128]{0}) async-start(f32[1024]{0} %e), calls=%async_computation
  %fusion.7 = f32[64]{0} fusion(f32[64]{0} %f), kind=kLoop, calls=%fused_computation.1
  %reduce-scatter-done = f32[128]{0} async-done(((f32[1024]{0}), f32[128]{0}) %reduce-scatter-start), calls=%async_computation
  %all-to-all-start = ((f32[16]{0}), f32[16]{0}) all-to-all-start(f32[16]{0} %g), channel_id=7, replica_groups={{0,1}}, dimensions={0}
  %all-to-all-done = f32[16]{0} all-to-all-done(%all-to-all-start)
  %while.1 = (s32[], f32[8]{0}) while((s32[], f32[8]{0}) %init), condition=%while_cond, body=%while_body
  ROOT %copy = f32[1000]{0} copy(f32[1000]{0} %all-reduce-done)
}
"""


def _rows(cols):
    return [(c["kind"], c["async"], c["computation"], c["position"], c["done_position"],
             c["via"], c["elements"], c["bytes"]) for c in cols]


def test_async_pairs_fusions_and_loops():
    cols = comm.collectives_in_hlo(GPU_MODULE)
    assert _rows(cols) == [
        # kind, async, computation, start, done, via, elements, bytes (of the result)
        ("all-reduce", True, "ENTRY", 3, 5, None, 1000, 4000),
        ("all-reduce", True, "ENTRY", 6, 8, None, 154, 616),       # a tuple all-reduce
        ("all-gather", True, "ENTRY", 7, 9, None, 1024, 4096),     # the done's output, not (in, out)
        ("collective-permute", True, "ENTRY", 10, 11, None, 8, 32),  # no u32[] context values
        ("reduce-scatter", True, "ENTRY", 12, 14, None, 128, 512),  # generic async wrapper
        ("all-reduce", False, "ENTRY", 13, 13, "fused_computation.1", 64, 256),  # inside a fusion
        ("all-to-all", True, "ENTRY", 15, 16, None, 16, 64),        # done without operand types
        ("collective-permute", False, "while_body", 3, 3, None, 8, 32),  # per iteration
    ]
    assert [o["elements"] for o in cols[1]["operands"]] == [144, 10]
    assert [c["kind"] for c in comm.collectives_in_hlo(GPU_MODULE, nested=False)][-1] == "all-to-all"
    # the cuDNN weight-gradient convolution of a 3x3x1x16 kernel (result: kernel, scratch)
    assert comm.conv_positions(GPU_MODULE, (3, 3, 1, 16)) == [4]
    assert comm.conv_positions(GPU_MODULE, (3, 3, 16, 16)) == []


def test_sugared_async_and_names_without_percent():
    # XLA prints an async op wrapping one instruction as "<op>-start"/"<op>-done";
    # some printers leave out the '%' before names.
    text = """\
HloModule m

add {
  x = f32[] parameter(0)
  y = f32[] parameter(1)
  ROOT s = f32[] add(x, y)
}

ENTRY main {
  p = f32[1024]{0} parameter(0)
  reduce-scatter-start = ((f32[1024]{0}), f32[128]{0}) reduce-scatter-start(p), channel_id=1, replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}, to_apply=add
  reduce-scatter-done = f32[128]{0} reduce-scatter-done(reduce-scatter-start)
  ROOT all-reduce.1 = f32[128]{0} all-reduce(reduce-scatter-done), replica_groups={}, to_apply=add
}
"""
    assert _rows(comm.collectives_in_hlo(text)) == [
        ("reduce-scatter", True, "ENTRY", 1, 2, None, 128, 512),
        ("all-reduce", False, "ENTRY", 3, 3, None, 128, 512)]


def test_missing_hlo_text_is_none_not_a_crash():
    class NoText:
        def as_text(self):
            return None

    class Raises:
        def as_text(self):
            raise NotImplementedError("this PJRT plugin has no HLO text")

    assert comm.hlo_text(NoText()) is None and comm.hlo_text(Raises()) is None
    assert comm.collectives_in_hlo(None) is None and comm.conv_positions(None, (3, 3)) is None


def test_xla_cpu_module_still_parses():
    """The real compiled module of this machine: two psums stay two sync all-reduces."""
    w = make_world("all", 8)

    def local(a, b):
        return jax.lax.psum(a, "data"), jax.lax.psum(b * 2.0, "data")

    fn = jax.jit(jax.shard_map(local, mesh=w.mesh, in_specs=P("data"), out_specs=P()))
    x = np.ones((8, 100), np.float32)
    text = comm.hlo_text(fn.lower(x, x[:, :10]).compile())
    assert text is not None
    cols = comm.collectives_in_hlo(text)
    assert all(c["kind"] == "all-reduce" and not c["async"] for c in cols)
    assert sum(c["elements"] for c in cols) == 110


def test_report_without_hlo_text(monkeypatch):
    """A backend whose Compiled.as_text() gives nothing: the report says so and
    still counts what the program requested, instead of failing."""
    from helpers import small_config
    from trjax import report
    from trjax.train import trainer
    monkeypatch.setattr(comm, "hlo_text", lambda compiled: None)
    r = report.comm_report(trainer.setup(small_config(devices="2")))
    assert r["gradient_all_reduces"] is None and r["deep_before_first_conv_wgrad"] is None
    assert r["train_step"]["collectives"] is None
    assert r["train_step"]["hlo"].startswith("unavailable")
    assert r["train_step"]["requested"]["count"] >= 2  # two buckets (+ BN statistics)
    assert "train_step: compiled HLO unavailable" in report.format_report(r)
