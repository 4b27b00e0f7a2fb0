"""trjax.comm's mesh-axis attribution: device groups parsed from the compiled HLO text,
axis_of / by_axis on 2-D meshes, loop trip counts, and the byte models (trjax.comm's
pipeline_bytes, tensor_bytes, data_bytes: GPipe, Megatron, the ring all-reduce).

The small programs run on 4 of the 8 simulated CPU devices (tests/conftest.py); the
expected axes, trip counts and bytes are written out by hand. What XLA:CPU prints on jax
0.10.2: explicit ``replica_groups={{0,2},{1,3}}`` with ``channel_id=1,
use_global_device_ids=true`` (psum, psum_scatter, all_gather), ``channel_id`` only for
all_to_all and ``collective-permute ... source_target_pairs={{0,1},{1,0},...}``, and
``backend_config={..."known_trip_count":{"n":"5"}}`` on each scan's ``while``. The ids are
logical (positions in mesh.devices.flat), not device.id: see test_ids_are_mesh_positions."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import Mesh, PartitionSpec as P

from trjax import comm, models
from trjax.parallel import pipeline
from trjax.world import make_world

ROWS, COLS = 2, 8  # each device's local block: f32[2, 8] = 64 bytes


def _program(mesh):
    """psum over data, over the second axis, over both; a ppermute over the second axis
    in a scan of 5 and another in a scan of 3 nested in a scan of 2; an all_gather over
    data. Returns (hlo text, collectives)."""
    ax = mesh.axis_names[1]

    def ring(c, _):
        return lax.ppermute(c, ax, [(0, 1), (1, 0)]) * 1.5, None

    def outer(c, _):
        r, _ = lax.scan(ring, c, None, length=3)
        return r + 1.0, None

    def local(x):
        a = lax.psum(x, "data")
        b = lax.psum(x * 2, ax)
        c = lax.psum(x * 3, ("data", ax))
        d, _ = lax.scan(ring, x * 4, None, length=5)
        e, _ = lax.scan(outer, x[:1] * 5, None, length=2)  # f32[1, 8]: 32 bytes
        g = lax.all_gather(x * 6, "data", tiled=True)  # f32[4, 8]: 128 bytes
        return (a + b + c + d + e)[None], g[None]
    spec = P(mesh.axis_names)
    fn = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=spec, out_specs=(spec, spec)))
    x = jnp.arange(mesh.size * ROWS * COLS, dtype=jnp.float32).reshape(mesh.size * ROWS, COLS)
    hlo = fn.lower(x).compile().as_text()
    return hlo, comm.collectives_in_hlo(hlo)


@pytest.mark.parametrize("spec", ["data:2,stage:2", "data:2,model:2"])
def test_axes_trip_counts_and_bytes_of_a_small_program(spec):
    world = make_world("0-3", 4, mesh=spec)
    ax = world.mesh.axis_names[1]
    hlo, cols = _program(world.mesh)
    got = sorted(((c["kind"], comm.axis_of(c, world.mesh), c["trip_count"], c["bytes"])
                  for c in cols), key=str)
    want = sorted([
        ("all-reduce", "data", 1, 64),
        ("all-reduce", ax, 1, 64),
        ("all-reduce", ("data", ax), 1, 64),
        ("collective-permute", ax, 5, 64),
        ("collective-permute", ax, 6, 32),  # 3 inner x 2 outer iterations
        ("all-gather", "data", 1, 128)], key=str)
    assert got == want, got
    groups = {comm.axis_of(c, world.mesh): c["groups"] for c in cols if c["kind"] == "all-reduce"}
    # mesh [[0, 1], [2, 3]]: data pairs 0-2 and 1-3, the second axis 0-1 and 2-3
    assert groups == {"data": [[0, 2], [1, 3]], ax: [[0, 1], [2, 3]], ("data", ax): [[0, 1, 2, 3]]}
    for c in cols:
        if c["kind"] == "collective-permute":
            assert c["pairs"] == [[0, 1], [1, 0], [2, 3], [3, 2]] and c["groups"] is None
        else:
            assert c["use_global_device_ids"] and c["channel_id"] is not None
    rows = comm.by_axis(cols, world.mesh)
    assert {k: (v["count"], v["bytes"], len(v["collectives"]), v["unknown_trip_counts"])
            for k, v in rows.items()} == {
        "data": (2, 64 + 128, 2, 0),
        ax: (1 + 5 + 6, 64 + 5 * 64 + 6 * 32, 3, 0),
        ("data", ax): (1, 64, 1, 0)}
    # the text XLA:CPU printed, and the loops' counts: 5, the outer 2, the inner 2 x 3
    assert '"known_trip_count":{"n":"5"}' in hlo
    assert "replica_groups={{0,2},{1,3}}" in hlo or "replica_groups=mesh[" in hlo  # jaxlib 0.12
    assert {5, 2, 6} <= set(comm.trip_counts(hlo).values())


def test_ids_are_mesh_positions():
    """A mesh over devices [3, 2, 1, 0] and one over [4..7] print the same groups as
    over [0..3]: the HLO ids index mesh.devices.flat (the executable's device
    assignment), so axis_of maps them through the mesh's shape, never device.id."""
    devs = jax.devices()
    for order in ([3, 2, 1, 0], [4, 5, 6, 7]):
        mesh = Mesh(np.array([devs[i] for i in order]).reshape(2, 2), ("data", "model"))

        def local(x):
            return lax.psum(x, "data")[None]
        fn = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=P(("data", "model")),
                                   out_specs=P(("data", "model"))))
        (c,) = comm.collectives_in_hlo(fn.lower(jnp.ones((4, 8))).compile().as_text())
        assert c["groups"] == [[0, 2], [1, 3]] and comm.axis_of(c, mesh) == "data"


