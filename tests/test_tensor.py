"""Tensor parallelism (trjax.parallel.tensor, trjax.parallel.mappings): Megatron's f / g /
gather, a built-in ResNet's default plan, the initial shards, and one tensor-parallel
forward + backward against one device.

Mesh ``data:D,model:T`` on simulated CPU devices (conftest: 8). The per-device step is
``shard_map(check_vma=False)``, as the train step that uses tensor parallelism runs.
The reference is ONE device on the concatenated batch (``sync`` BatchNorm: exactly the
same statistics) or, for ``running``, one device per data rank on that rank's rows.
"""
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

from helpers import reorder_rounding_bound
from trjax import comm, models, steps
from trjax.batchnorm import update_running_tree
from trjax.parallel import mappings, tensor
from trjax.parallel.shards import local_shapes
from trjax.world import make_world, parse_mesh



@pytest.fixture(autouse=True)
def highest_precision():
    """fp32 matmuls at full precision (a no-op on CPU; GPUs would use TF32), for this
    module only: the setting is process-wide."""
    with jax.default_matmul_precision("highest"):
        yield

IMAGE = (8, 8, 3)
BATCH = 8
U = 2.0 ** -24


def resnet8(num_classes=10, bn_mode="sync", axis_name="data", **kw):
    return models.create_model("resnet8", num_classes=num_classes, bn_mode=bn_mode,
                               axis_name=axis_name, **kw)


@functools.lru_cache(maxsize=None)
def full_init(num_classes):
    """The unsplit model's variables, as the trainer initialises them (one key, jitted)."""
    net = models.as_network(resnet8(num_classes))
    v = jax.jit(lambda k: net.init(k, IMAGE))(jax.random.key(0))
    return jax.tree_util.tree_map(np.asarray, v)


def split(module, t, image=IMAGE):
    """``(network, param specs, stats specs)``: ``module`` split t ways over ``model`` by
    its default plan, as :func:`trjax.parallel.tensor.layout` splits it."""
    net = models.as_network(module)
    roles = tensor.resolve(net, tensor.default_plan(module), image, t)
    v = net.abstract_variables(image)
    return (dataclasses.replace(net, layer_plan=tensor.Plan(roles, "model", t)),
            tensor.specs(v["params"], roles), tensor.specs(v["batch_stats"], roles))


def shard_tree(tree, specs, mesh):
    """Whole arrays laid out on ``mesh`` by ``specs`` (each device holds its slice)."""
    return jax.tree_util.tree_map(lambda x, s: jax.device_put(x, NamedSharding(mesh, s)),
                                  tree, specs, is_leaf=lambda x: isinstance(x, P))


def batch(num_classes, seed=0):
    rng = np.random.default_rng(seed)
    return {"image": rng.normal(size=(BATCH,) + IMAGE).astype(np.float32),
            "label": rng.integers(0, num_classes, BATCH).astype(np.int32),
            "mask": np.ones(BATCH, np.float32)}


def local_slice(full, spec, model_index, size, axis="model"):
    """numpy: model rank ``model_index``'s slice of ``full`` under ``spec``."""
    idx = []
    for d, e in enumerate(tuple(spec) + (None,) * (full.ndim - len(spec))):
        if e == axis:
            n = full.shape[d] // size
            idx.append(slice(model_index * n, (model_index + 1) * n))
        else:
            idx.append(slice(None))
    return full[tuple(idx)]


def leaves_with_specs(tree, specs):
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    sp = jax.tree_util.tree_leaves(specs, is_leaf=lambda s: isinstance(s, P))
    return [(jax.tree_util.keystr(p), np.asarray(x), s) for (p, x), s in zip(flat, sp)]


# -- the mappings ------------------------------------------------------------------------


