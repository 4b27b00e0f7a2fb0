import jax
import jax.numpy as jnp
import numpy as np
import pytest

from trjax import models
from trjax.plan import BUCKETS, METRICS, build_plan
from trjax.regions import Region, assign_regions


def _variables(model, shape):
    return jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.zeros((2,) + shape), train=False))


@pytest.mark.parametrize("name,shape,n_convs,n_bn", [
    ("resnet20", (32, 32, 3), 21, 21),   # stem + 18 block convs + 2 projections
    ("resnet50", (64, 64, 3), 53, 53),   # stem + 48 bottleneck convs + 4 projections
])
def test_regions_from_the_tree(name, shape, n_convs, n_bn):
    model = models.create_model(name, num_classes=10)
    v = _variables(model, shape)
    regions = assign_regions(model, v, jax.ShapeDtypeStruct((2,) + shape, jnp.float32))
    count = lambda r: sum(1 for x in regions.values() if x == r)
    assert [k for k, r in regions.items() if r == Region.FIRST_CONV] == ["params/stem_conv/kernel"]
    assert count(Region.DEEP_CONV) == n_convs - 1
    assert count(Region.BN_SCALE) == count(Region.BN_BIAS) == n_bn
    assert count(Region.RUNNING_MEAN) == count(Region.RUNNING_VAR) == n_bn
    assert [k for k, r in regions.items() if r == Region.FC_WEIGHT] == ["params/head/kernel"]
    assert [k for k, r in regions.items() if r == Region.FC_BIAS] == ["params/head/bias"]
    assert len(regions) == len(jax.tree_util.tree_leaves(v))


def test_first_conv_is_found_by_call_order_not_name():
    import flax.linen as nn
    from trjax.batchnorm import BatchNorm

    class Odd(nn.Module):  # the input conv is called "zzz", defined last
        @nn.compact
        def __call__(self, x, train=True, mask=None):
            a = nn.Conv(4, (3, 3), name="zzz")
            b = nn.Conv(4, (3, 3), name="aaa")
            x = b(BatchNorm(name="bn")(a(x), train, mask))
            return nn.Dense(3, name="fc")(x.mean((1, 2)))

    m = Odd()
    v = _variables(m, (8, 8, 1))
    regions = assign_regions(m, v, jax.ShapeDtypeStruct((2, 8, 8, 1), jnp.float32))
    assert regions["params/zzz/kernel"] == Region.FIRST_CONV
    assert regions["params/aaa/kernel"] == Region.DEEP_CONV
    assert regions["params/zzz/bias"] == Region.BN_BIAS  # every vector: the first bucket
    assert regions["params/aaa/bias"] == Region.BN_BIAS
    assert regions["params/fc/kernel"] == Region.FC_WEIGHT


def test_plan_layout_and_roundtrip():
    model = models.create_model("resnet8", num_classes=10)
    plan = build_plan(model, (8, 8, 1))
    v = _variables(model, (8, 8, 1))
    sizes = {b: 0 for b in BUCKETS}
    for r in plan.regions:  # regions are contiguous and in seed order
        assert r.offset == sizes[r.bucket]
        sizes[r.bucket] += r.size
        assert r.nbytes == 4 * r.size
    assert sizes == dict(plan.bucket_elements)
    assert [r.region for r in plan.regions if r.bucket == "first"] == list(BUCKETS["first"])
    [metrics_run] = [r for r in plan.regions if r.region == Region.METRICS]
    assert (metrics_run.bucket, metrics_run.size) == ("deep", len(METRICS))
    assert metrics_run.offset + len(METRICS) == plan.bucket_elements["deep"]
    assert plan.metrics_slot == ("deep", plan.bucket_elements["deep"] - len(METRICS))
    n_params = sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(v["params"]))
    assert plan.gradient_elements == n_params
    assert sum(plan.bucket_elements.values()) == n_params + len(METRICS)
    # pack/unpack is the identity, each leaf lands at its slot
    rng = np.random.default_rng(0)
    grads = jax.tree_util.tree_map(lambda x: rng.normal(size=x.shape).astype(np.float32), v["params"])
    metrics = np.arange(4, dtype=np.float32)
    bufs = plan.pack(grads, metrics)
    back, m = plan.unpack(bufs)
    for a, b in zip(jax.tree_util.tree_leaves(back), jax.tree_util.tree_leaves(grads)):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(m, metrics)
    stem = plan.slots[[s.name for s in plan.slots].index("params/stem_conv/kernel")]
    np.testing.assert_array_equal(bufs["first"][stem.offset:stem.offset + stem.size],
                                  grads["stem_conv"]["kernel"].ravel())
    # the plan is a pure function of the model: identical when rebuilt
    assert build_plan(model, (8, 8, 1)).describe() == plan.describe()