def test_group_formats_and_edge_cases():
    mesh = Mesh(np.array(jax.devices()).reshape(2, 2, 2), ("data", "stage", "model"))
    parse = comm.device_groups
    # the iota form IotaReplicaGroupList prints: iota(8).reshape(dims).transpose(perm)
    assert parse("replica_groups=[2,4]<=[8], to_apply=%add")["groups"] == [[0, 1, 2, 3],
                                                                          [4, 5, 6, 7]]
    assert parse("replica_groups=[4,2]<=[2,4]T(1,0)")["groups"] == [[0, 4], [1, 5], [2, 6],
                                                                    [3, 7]]
    assert parse("replica_groups=[2,4]<=[2,2,2]T(1,0,2)")["groups"] == [[0, 1, 4, 5],
                                                                        [2, 3, 6, 7]]
    assert comm.iota_groups([2, 2], [2, 2], [1, 0]) == [[0, 2], [1, 3]]
    assert parse("channel_id=7, replica_groups={}, use_global_device_ids=true") == {
        "groups": [], "pairs": None, "channel_id": 7, "use_global_device_ids": True}
    assert parse("source_target_pairs={{0,1},{1,0}}")["pairs"] == [[0, 1], [1, 0]]
    of = lambda text: comm.axis_of(parse(text), mesh)  # noqa: E731
    assert of("replica_groups=[4,2]<=[2,4]T(1,0)") == "data"  # {0,4}: data differs
    assert of("replica_groups=[2,4]<=[2,2,2]T(1,0,2)") == ("data", "model")
    assert of("replica_groups={{0,2},{1,3},{4,6},{5,7}}") == "stage"
    assert of("replica_groups={}") == ("data", "stage", "model")
    assert of("replica_groups={{0},{1},{2},{3},{4},{5},{6},{7}}") is None  # nothing moves
    assert of("replica_groups={{0,3},{1,2},{4,7},{5,6}}") is None  # not slabs of any axes
    assert of("replica_groups={{0,1},{2,3}}") is None  # half the devices: not a slab set
    assert of("source_target_pairs={{0,2},{2,0},{5,7}}") == "stage"
    assert of("source_target_pairs={{0,7}}") == ("data", "stage", "model")
    assert of("channel_id=1") is None
    with pytest.raises(ValueError, match=r"device id outside 0..7"):
        of("replica_groups={{0,8}}")


