"""Hardware profiles for the planner: peak compute, memory bandwidth and links.

A :class:`Hardware` gives what :func:`trjax.cost.predict` needs to turn a compiled
step's FLOPs, bytes and per-axis collective bytes into seconds: peak FLOP/s per
device (by precision), HBM bytes/s, and an alpha-beta :class:`Link` (latency,
bandwidth) inside a node and between nodes.

* ``h100``, ``h200`` (:data:`PROFILES`): datasheet figures, each with its source.
* ``cpu``: measured on this host by :func:`calibrate_cpu` (a few seconds): the
  simulated devices run their programs on the same cores, so the figures are
  per device *while every device works*, which is how a step runs.
* a JSON file with the fields of :class:`Hardware` (links as ``{"latency_s",
  "bytes_per_s"}``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import time

MEMORY_UNITS = {"KiB": 2 ** 10, "MiB": 2 ** 20, "GiB": 2 ** 30, "TiB": 2 ** 40,
                "KB": 10 ** 3, "MB": 10 ** 6, "GB": 10 ** 9, "TB": 10 ** 12}


def parse_bytes(text) -> int:
    """``"24GiB"``, ``"512MiB"``, ``"16GB"`` -> bytes (int).

    Raises:
      ValueError: a number without a unit, an unknown unit or a value that is not
        positive, naming the value and the units.
    """
    s = str(text).strip()
    for unit in sorted(MEMORY_UNITS, key=len, reverse=True):
        if s.endswith(unit):
            try:
                value = float(s[:-len(unit)])
            except ValueError:
                break
            if value > 0:
                return int(value * MEMORY_UNITS[unit])
            break
    raise ValueError(f"memory {text!r} must be a positive number with a unit, one of "
                     f"{list(MEMORY_UNITS)} (e.g. '24GiB')")


@dataclasses.dataclass(frozen=True)
class Link:
    """An alpha-beta link: a collective of ``b`` bytes sent per device takes
    ``latency_s + b / bytes_per_s`` seconds."""
    latency_s: float
    bytes_per_s: float


@dataclasses.dataclass(frozen=True)
class Hardware:
    """One device kind and its interconnect.

    Attributes:
      name: the profile's name.
      flops_per_s: peak FLOP/s per device by precision (``"fp32"``, ``"bf16"``,
        ``"fp16"``; fp32 is what XLA's default matmul precision runs, TF32 on GPUs).
      memory_bytes_per_s: HBM (or host memory) bytes/s per device.
      intra_node, inter_node: the links inside a node and between nodes.
      devices_per_node: an axis whose groups fit in a node uses ``intra_node``.
      memory_bytes: memory per device (0: unknown).
      roofline: ``"max"`` (compute and memory traffic overlap, the roofline) or
        ``"sum"`` (they run one after another).
      source: where the figures come from.
    """
    name: str
    flops_per_s: dict
    memory_bytes_per_s: float
    intra_node: Link
    inter_node: Link
    devices_per_node: int
    memory_bytes: int = 0
    roofline: str = "max"
    source: str = ""

    def flops(self, precision: str) -> float:
        """Peak FLOP/s per device at ``precision`` (fp16 falls back to bf16)."""
        return float(self.flops_per_s.get(precision) or self.flops_per_s.get("bf16") or
                     self.flops_per_s["fp32"])

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


_NVLINK4 = Link(latency_s=10e-6, bytes_per_s=450e9)     # 900 GB/s bidirectional per GPU
_NDR_IB = Link(latency_s=20e-6, bytes_per_s=50e9)       # one 400 Gb/s NDR port per GPU
PROFILES = {
    "h100": Hardware(
        "h100", {"fp32": 494.7e12, "bf16": 989.4e12, "fp16": 989.4e12}, 3.35e12,
        _NVLINK4, _NDR_IB, devices_per_node=8, memory_bytes=80 * 10 ** 9,
        source="NVIDIA H100 Tensor Core GPU datasheet (SXM5): TF32 494.7, BF16/FP16 989.4 "
               "dense TFLOP/s, HBM3 3.35 TB/s, NVLink 4 900 GB/s per GPU (450 GB/s each "
               "way); ConnectX-7 NDR InfiniBand 400 Gb/s per GPU; latencies: NCCL's "
               "small-message all-reduce on NVLink (~10 us) and IB (~20 us)"),
    "h200": Hardware(
        "h200", {"fp32": 494.7e12, "bf16": 989.4e12, "fp16": 989.4e12}, 4.8e12,
        _NVLINK4, _NDR_IB, devices_per_node=8, memory_bytes=141 * 10 ** 9,
        source="NVIDIA H200 Tensor Core GPU datasheet (SXM): TF32 494.7 (as H100), BF16/FP16 "
               "989.4 dense TFLOP/s, HBM3e 4.8 TB/s, 141 GB, NVLink 4 900 GB/s per GPU; "
               "ConnectX-7 NDR 400 Gb/s per GPU; latencies as h100"),
}


def resolve(spec: str, devices=None) -> Hardware:
    """The :class:`Hardware` for ``spec``: a name of :data:`PROFILES`, ``"cpu"``
    (:func:`calibrate_cpu` on ``devices``), a JSON file's path, or ``""`` (the
    devices' own: a GPU whose name holds H100/H200 gets that profile, a CPU is
    calibrated).

    Raises:
      ValueError: an unknown name, an unreadable file or a GPU with no profile,
        naming the profiles and the JSON fields.
    """
    import jax
    devices = list(devices or jax.devices())
    spec = str(spec or "").strip()
    if not spec:
        kind = getattr(devices[0], "device_kind", "").lower()
        if devices[0].platform == "cpu":
            spec = "cpu"
        else:
            spec = next((n for n in PROFILES if n in kind.replace(" ", "")), "")
            if not spec:
                raise ValueError(f"no hardware profile for device kind {kind!r}: pass "
                                 f"--hardware one of {sorted(PROFILES)} or a JSON file with "
                                 f"the fields of trjax.hardware.Hardware")
    if spec == "cpu":
        return calibrate_cpu(devices)
    if spec in PROFILES:
        return PROFILES[spec]
    if os.path.isfile(spec):
        return from_json(spec)
    raise ValueError(f"--hardware {spec!r} is neither a profile ({sorted(PROFILES) + ['cpu']}) "
                     "nor a JSON file")


def from_json(path: str) -> Hardware:
    """A :class:`Hardware` from a JSON file of its fields.

    Raises:
      ValueError: a missing or unknown field, naming it.
    """
    with open(path) as f:
        d = json.load(f)
    fields = {f.name for f in dataclasses.fields(Hardware)}
    unknown = sorted(set(d) - fields)
    if unknown:
        raise ValueError(f"{path}: unknown hardware fields {unknown}; the fields are "
                         f"{sorted(fields)}")
    try:
        d["intra_node"], d["inter_node"] = Link(**d["intra_node"]), Link(**d["inter_node"])
        return Hardware(**d)
    except (KeyError, TypeError) as e:
        raise ValueError(f"{path}: {e}; the fields are {sorted(fields)} (links as "
                         "{'latency_s', 'bytes_per_s'})") from None


def _best_time(fn, *args, repeats: int = 7) -> float:
    """The fastest of ``repeats`` calls after one warm-up: the least disturbed by
    other work on the host."""
    import jax
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t)
    return min(times)


def calibrate_cpu(devices) -> Hardware:
    """This host's figures for ``devices`` (simulated CPU devices), measured with
    every device working at once, as in a step: a 3x3 convolution's forward and
    backward (FLOP/s per device), an elementwise pass over 16 MiB per device
    (bytes/s per device), and an all-reduce over all devices of 4 B (latency) and
    of 4 MiB per device (bandwidth: bytes sent per device, ring count), each the
    fastest of 7 calls. Takes a few seconds; ``roofline="sum"`` (XLA:CPU runs a step's kernels one after
    another on the same cores)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    n = len(devices)
    mesh = Mesh(np.array(devices), ("d",))
    put = lambda x: jax.device_put(x, NamedSharding(mesh, P("d")))  # noqa: E731
    spmd = lambda f: jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P("d"), out_specs=P("d")))  # noqa: E731

    def conv_grad(x):
        w = jnp.full((3, 3, 32, 32), 0.01, x.dtype)
        f = lambda w, x: jnp.sum(jax.lax.conv_general_dilated(  # noqa: E731
            x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")) ** 2)
        gw, gx = jax.grad(f, argnums=(0, 1))(w, x)
        return gx + jnp.sum(gw)
    x = put(np.random.default_rng(0).normal(size=(8 * n, 16, 16, 32)).astype(np.float32))
    flops = 3 * 2.0 * 8 * 16 * 16 * 32 * 9 * 32  # forward, input and weight gradients
    flops_per_s = flops / _best_time(spmd(conv_grad), x)
    y = put(np.ones((n * 2 ** 22,), np.float32))  # 16 MiB per device
    memory = 2 * 4 * 2 ** 22 / _best_time(spmd(lambda v: v * 1.0001 + 1.0), y)
    reduce = spmd(lambda v: jax.lax.psum(v, "d"))
    latency = _best_time(reduce, put(np.ones((n,), np.float32)))
    big = 2 ** 20  # floats per device
    sent = 2 * (n - 1) / n * 4 * big
    bandwidth = sent / max(_best_time(reduce, put(np.ones((n * big,), np.float32))) - latency,
                           1e-9)
    link = Link(latency_s=latency, bytes_per_s=bandwidth)
    return Hardware("cpu", {"fp32": flops_per_s}, memory, link, link, devices_per_node=n,
                    roofline="sum",
                    source=f"measured on this host over {n} simulated CPU devices "
                           f"({os.cpu_count()} cores) by trjax.hardware.calibrate_cpu")