@pytest.mark.parametrize("kernel_order", ["HWIO", "IHWO"])
@pytest.mark.parametrize("policy", ["two", "tail_minimal", "size:0.1", "per_leaf"])
def test_bucket_policies_cover_every_leaf_once(policy, kernel_order):
    model = models.create_model("resnet20", num_classes=10)
    plan = build_plan(model, (8, 8, 1), policy, kernel_order)
    v = _variables(model, (8, 8, 1))
    n_params = sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(v["params"]))
    assert sum(plan.bucket_elements.values()) == n_params + len(METRICS)
    covered = {b: np.zeros(n, int) for b, n in plan.bucket_elements.items()}
    for s in plan.slots:
        covered[s.bucket][s.offset:s.offset + s.size] += 1
    b, o = plan.metrics_slot
    covered[b][o:o + len(METRICS)] += 1
    assert all((c == 1).all() for c in covered.values())
    rng = np.random.default_rng(0)
    grads = jax.tree_util.tree_map(lambda x: rng.normal(size=x.shape).astype(np.float32), v["params"])
    back, m = plan.unpack(plan.pack(grads, np.arange(4, dtype=np.float32)))
    assert all((a == b).all() for a, b in zip(jax.tree_util.tree_leaves(back),
                                            jax.tree_util.tree_leaves(grads)))


def test_policy_layouts():
    model = models.create_model("resnet20", num_classes=10)
    tail = build_plan(model, (8, 8, 1), "tail_minimal")
    stem = [s.name for s in tail.slots if s.bucket == "stem"]
    assert sorted(stem) == ["params/stem_bn/bias", "params/stem_bn/scale", "params/stem_conv/kernel"]
    head_order = [s.name for s in sorted(tail.slots, key=lambda s: s.offset) if s.bucket == "head"]
    assert sorted(head_order[:2]) == ["params/head/bias", "params/head/kernel"]  # first in backward
    sized = build_plan(model, (8, 8, 1), "size:0.5")
    sizes = [n * 4 for n in sized.bucket_elements.values()]
    assert len(sizes) >= 2 and all(s <= 0.5 * 2 ** 20 + 4096 for s in sizes)
    per_leaf = build_plan(model, (8, 8, 1), "per_leaf")
    assert len(per_leaf.bucket_elements) == len(per_leaf.slots) + 1
    with pytest.raises(ValueError, match=r"bucket policy 'size:x'"):
        build_plan(model, (8, 8, 1), "size:x")
    with pytest.raises(ValueError, match=r"bucket policy 'three' is not one of"):
        build_plan(model, (8, 8, 1), "three")


def test_kernel_order_ihwo_lays_conv_gradients_out_transposed():
    model = models.create_model("resnet8", num_classes=10)
    v = _variables(model, (8, 8, 1))
    hwio = build_plan(model, (8, 8, 1))
    ihwo = build_plan(model, (8, 8, 1), "two", "IHWO")
    # same buckets, offsets and sizes: only the order inside a conv kernel's run changes
    assert [(s.bucket, s.offset, s.size) for s in ihwo.slots] == \
        [(s.bucket, s.offset, s.size) for s in hwio.slots]
    assert ihwo.describe()["kernel_order"] == "IHWO"
    rng = np.random.default_rng(1)
    grads = jax.tree_util.tree_map(lambda x: rng.normal(size=x.shape).astype(np.float32), v["params"])
    bufs = ihwo.pack(grads, np.zeros(4, np.float32))
    flat = dict(zip([s.name for s in ihwo.slots], jax.tree_util.tree_leaves(grads)))
    for s in ihwo.slots:
        run = np.asarray(bufs[s.bucket][s.offset:s.offset + s.size])
        g = np.asarray(flat[s.name])
        if s.region in (Region.FIRST_CONV, Region.DEEP_CONV):  # [kh, kw, I, O] -> [I, kh, kw, O]
            assert s.order == (2, 0, 1, 3)
            np.testing.assert_array_equal(run, g.transpose(2, 0, 1, 3).ravel())
        else:
            assert s.order is None
            np.testing.assert_array_equal(run, g.ravel())
    back, _ = ihwo.unpack(bufs)
    assert all((a == b).all() for a, b in zip(jax.tree_util.tree_leaves(back),
                                            jax.tree_util.tree_leaves(grads)))
    # the per-leaf baseline keeps the parameters' own order
    per_leaf = build_plan(model, (8, 8, 1), "per_leaf", "IHWO")
    assert per_leaf.kernel_order == "HWIO" and all(s.order is None for s in per_leaf.slots)
    with pytest.raises(ValueError, match=r"kernel_order='OIHW' is not one of"):
        build_plan(model, (8, 8, 1), "two", "OIHW")