@pytest.mark.parametrize("check_vma", [False, True])
def test_mappings_give_exact_gradients_where_plain_psum_does_not(check_vma):
    """A replicated x -> f -> column matmul -> (a) row matmul -> g, (b) gather: the
    gradient equals one device's; plain lax.psum under check_vma=False gives T times
    the partial sums of x's gradient (psum transposes to psum, and no f is inserted)."""
    world = make_world("4", 4, mesh="data:1,model:4")
    rng = np.random.default_rng(1)
    x = rng.normal(size=(3, 8)).astype(np.float32)
    w1 = rng.normal(size=(8, 8)).astype(np.float32)   # column: split on out
    w2 = rng.normal(size=(8, 5)).astype(np.float32)   # row: split on in
    w3 = rng.normal(size=(8, 12)).astype(np.float32)  # head: split on out (12 / 4)

    def loss(x, w1, w2, w3, split):
        h = split["f"](x) @ w1
        y = split["g"](jnp.tanh(h) @ w2)
        z = split["gather"](split["f"](jnp.sin(y).sum(-1, keepdims=True) * x) @ w3)
        return jnp.sum(y * y) + jnp.sum(jnp.cos(z))

    one = {"f": lambda v: v, "g": lambda v: v, "gather": lambda v: v}
    ref = jax.jit(jax.grad(lambda *a: loss(*a, one), argnums=(0, 1, 2, 3)))(x, w1, w2, w3)
    megatron = {"f": lambda v: mappings.copy_to_model(v, "model"),
                "g": lambda v: mappings.reduce_from_model(v, "model"),
                "gather": lambda v: mappings.gather_from_model(v, "model", -1)}
    plain = {"f": lambda v: v, "g": lambda v: lax.psum(v, "model"),
             "gather": lambda v: lax.all_gather(v, "model", axis=1, tiled=True)}

    def run(mapping):
        def per_device(x, w1, w2, w3):
            g = jax.grad(lambda *a: loss(*a, mapping), argnums=(0, 1, 2, 3))(x, w1, w2, w3)
            return g[0][None], g[1], g[2], g[3]
        return jax.jit(jax.shard_map(
            per_device, mesh=world.mesh, in_specs=(P(), P(None, "model"), P("model"),
                                                   P(None, "model")),
            out_specs=(P("model"), P(None, "model"), P("model"), P(None, "model")),
            check_vma=check_vma))(x, w1, w2, w3)

    gx, g1, g2, g3 = run(megatron)
    for got, want in zip((gx[0], g1, g2, g3), ref):
        # elements that cancel (x's gradient sums terms of |~30|) err relative to the
        # array's scale, not their own (seen on jaxlib 0.12: 3e-5 on an element of 0.29)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5,
                                   atol=1e-5 * float(np.abs(np.asarray(want)).max()))
    assert np.array_equal(np.asarray(gx), np.broadcast_to(np.asarray(gx[0]), gx.shape))
    if not check_vma:
        # plain psum / all_gather transpose to psum / psum_scatter: every weight gradient
        # is T = 4 times the true one, and x's is T times this rank's partial sum only
        px, p1, p2, p3 = run(plain)
        for got, want in zip((p1, p2, p3), ref[1:]):
            np.testing.assert_allclose(np.asarray(got), 4 * np.asarray(want), rtol=1e-4,
                                       atol=1e-4)
        assert not np.allclose(np.asarray(px[0]), np.asarray(ref[0]), rtol=1e-2)


# -- the plan, the specs, the initial shards -----------------------------------------------


