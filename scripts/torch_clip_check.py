"""One clipped SGD step of trjax on fsdp:8 against PyTorch's ``clip_grad_norm_``.

  python scripts/torch_clip_check.py [--clip 0.05] [--torch-python PATH]

trjax side (8 simulated CPU devices, mesh ``fsdp:8``): a tiny flax model (3x3 conv 1->8,
ReLU, global average pool, dense 8->10), the first 32 training digits (standardised with
the data set's statistics, as trjax's steps do), one train step of
momentum SGD (lr 0.1, momentum 0.9, no weight decay) with ``grad_clip_norm``; the step's
logged ``grad_norm`` and the params after it. Torch side: the same model in plain torch,
unsplit, on the same weights and batch (mean cross-entropy), ``loss.backward()``,
``torch.nn.utils.clip_grad_norm_`` (its return value: the norm before clipping), then
``torch.optim.SGD(lr, momentum)``. Printed: both norms and the max abs difference of
every parameter after the step (JSON).

torch is not a test dependency (it is in the ``bench`` extra). When this Python cannot
import it, ``--torch-python`` names one that can (a venv with torch and numpy only): the
torch side then runs there on an ``.npz`` of the weights and batch.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

import numpy as np

GLOBAL, LR, MOMENTUM, WIDTH = 32, 0.1, 0.9, 8


def trjax_side(clip: float, mesh: str = "fsdp:8") -> dict:
    """One trjax step on ``mesh`` (8 devices): ``{"start": {name: array}, "after": ..., "image",
    "label", "grad_norm"}`` in torch's layouts (OIHW conv, [out, in] dense, NCHW)."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               " --xla_force_host_platform_device_count=8").strip()
    import flax.linen as nn
    import jax

    from trjax import steps
    from trjax.configs import default
    from trjax.data import input_pipeline as ip
    from trjax.train import trainer

    model = nn.Sequential([nn.Conv(WIDTH, (3, 3)), nn.relu, lambda x: x.mean(axis=(1, 2)),
                           nn.Dense(10)])
    c = default.get_config()
    for k, v in dict(devices="8", mesh=mesh, global_batch_size=GLOBAL,
                     eval_batch_size=GLOBAL, warmup_epochs=0, optimizer="sgd",
                     learning_rate=LR, momentum=MOMENTUM, weight_decay=0.0,
                     grad_clip_norm=clip).items():
        c[k] = v
    data = ip.load_digits()
    tr = trainer.prepare(c, data, model=model)
    state = trainer.train_state_program(0, tr.layout, tr.exchange).finish()
    batch = {"image": data.train.images[:GLOBAL], "label": data.train.labels[:GLOBAL],
             "mask": np.ones(GLOBAL, np.float32)}
    host = lambda t: jax.tree_util.tree_map(np.asarray, jax.device_get(t))  # noqa: E731
    start = host(state.params)
    step = jax.jit(steps.make_train_step(tr.layout, tr.exchange, tr.plan,
                                         trainer.step_options(tr)))
    after, metrics = step(state, ip.to_device(batch, tr.world.sharded(), 10))
    assert float(metrics.finite) == 1.0
    to_torch = lambda p: {  # noqa: E731
        "conv.weight": p["layers_0"]["kernel"].transpose(3, 2, 0, 1),
        "conv.bias": p["layers_0"]["bias"],
        "fc.weight": p["layers_3"]["kernel"].T, "fc.bias": p["layers_3"]["bias"]}
    net = tr.layout.network  # trjax standardises the input with the data set's statistics
    image = np.asarray(batch["image"], np.float32)
    if net.mean is not None:
        image = (image - np.float32(net.mean)) / np.float32(net.std)
    return {"start": to_torch(start), "after": to_torch(host(after.params)),
            "image": image.astype(np.float32).transpose(0, 3, 1, 2),
            "label": np.asarray(batch["label"], np.int64),
            "grad_norm": float(metrics.grad_norm)}


def torch_side(start: dict, image, label, clip: float) -> dict:
    """The same step in plain torch: ``{"after": {name: array}, "grad_norm"}``."""
    import torch

    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = torch.nn.Conv2d(image.shape[1], WIDTH, 3, padding=1)
            self.fc = torch.nn.Linear(WIDTH, 10)

        def forward(self, x):
            return self.fc(torch.relu(self.conv(x)).mean(dim=(2, 3)))

    torch.manual_seed(0)
    net = Tiny()
    net.load_state_dict({k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in start.items()})
    opt = torch.optim.SGD(net.parameters(), lr=LR, momentum=MOMENTUM)
    loss = torch.nn.functional.cross_entropy(net(torch.from_numpy(image)),
                                             torch.from_numpy(label))
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(net.parameters(), clip)
    opt.step()
    return {"after": {k: v.detach().numpy() for k, v in net.state_dict().items()},
            "grad_norm": float(norm)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clip", type=float, default=0.05)
    ap.add_argument("--mesh", default="fsdp:8", help="an 8-device mesh for the trjax step")
    ap.add_argument("--torch-python", default=None,
                    help="a Python that imports torch, when this one does not")
    ap.add_argument("--torch-side", default=None, help=argparse.SUPPRESS)  # internal: an npz
    args = ap.parse_args()
    if args.torch_side:  # in the torch Python: read the npz, write the result beside it
        z = np.load(args.torch_side)
        start = {k[len("start/"):]: z[k] for k in z.files if k.startswith("start/")}
        out = torch_side(start, z["image"], z["label"], args.clip)
        np.savez(args.torch_side + ".out.npz", grad_norm=out["grad_norm"],
                 **{f"after/{k}": v for k, v in out["after"].items()})
        return
    ours = trjax_side(args.clip, args.mesh)
    if args.torch_python is None:
        theirs = torch_side(ours["start"], ours["image"], ours["label"], args.clip)
    else:
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "step.npz")
            np.savez(path, image=ours["image"], label=ours["label"],
                     **{f"start/{k}": v for k, v in ours["start"].items()})
            subprocess.run([args.torch_python, os.path.abspath(__file__), "--clip",
                            str(args.clip), "--torch-side", path], check=True)
            z = np.load(path + ".out.npz")
            theirs = {"grad_norm": float(z["grad_norm"]),
                      "after": {k[len("after/"):]: z[k] for k in z.files if k != "grad_norm"}}
    diff = {k: float(np.abs(ours["after"][k].astype(np.float64) - theirs["after"][k]).max())
            for k in ours["after"]}
    moved = max(float(np.abs(ours["after"][k] - ours["start"][k]).max()) for k in diff)
    print(json.dumps({"mesh": args.mesh, "clip": args.clip,
                      "grad_norm_trjax": ours["grad_norm"], "grad_norm_torch": theirs["grad_norm"],
                      "grad_norm_rel_diff": abs(ours["grad_norm"] - theirs["grad_norm"]) /
                      theirs["grad_norm"],
                      "params_max_abs_diff": max(diff.values()), "per_param": diff,
                      "largest_update": moved}, indent=1))


if __name__ == "__main__":
    main()
