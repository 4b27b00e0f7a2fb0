"""Start from weights (issue 41, item 1): another run's checkpoint or a parameter file,
loaded by name into a fresh run; a classifier of another shape re-initialised; a resume
continues from its own checkpoint, never from the weights again."""
import jax
import numpy as np
import pytest
from flax import serialization

from helpers import small_config, to_host
from trjax.data import input_pipeline as ip
from trjax.data.datasets import Split
from trjax.train import checkpoint, init_from, setup, train_and_evaluate

DIGITS = ip.load_digits()


def _digits(classes, relabel=True):
    """The digits of ``classes`` only (labels 0..len-1 when ``relabel``)."""
    def part(s):
        keep = np.isin(s.labels, classes)
        y = s.labels[keep]
        return Split(s.images[keep], np.searchsorted(classes, y).astype(np.int32) if relabel
                     else y.astype(np.int32))
    k = len(classes) if relabel else 10
    return DIGITS._replace(train=part(DIGITS.train), val=part(DIGITS.val), num_classes=k)


CFG = dict(devices="2", global_batch_size=64, eval_batch_size=64, num_epochs=1,
           log_every_steps=0, tensorboard=False, checkpoint_async=False)


def _leaves(tree):
    return {jax.tree_util.keystr(p): np.asarray(v)
            for p, v in jax.tree_util.tree_flatten_with_path(tree)[0]}


def test_plan_matches_by_path_and_shape_and_names_what_it_left():
    abstract = {"params": {"conv": {"kernel": jax.ShapeDtypeStruct((3, 3, 1, 8), np.float32)},
                           "head": {"kernel": jax.ShapeDtypeStruct((8, 5), np.float32),
                                    "bias": jax.ShapeDtypeStruct((5,), np.float32)},
                           "new": {"scale": jax.ShapeDtypeStruct((8,), np.float32)}},
                "batch_stats": {"bn": {"mean": jax.ShapeDtypeStruct((8,), np.float32)}}}
    weights = init_from.read_weights({
        "params": {"conv": {"kernel": np.ones((3, 3, 1, 8), np.float64)},
                   "head": {"kernel": np.ones((8, 10)), "bias": np.ones(10)},
                   "old": {"w": np.ones(2)}},
        "batch_stats": {"bn": {"mean": np.full(8, 2.0)}}})
    plan = init_from.plan_load(abstract, weights)
    assert plan.loaded == ["params/conv/kernel", "batch_stats/bn/mean"]
    assert plan.values["params"]["conv/kernel"].dtype == np.float32  # the model's dtype
    assert plan.reinitialised == [("params/head/kernel", (8, 5), (8, 10)),
                                  ("params/head/bias", (5,), (10,))]
    assert plan.missing == ["params/new/scale"] and plan.unused == ["params/old/w"]
    assert "re-initialised params/head/kernel: the model's (8, 5), stored (8, 10)" in \
        plan.describe()
    with pytest.raises(ValueError, match=r"matched none of the model's .* prefix"):
        init_from.plan_load(abstract, init_from.read_weights({"inner": weights["params"]}))


def test_parameter_files_read_by_name(tmp_path):
    tree = {"params": {"a": {"kernel": np.arange(6.0).reshape(2, 3)}},
            "batch_stats": {"bn": {"var": np.ones(3)}}}
    np.savez(tmp_path / "w.npz", **{"params/a/kernel": tree["params"]["a"]["kernel"],
                                    "batch_stats/bn/var": np.ones(3)})
    (tmp_path / "w.msgpack").write_bytes(serialization.msgpack_serialize(tree))
    (tmp_path / "p.msgpack").write_bytes(serialization.msgpack_serialize(tree["params"]))
    for name in ("w.npz", "w.msgpack"):
        w = init_from.read_weights(tmp_path / name)
        np.testing.assert_array_equal(w["params"]["a/kernel"], tree["params"]["a"]["kernel"])
        np.testing.assert_array_equal(w["batch_stats"]["bn/var"], np.ones(3))
    assert list(init_from.read_weights(tmp_path / "p.msgpack")["params"]) == ["a/kernel"]
    with pytest.raises(FileNotFoundError, match="does not exist: give a trjax workdir"):
        init_from.read_weights(tmp_path / "missing")
    (tmp_path / "w.pt").write_bytes(b"")
    with pytest.raises(ValueError, match=r"reads a workdir or checkpoints folder, a .npz"):
        init_from.read_weights(tmp_path / "w.pt")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="holds no trjax checkpoint"):
        init_from.read_weights(tmp_path / "empty")