def test_default_plan_specs_and_errors():
    m = resnet8()
    assert tensor.default_plan(m) == {"stage3_block1/Conv_0": "column",
                                      "stage3_block1/Conv_1": "row", "head": "column"}
    net = models.as_network(m)
    assert tensor.resolve(net, tensor.default_plan(m), IMAGE, 2) == {
        ("stage3_block1", "Conv_0"): "column", ("stage3_block1", "BatchNorm_0"): "channel",
        ("stage3_block1", "Conv_1"): "row", ("head",): "head"}
    v = full_init(10)
    _, specs, sspecs = split(m, 2)
    split_leaves = {k: s for k, _, s in leaves_with_specs(v["params"], specs) if s != P()}
    assert split_leaves == {
        "['head']['bias']": P("model"), "['head']['kernel']": P(None, "model"),
        "['stage3_block1']['BatchNorm_0']['bias']": P("model"),
        "['stage3_block1']['BatchNorm_0']['scale']": P("model"),
        "['stage3_block1']['Conv_0']['kernel']": P(None, None, None, "model"),
        "['stage3_block1']['Conv_1']['kernel']": P(None, None, "model", None)}
    assert {k for k, _, s in leaves_with_specs(v["batch_stats"], sspecs) if s != P()} == {
        "['stage3_block1']['BatchNorm_0']['mean']", "['stage3_block1']['BatchNorm_0']['var']"}
    local = local_shapes(v["params"], specs, {"data": 2, "model": 2})
    assert local["stage3_block1"]["Conv_0"]["kernel"].shape == (3, 3, 32, 32)
    assert local["stage3_block1"]["Conv_1"]["kernel"].shape == (3, 3, 32, 64)
    assert local["head"]["kernel"].shape == (64, 5)
    assert local["stage3_block1"]["proj_conv"]["kernel"].shape == (1, 1, 32, 64)
    # errors before anything is traced, naming the layer, its channels and valid sizes
    with pytest.raises(ValueError, match=r"head splits its 10 output channels.*\[1, 2, 5, 10\]"):
        tensor.resolve(net, tensor.default_plan(m), IMAGE, 4)
    tensor.resolve(models.as_network(resnet8(8)), tensor.default_plan(m), IMAGE, 4)
    with pytest.raises(ValueError, match=r"stage3_block1/Conv_0 splits its 64 output channels"):
        tensor.resolve(net, tensor.default_plan(m), IMAGE, 3)
    with pytest.raises(ValueError, match="divide"):
        local_shapes(v["params"], specs, {"model": 3})


def test_initial_shards_are_the_unsplit_parameters_slices_bitwise():
    """Megatron's test_initialization.py: every device's shard of every leaf equals the
    numpy slice of the unsplit initialisation, bit for bit, on data:2,model:2."""
    world = make_world("4", BATCH, mesh="data:2,model:2")
    v = full_init(10)
    _, pspecs, sspecs = split(resnet8(), 2)
    for coll, specs in (("params", pspecs), ("batch_stats", sspecs)):
        sharded = shard_tree(v[coll], specs, world.mesh)
        for (path, g), (_, full, spec) in zip(
                jax.tree_util.tree_flatten_with_path(sharded)[0],
                leaves_with_specs(v[coll], specs)):
            assert g.shape == full.shape
            for shard in g.addressable_shards:
                coords = np.argwhere(world.mesh.device_ids == shard.device.id)[0]
                want = local_slice(full, spec, int(coords[1]), 2)
                got = np.asarray(shard.data)
                assert got.shape == want.shape and got.tobytes() == want.tobytes(), path


# -- forward + backward against one device ----------------------------------------------------


def tp_step(world, tp_model, v, bn_mode, pspecs, sspecs):
    """The compiled per-device forward + backward of ``tp_model`` (shard_map over the
    whole mesh, check_vma=False): grads and metric sums psum'd over data, BN sums
    too in ``running``, then the running update. Every output stacked per device
    (leading axis D*T in mesh order). Returns ``(compiled, args)``."""

    def per_device(params, stats, b):
        grads, sums, bn_sums, rules = steps.forward_backward(
            tp_model, params, stats, b, bn_mode=bn_mode, axis_name="data")
        grads, sums = lax.psum((grads, sums), "data")
        if bn_mode == "running":
            bn_sums = lax.psum(bn_sums, "data")
        new_stats = update_running_tree(stats, bn_sums, 0.9, rules)
        return jax.tree_util.tree_map(lambda a: a[None], (grads, sums, bn_sums, new_stats))

    fn = jax.jit(jax.shard_map(per_device, mesh=world.mesh,
                               in_specs=(pspecs, sspecs, P("data")),
                               out_specs=P(("data", "model")), check_vma=False))
    args = (shard_tree(v["params"], pspecs, world.mesh),
            shard_tree(v["batch_stats"], sspecs, world.mesh),
            jax.device_put(batch(tp_model.module.num_classes), world.sharded()))
    return fn.lower(*args).compile(), args, (pspecs, sspecs)