def test_trip_counts_of_text():
    """Nested whiles multiply; a while without known_trip_count is None below it; a
    condition runs n + 1 times."""
    text = """\
HloModule m

%inner_body (p: (s32[], f32[8])) -> (s32[], f32[8]) {
  %p = (s32[], f32[8]{0}) parameter(0)
  %v = f32[8]{0} get-tuple-element(%p), index=1
  %cp = f32[8]{0} collective-permute(%v), channel_id=2, source_target_pairs={{0,1},{1,0}}
  ROOT %t = (s32[], f32[8]{0}) tuple(%i, %cp)
}

%inner_cond (p.1: (s32[], f32[8])) -> pred[] {
  ROOT %lt = pred[] compare(%a, %b), direction=LT
}

%outer_body (q: (s32[], f32[8])) -> (s32[], f32[8]) {
  %q = (s32[], f32[8]{0}) parameter(0)
  ROOT %w = (s32[], f32[8]{0}) while(%q), condition=%inner_cond, body=%inner_body, backend_config={"known_trip_count":{"n":"3"}}
}

%outer_cond (q.1: (s32[], f32[8])) -> pred[] {
  ROOT %lt.1 = pred[] compare(%a, %b), direction=LT
}

%free_body (r: (s32[], f32[8])) -> (s32[], f32[8]) {
  %r = (s32[], f32[8]{0}) parameter(0)
  ROOT %ar = (s32[], f32[8]{0}) all-reduce(%r), replica_groups={}, to_apply=%add
}

ENTRY %main (x: (s32[], f32[8])) -> (s32[], f32[8]) {
  %x = (s32[], f32[8]{0}) parameter(0)
  %w.1 = (s32[], f32[8]{0}) while(%x), condition=%outer_cond, body=%outer_body, backend_config={"known_trip_count":{"n":"4"}}
  ROOT %w.2 = (s32[], f32[8]{0}) while(%w.1), condition=%outer_cond, body=%free_body
}
"""
    trips = comm.trip_counts(text)
    assert trips["ENTRY"] == 1 and trips["outer_body"] == 4 and trips["inner_body"] == 12
    assert trips["inner_cond"] == 4 * 4 and trips["free_body"] is None
    cols = comm.collectives_in_hlo(text)
    assert [(c["kind"], c["computation"], c["trip_count"]) for c in cols] == [
        ("collective-permute", "inner_body", 12), ("all-reduce", "free_body", None)]