@pytest.mark.job
def test_fine_tune_loads_a_checkpoint_by_name_and_a_resume_does_not_load_again(tmp_path):
    """Train on digits 0-4 (5 classes), then start a 10-class run on 5-9 from it: every
    leaf but the classifier is the checkpoint's, bitwise (BN statistics included, the EMA
    too); the classifier is the fresh run's own initialisation. A fine-tune stopped after
    step 2 and resumed ends bitwise where the uninterrupted fine-tune ends."""
    pre = str(tmp_path / "pre")
    train_and_evaluate(small_config(halt_after_steps=4, **CFG), pre, data=_digits([0, 1, 2, 3, 4]))
    stored, _ = checkpoint.read(pre + "/checkpoints")
    target = _digits([5, 6, 7, 8, 9], relabel=False)
    cfg = small_config(ema_decay=0.9, init_from=pre, **CFG)
    tr = setup(cfg, target)
    assert [n for n, _, _ in tr.init_plan.reinitialised] == ["params/head/bias",
                                                             "params/head/kernel"]
    state = to_host(init_from.apply(tr.state, tr.init_plan))
    fresh = to_host(tr.state)
    want = {**_leaves({"params": stored["params"], "batch_stats": stored["batch_stats"]})}
    got = _leaves({"params": state.params, "batch_stats": state.batch_stats})
    for k, v in got.items():
        ref = _leaves(fresh.params if "params" in k else fresh.batch_stats)[
            k.split("]", 1)[1]] if "head" in k else want[k]
        np.testing.assert_array_equal(v, ref, err_msg=k)
    for a, b in zip(jax.tree_util.tree_leaves(state.opt_state.ema),
                    jax.tree_util.tree_leaves(state.params)):
        np.testing.assert_array_equal(a, b)
    whole, _ = train_and_evaluate(cfg, str(tmp_path / "whole"), data=target)
    train_and_evaluate(small_config(halt_after_steps=2, ema_decay=0.9, init_from=pre, **CFG),
                       str(tmp_path / "cut"), data=target)
    resumed, _ = train_and_evaluate(cfg, str(tmp_path / "cut"), data=target)
    for a, b in zip(jax.tree_util.tree_leaves(to_host(whole)),
                    jax.tree_util.tree_leaves(to_host(resumed))):
        np.testing.assert_array_equal(a, b)


TV_SHAPES = {  # torchvision resnet18's state_dict, num_classes=7 (its names and layouts)
    "conv1.weight": (64, 3, 7, 7), "bn1.weight": (64,), "fc.weight": (7, 512), "fc.bias": (7,),
    "layer2.0.conv1.weight": (128, 64, 3, 3), "layer2.0.downsample.0.weight": (128, 64, 1, 1),
    "layer2.0.downsample.1.running_var": (128,), "layer4.1.bn2.running_mean": (512,),
    "layer4.1.bn2.num_batches_tracked": ()}


def test_torchvision_names_and_layouts_map_onto_the_built_in_resnet():
    """Every mapped name is a leaf of trjax's resnet18 with the transposed shape; the
    values are moved, not changed; a key of another model is refused by name."""
    from trjax import models
    rng = np.random.default_rng(0)
    sd = {k: rng.normal(size=s).astype(np.float32) for k, s in TV_SHAPES.items()}
    v = init_from.from_torchvision_resnet(sd)
    model = models.create_model("resnet18", num_classes=7, bn_mode="local", axis_name=None)
    abstract = jax.eval_shape(lambda: model.init(jax.random.key(0),
                                                 np.zeros((1, 64, 64, 3), np.float32),
                                                 train=False))
    plan = init_from.plan_load(abstract, init_from.read_weights(v))
    assert len(plan.loaded) == 8 and not plan.reinitialised and not plan.unused
    np.testing.assert_array_equal(v["params"]["stem_conv"]["kernel"],
                                  sd["conv1.weight"].transpose(2, 3, 1, 0))
    np.testing.assert_array_equal(v["params"]["head"]["kernel"], sd["fc.weight"].T)
    np.testing.assert_array_equal(v["batch_stats"]["stage2_block1"]["proj_bn"]["var"],
                                  sd["layer2.0.downsample.1.running_var"])
    np.testing.assert_array_equal(v["batch_stats"]["stage4_block2"]["BatchNorm_1"]["mean"],
                                  sd["layer4.1.bn2.running_mean"])
    with pytest.raises(ValueError, match=r"'features.0.weight' is not a torchvision ResNet"):
        init_from.from_torchvision_resnet({"features.0.weight": np.zeros((1, 1, 1, 1))})


@pytest.mark.parametrize("name", ["resnet18", "resnet50"])
def test_torchvision_resnet_logits_equal_trjax_after_conversion(name, tmp_path):
    """A torchvision ResNet with random weights (BN statistics randomised too), converted
    and loaded through a .npz: trjax's evaluation logits equal torch's on the same
    normalised images within fp32 rounding. Runs where torch and torchvision are
    installed (the `bench` extra)."""
    torch = pytest.importorskip("torch")
    tv = pytest.importorskip("torchvision")
    from trjax import models
    torch.manual_seed(0)
    net = getattr(tv.models, name)(num_classes=10).eval()
    with torch.no_grad():
        for m in net.modules():
            if isinstance(m, torch.nn.BatchNorm2d):
                m.running_mean.uniform_(-0.5, 0.5)
                m.running_var.uniform_(0.5, 2.0)
                m.weight.uniform_(0.5, 1.5)
                m.bias.uniform_(-0.2, 0.2)
    x = np.random.default_rng(1).normal(size=(4, 3, 64, 64)).astype(np.float32)
    with torch.no_grad():
        want = net(torch.from_numpy(x)).numpy()
    path = init_from.save_npz(tmp_path / "w.npz", init_from.from_torchvision_resnet(
        net.state_dict()))
    model = models.create_model(name, num_classes=10, bn_mode="local", axis_name=None)
    abstract = jax.eval_shape(lambda: model.init(jax.random.key(0),
                                                 np.zeros((1, 64, 64, 3), np.float32),
                                                 train=False))
    plan = init_from.plan_load(abstract, init_from.read_weights(path))
    assert not plan.missing and not plan.reinitialised and not plan.unused
    variables = {c: _unflat(plan.values[c]) for c in ("params", "batch_stats")}
    got = np.asarray(model.apply(variables, x.transpose(0, 2, 3, 1), train=False))
    print(f"{name}: max |trjax - torch| {np.abs(got - want).max():.3g}, max |logit| "
          f"{np.abs(want).max():.3g}")
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


def _unflat(flat):
    from flax import traverse_util
    return traverse_util.unflatten_dict(flat, sep="/")