@functools.lru_cache(maxsize=None)
def _one_device_step(num_classes, bn_mode):
    """The jitted one-device forward + backward, traced once per model (the running
    reference calls it on each data rank's rows)."""
    model = resnet8(num_classes, bn_mode, axis_name=None)

    def f(params, stats, b):
        grads, sums, bn_sums, rules = steps.forward_backward(
            model, params, stats, b, bn_mode=bn_mode, axis_name=None)
        return grads, sums, bn_sums, update_running_tree(stats, bn_sums, 0.9, rules)
    return jax.jit(f)


def one_device(num_classes, v, b, bn_mode):
    return jax.tree_util.tree_map(np.asarray, _one_device_step(num_classes, bn_mode)(
        v["params"], v["batch_stats"], b))


@functools.lru_cache(maxsize=None)
def compiled_case(mesh, num_classes, bn_mode):
    """``(world, tp_model, (compiled step, args, specs))``, compiled once per case."""
    world = make_world(str(np.prod([s for _, s in parse_mesh(mesh)])), BATCH, mesh=mesh)
    t = int(world.mesh.shape["model"])
    tp_model, pspecs, sspecs = split(resnet8(num_classes, bn_mode), t)
    return world, tp_model, tp_step(world, tp_model, full_init(num_classes), bn_mode, pspecs,
                                    sspecs)


def reference(num_classes, bn_mode, data_size):
    """One device: the whole batch (sync), or each data rank's rows apart, summed (running)."""
    v, b = full_init(num_classes), batch(num_classes)
    if bn_mode == "sync":
        return one_device(num_classes, v, b, bn_mode)
    n = BATCH // data_size
    parts = [one_device(num_classes, v,
                        jax.tree_util.tree_map(lambda a: a[r * n:(r + 1) * n], b), bn_mode)
             for r in range(data_size)]
    grads, sums, bn_sums = jax.tree_util.tree_map(lambda *a: sum(a), *[p[:3] for p in parts])
    new_stats = update_running_tree(v["batch_stats"], bn_sums, 0.9)
    return grads, sums, bn_sums, jax.tree_util.tree_map(np.asarray, new_stats)


CASES = [("data:2,model:2", 10, "sync"), ("data:1,model:4", 8, "sync"),
         ("data:2,model:2", 10, "running")]