def test_byte_models():
    # ResNet-50 at 224, the boundary after stage 3: 14x14x1024 f32 = 784 KiB per image, so
    # 24.5 MiB per micro-batch of 32 per direction
    assert 14 * 14 * 1024 * 4 == 784 * 1024
    assert comm.pipeline_bytes(1, 32, [(14, 14, 1024)], 4) == 2 * 24.5 * 2 ** 20
    # M micro-batches, two boundaries, bf16
    assert comm.pipeline_bytes(3, 2, [(8, 8, 4), (4, 4, 8)], 2) == 2 * 3 * 2 * (256 + 128) * 2
    assert comm.pipeline_bytes(4, 2, [], 4) == 0
    # RN50 stage-1 bottleneck pair: 784 KiB forward (conv2's 56x56x64 output), 3136 KiB
    # backward (the block input 56x56x256); the ring factor 2(T-1)/T is 1 at T = 2
    tp = comm.tensor_bytes(1, [((56, 56, 64), (56, 56, 256))], 2, 4)
    assert tp == {"forward": 784 * 1024, "backward": 3136 * 1024, "head": 0.0,
                  "total": 3920 * 1024, "g": 784 * 1024, "f": 3136 * 1024, "gather": 0,
                  "issued": 3920 * 1024}
    # T = 4, bf16, two pairs and a head over K = 10 classes from 16 features: its logits'
    # all-gather forward ((T-1)/T of the gathered B*K) and its input's f backward (a ring
    # all-reduce of B*16); the gather's backward is a slice, no reduce-scatter
    tp4 = comm.tensor_bytes(8, [((4, 4, 8), (4, 4, 16))] * 2, 4, 2, heads=[((10,), (16,))])
    assert tp4["g"] == 2 * 8 * 128 * 2 and tp4["gather"] == 8 * 10 * 2
    assert tp4["f"] == 2 * 8 * 256 * 2 + 8 * 16 * 2
    assert tp4["forward"] == 1.5 * tp4["g"] + 0.75 * tp4["gather"]
    assert tp4["backward"] == 1.5 * tp4["f"]
    assert tp4["head"] == 0.75 * 8 * 10 * 2 + 1.5 * 8 * 16 * 2
    assert tp4["total"] == tp4["forward"] + tp4["backward"] == \
        comm.tensor_sent(tp4["g"], tp4["f"], tp4["gather"], 4)
    assert tp4["issued"] == tp4["g"] + tp4["f"] + tp4["gather"]
    assert comm.data_bytes(1000, 4) == comm.ring_traffic_bytes(1000, 4) == 1500.0
    assert comm.data_bytes(1000, 1) == 0.0


