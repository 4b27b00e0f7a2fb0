"""``--gpu``: ResNet-50, 224x224, bf16 on all visible GPUs, against torch.compile +
AMP bf16 + channels_last DDP (NCCL) on the same GPUs and global batch; MFU from
XLA's model flops. ``--gpu --dry_run`` runs the same code path on CPU with tiny
sizes (resnet18 at 32x32, 2 simulated devices / 2 gloo ranks, torch.compile's
eager backend). The timing itself is :func:`benchmarking.throughput.benchmark`."""

from __future__ import annotations

from benchmarking.throughput import benchmark


def check_platform(platform: str, dry_run: bool) -> None:
    """Raises ``SystemExit`` naming the fix when ``--gpu`` finds no GPU."""
    if not dry_run and platform != "gpu":
        raise SystemExit(f"--gpu: no GPU visible to jax (platform {platform}); "
                         "install jax[cuda12] or use --gpu --dry_run")


def run(a) -> dict:
    import jax
    check_platform(jax.devices()[0].platform, a.dry_run)
    return benchmark(a)