@pytest.mark.parametrize("mesh,num_classes,bn_mode", CASES)
def test_tensor_parallel_step_equals_one_device(mesh, num_classes, bn_mode):
    """Loss/metric sums, every gradient, the BN sums and the new running statistics of
    EVERY device equal its slice of the one-device reference, within the fp32
    reordering bound (helpers.reorder_rounding_bound, one step): the longest sum the
    split reorders is a BN statistic or a kernel gradient over B*H*W = 512 values, or
    Conv_1's 9*64 = 576-term dot product cut into T partial sums; rows = 576."""
    world, tp_model, (compiled, args, (pspecs, sspecs)) = compiled_case(mesh, num_classes,
                                                                        bn_mode)
    d, t = (int(world.mesh.shape[a]) for a in ("data", "model"))
    got = jax.tree_util.tree_map(np.asarray, compiled(*args))
    want = reference(num_classes, bn_mode, d)
    rows = max(BATCH * IMAGE[0] * IMAGE[1], 9 * 64)
    v = full_init(num_classes)
    worst, where = 0.0, None
    checks = [(got[0], want[0], pspecs, jax.tree_util.tree_map(np.zeros_like, want[0])),
              (got[3], want[3], sspecs, v["batch_stats"])]
    for g_tree, w_tree, specs, start in checks:
        bound = reorder_rounding_bound(start, rows)
        for (path, w, spec), g in zip(leaves_with_specs(w_tree, specs),
                                      jax.tree_util.tree_leaves(g_tree)):
            lim = bound(path, w)
            assert g.shape[0] == d * t and lim > 0, path
            for dev in range(d * t):
                want_slice = local_slice(w, spec, dev % t, t)
                diff = float(np.max(np.abs(g[dev].astype(np.float64) - want_slice)))
                assert diff <= lim, (path, dev, diff, lim)
                if diff / lim > worst:
                    worst, where = diff / lim, (path, diff / np.abs(w).max())
    # metric sums [loss, top1, top5, count] on every device
    lim = 2 * (rows - 1) * U * np.abs(want[1]).max()
    assert np.all(np.abs(got[1] - want[1][None]) <= lim), (got[1], want[1])
    worst = max(worst, float(np.abs(got[1] - want[1][None]).max() / lim))
    # BN sums [2C+1]: a split BN's are its channels' (C, then C, then n)
    split_bn = {k for k, role in tp_model.layer_plan.roles.items() if role == "channel"}
    for path, w in ((p, np.asarray(x))
                    for p, x in jax.tree_util.tree_flatten_with_path(want[2])[0]):
        keys = tuple(k.key for k in path)
        g = np.asarray(functools.reduce(lambda a, k: a[k], keys, got[2]))
        lim = 2 * (rows - 1) * U * np.abs(w).max() + 2 * U * np.abs(w).max()
        for dev in range(d * t):
            if keys[:-1] in split_bn:
                c = (w.shape[0] - 1) // 2
                n = c // t
                m = dev % t
                w_dev = np.concatenate([w[m * n:(m + 1) * n], w[c + m * n:c + (m + 1) * n],
                                        w[-1:]])
            else:
                w_dev = w
            diff = float(np.max(np.abs(g[dev] - w_dev)))
            assert diff <= lim, (path, dev, diff, lim)
            worst = max(worst, diff / lim)
    print(f"{mesh} K={num_classes} {bn_mode}: worst |TP - 1 device| / bound = {worst:.3g} "
          f"(worst leaf of params/stats: {where[0]}, |diff| / max|leaf| = {where[1]:.2g})")


def replica_groups(line: str):
    """The replica groups of one HLO collective line, as a set of frozensets
    (:func:`trjax.comm.device_groups`: explicit, iota and jaxlib 0.12's mesh-axes forms)."""
    groups = comm.device_groups(line)["groups"]
    assert groups is not None, line
    return {frozenset(g) for g in groups}


def test_hlo_has_one_model_all_reduce_each_way_per_pair_and_the_head_gather():
    """data:2,model:2 (sync BN): over the model groups {0,1},{2,3} exactly the split
    block's forward g and backward f all-reduces, the head's backward f all-reduce and
    its logits all-gather (its backward is a local slice); no model collective for the
    split BatchNorm, whose statistics go over the data groups {0,2},{1,3} like every
    other BatchNorm's; nothing over all four devices."""
    world, _, (compiled, _, _) = compiled_case("data:2,model:2", 10, "sync")
    text = compiled.as_text()
    found = comm.collectives_in_hlo(text)
    model_groups = {frozenset({0, 1}), frozenset({2, 3})}
    data_groups = {frozenset({0, 2}), frozenset({1, 3})}
    lines = {}
    for line in text.splitlines():
        s = line.strip()
        if "=" in s and "replica_groups=" in s:
            lines[s.split("=")[0].strip().lstrip("%").removeprefix("ROOT ").strip()] = s
    by_axis = {"model": [], "data": []}
    for c in found:
        name = c["name"].lstrip("%")
        line = lines.get(name) or next(v for k, v in lines.items() if k.endswith(name))
        groups = replica_groups(line)
        axis = "model" if groups == model_groups else "data" if groups == data_groups else None
        assert axis is not None, (c["kind"], groups)
        by_axis[axis].append(c["kind"])
    assert sorted(by_axis["model"]) == ["all-gather", "all-reduce", "all-reduce",
                                        "all-reduce"], by_axis["model"]
    assert set(by_axis["data"]) == {"all-reduce"}
    # 9 sync BatchNorms' statistics forward and backward, the gradient / metric psum: over
    # data only (XLA's combiner merges independent ones: 15 all-reduces measured, jax 0.10.2)
    assert len(by_axis["data"]) >= 2, by_axis["data"]
    print(f"collectives over model: {sorted(by_axis['model'])}; over data: "
          f"{len(by_axis['data'])} all-reduces")