@pytest.mark.parametrize("bn_mode", ["sync"])
def test_gpipe_step_collectives_by_axis(bn_mode):
    """The GPipe step of tests/test_pipeline.py (resnet8 widths 4/8/8 on 8x8x3, data:2,
    stage:2, M=3 micro-batches of 2 rows), with v1's gradient sum over ("data", "stage")
    added and the metric/BN sums over "stage" as there.

    Pins: one forward (0->1, 2->3) and one backward (1->0, 3->2) permute over "stage",
    each in a while of M+S-1 = 4 ticks, carrying the boundary activation f32[2, 8, 8, 4];
    by_axis's issued bytes are (M+S-1)/M times pipeline_bytes' useful ones. At top level
    (trip count 1) one all-reduce over ("data", "stage") with every gradient leaf (the
    combiner's one tuple, bytes = the params' bytes) and the "stage" sums (also one
    tuple), kept apart as their groups differ. ``sync``: each BN layer's (sum x, sum x^2,
    n) psum over "data" sits in the stage's switch branch inside the tick loop, forward
    and (its transpose) backward: 2 (M+S-1) sum_l (2 C_l + 1) * 4 bytes.

    ``running`` (no "data" collective; otherwise the same pins as ``sync``) is checked on
    the trainer's running-BN pipelined step: tests/test_pipeline_step.py's
    test_pipelined_step_collectives_by_axis (every collective over ("data", "stage") or
    "stage", the permutes' trip counts M + S - 1)."""
    S, M, D, image = 2, 3, 2, (8, 8, 3)
    module = models.create_model("resnet8", widths=(4, 8, 8), stem_width=4, bn_mode=bn_mode,
                                 axis_name="data")
    net = models.as_network(module)
    v = net.init(jax.random.key(0), image)
    L = 2 * M
    rng = np.random.default_rng(0)
    batch = {"image": rng.integers(0, 256, (D * L,) + image, dtype=np.uint8),
             "label": rng.integers(0, 10, (D * L,), dtype=np.int32),
             "mask": np.ones((D * L,), np.float32)}
    world = make_world(D * S, D * L, mesh=f"data:{D},stage:{S}")
    plan = pipeline.plan_stages(module, image, S)
    spec = {"image": P("data"), "label": P("data"), "mask": P("data")}
    leaves = jax.tree_util.tree_leaves

    def local(p, b):
        g, s, bn, _ = pipeline.pipeline_forward_backward(net, p, v["batch_stats"], b, M, plan,
                                                         bn_mode=bn_mode)
        lead = lambda t: jax.tree_util.tree_map(lambda a: a[None], t)  # noqa: E731
        return lead(lax.psum(g, ("data", "stage"))), lead(lax.psum((s, bn), "stage"))
    fn = jax.jit(jax.shard_map(local, mesh=world.mesh, in_specs=(P(), spec),
                               out_specs=P("data")))
    hlo = fn.lower(v["params"], batch).compile().as_text()
    cols = comm.collectives_in_hlo(hlo)
    rows = comm.by_axis(cols, world.mesh)
    want_axes = {"stage", ("data", "stage")} | ({"data"} if bn_mode == "sync" else set())
    assert set(rows) == want_axes, {k: len(r["collectives"]) for k, r in rows.items()}
    permutes = [c for c in cols if c["kind"] == "collective-permute"]
    assert sorted(c["pairs"] for c in permutes) == [[[0, 1], [2, 3]], [[1, 0], [3, 2]]]
    assert all(comm.axis_of(c, world.mesh) == "stage" and c["trip_count"] == M + S - 1
               and c["computation"] != "ENTRY" and c["bytes"] == 2 * 8 * 8 * 4 * 4
               for c in permutes)
    issued = sum(c["bytes"] * c["trip_count"] for c in permutes)
    assert issued == comm.pipeline_bytes(M, 2, [(8, 8, 4)], 4) * (M + S - 1) // M
    stage_ar = [c for c in rows["stage"]["collectives"] if c["kind"] == "all-reduce"]
    assert [(c["computation"], c["trip_count"]) for c in stage_ar] == [("ENTRY", 1)]
    (grad_ar,) = rows[("data", "stage")]["collectives"]
    assert (grad_ar["kind"], grad_ar["computation"], grad_ar["trip_count"]) == (
        "all-reduce", "ENTRY", 1)
    assert len(grad_ar["operands"]) == len(leaves(v["params"]))
    assert rows[("data", "stage")]["bytes"] == 4 * sum(x.size for x in leaves(v["params"]))
    if bn_mode == "sync":
        branches = set()
        for line in hlo.splitlines():
            if "branch_computations={" in line:
                text = line.split("branch_computations={", 1)[1].split("}", 1)[0]
                branches |= {b.strip().lstrip("%") for b in text.split(",")}
        data = rows["data"]["collectives"]
        assert all(c["kind"] == "all-reduce" and c["computation"] in branches
                   and c["trip_count"] == M + S - 1 for c in data)
        channels = [x.shape[-1] for x in leaves(v["batch_stats"]) if x.ndim == 1][::2]
        assert rows["data"]["bytes"] == 2 * (M + S - 1) * sum(2 * c + 1 for c in channels) * 4
    print(bn_mode, {str(k): (r["count"], r["bytes"], [(c["kind"], len(c["operands"]))
                                                      for c in r["collectives"]])
                    for k, r in rows.items()})


def test_the_mesh_axes_group_form_of_newer_xla():
    """jaxlib 0.12 prints shard_map's groups by mesh axes: the same groups as the lists."""
    g = comm.device_groups("channel_id=1, replica_groups=mesh['data'=2,'model'=2] {'data'}, "
                           "use_global_device_ids=true, to_apply=%region_0.0")
    assert g["groups"] == [[0, 2], [1, 3]] and g["channel_id"] == 1
    assert comm.device_groups("replica_groups=mesh['data'=2,'stage'=4] {'stage'}")["groups"] == \
        [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert comm.device_groups("replica_groups=mesh['data'=2,'stage'=2] {'data','stage'}")[
        "groups"] == [[0, 1, 2, 3]]