def test_evaluation_with_folded_batchnorm_gives_the_full_logits():
    """The evaluation apply (BatchNorm folded from each device's slices) on
    data:2,model:2: every device's logits [B/2, 10] are the one-device ones."""
    world = make_world("4", BATCH, mesh="data:2,model:2")
    v = full_init(10)
    net, pspecs, sspecs = split(resnet8(), 2)
    ref_net = models.as_network(resnet8(axis_name=None))
    x = batch(10)["image"]

    def per_device(params, stats, x):
        return net.apply_eval(params, net.fold(params, stats), x, folded=True)[None]
    got = np.asarray(jax.jit(jax.shard_map(
        per_device, mesh=world.mesh, in_specs=(pspecs, sspecs, P("data")),
        out_specs=P(("data", "model")), check_vma=False))(
            shard_tree(v["params"], pspecs, world.mesh),
            shard_tree(v["batch_stats"], sspecs, world.mesh), x))
    want = np.asarray(jax.jit(lambda p, s, x: ref_net.apply_eval(p, ref_net.fold(p, s), x, True))(
        v["params"], v["batch_stats"], x))
    for dev in range(4):
        rows = want[(dev // 2) * 4:(dev // 2 + 1) * 4]
        np.testing.assert_allclose(got[dev], rows, rtol=0, atol=2 * 576 * U * np.abs(want).max())


def test_bottleneck_split_equals_one_device():
    """A two-stage Bottleneck ResNet (Conv_0 1x1 column, Conv_1 3x3 strided row, g, then
    replicated) on data:2,model:2, sync BN: the data-summed gradients (split leaves
    gathered by their specs) and metric sums equal one device's on the whole batch."""
    mk = lambda axis: models.ResNet(stage_sizes=(1, 1), block=models.Bottleneck, widths=(4, 8),
                                    stem_width=8, num_classes=6, bn_mode="sync", axis_name=axis)
    world = make_world("4", BATCH, mesh="data:2,model:2")
    full, (tp, ps, ss) = mk(None), split(mk("data"), 2)
    v = jax.jit(lambda k: models.as_network(full).init(k, IMAGE))(jax.random.key(0))
    assert ps["stage2_block1"]["Conv_1"]["kernel"] == P(None, None, "model", None)
    assert ps["stage2_block1"]["Conv_2"]["kernel"] == P()
    b = batch(6)

    def per_device(p, s, b):
        g, sums, _, _ = steps.forward_backward(tp, p, s, b, bn_mode="sync", axis_name="data")
        return lax.psum((g, sums), "data")
    got = jax.jit(jax.shard_map(per_device, mesh=world.mesh, in_specs=(ps, ss, P("data")),
                                out_specs=(ps, P()), check_vma=False))(
        shard_tree(v["params"], ps, world.mesh), shard_tree(v["batch_stats"], ss, world.mesh), b)
    want = jax.jit(lambda p, s, b: steps.forward_backward(
        full, p, s, b, bn_mode="sync", axis_name=None)[:2])(v["params"], v["batch_stats"], b)
    got, want = jax.tree_util.tree_map(np.asarray, (got, want))
    bound = reorder_rounding_bound(jax.tree_util.tree_map(np.zeros_like, want[0]),
                                   BATCH * IMAGE[0] * IMAGE[1])
    for (path, w), g in zip(jax.tree_util.tree_flatten_with_path(want[0])[0],
                            jax.tree_util.tree_leaves(got[0])):
        key = jax.tree_util.keystr(path)
        assert np.abs(g - w).max() <= bound(key, w), key
    np.testing.assert_allclose(got[1], want[1], rtol=1e-6)
