"""Readers of the distributed file formats: CIFAR python pickles and IDX (MNIST) files.

Used by :mod:`trjax.data.datasets`; they check what they read and name the file in
every error (``ValueError``).
"""

from __future__ import annotations

import codecs
import gzip
import math
import pickle
import zlib
from pathlib import Path

import numpy as np

def _numpy_globals() -> dict:
    # The only globals a CIFAR pickle refers to: numpy's array and dtype
    # reconstruction, under the names numpy 1.x / python 2 (numpy.core) and
    # numpy 2 (numpy._core) write, and the bytes constructor of protocol 2.
    reconstruct = np.ndarray((0,)).__reduce__()[0]
    allowed = {("numpy", "ndarray"): np.ndarray, ("numpy", "dtype"): np.dtype,
               ("_codecs", "encode"): codecs.encode}  # bytes in Python 3 protocol-2 pickles
    numeric = getattr(np, "_core", None) or np.core  # numpy 2 / numpy 1.x
    frombuffer = getattr(numeric.numeric, "_frombuffer", None)  # protocol 5 arrays
    for mod in ("numpy.core", "numpy._core"):
        allowed[(f"{mod}.multiarray", "_reconstruct")] = reconstruct
        if frombuffer is not None:
            allowed[(f"{mod}.numeric", "_frombuffer")] = frombuffer
    return allowed


class _CifarUnpickler(pickle.Unpickler):
    """An unpickler that builds numpy arrays and plain containers only.

    A pickle can run arbitrary code when loaded; a CIFAR batch never needs
    anything beyond numpy's array reconstruction, so every other global is refused.
    """
    _allowed = _numpy_globals()

    def find_class(self, module, name):
        try:
            return self._allowed[(module, name)]
        except KeyError:
            raise pickle.UnpicklingError(f"refers to {module}.{name}, which a CIFAR batch never "
                                         f"does; refusing to load it") from None


def read_cifar_pickle(path: Path, label_key: bytes) -> tuple[np.ndarray, np.ndarray]:
    """One CIFAR batch -> (images [N, 32, 32, 3] uint8, labels [N] int64)."""
    try:
        with open(path, "rb") as f:
            obj = _CifarUnpickler(f, encoding="bytes").load()
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError,
            IndexError, KeyError, OverflowError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not a CIFAR python pickle: {e}") from e
    if not isinstance(obj, dict):
        raise ValueError(f"{path}: expected a pickled dict, got {type(obj).__name__}")
    obj = {k.encode() if isinstance(k, str) else k: v for k, v in obj.items()}
    missing = [k for k in (b"data", label_key) if k not in obj]
    if missing:
        raise ValueError(f"{path}: missing key(s) {missing}; found {sorted(obj, key=repr)} "
                         f"(expected b'data' and {label_key!r})")
    data = obj[b"data"]
    if not isinstance(data, np.ndarray) or data.dtype != np.uint8 or data.ndim != 2 \
            or data.shape[1] != 3072:
        shape = getattr(data, "shape", None)
        dtype = getattr(data, "dtype", type(data).__name__)
        raise ValueError(f"{path}: b'data' must be a uint8 array [N, 3072] (3x32x32, channel "
                         f"planes), got shape {shape} dtype {dtype}")
    labels = np.asarray(obj[label_key])
    if labels.shape != (len(data),):
        raise ValueError(f"{path}: {len(data)} images but {label_key!r} has shape {labels.shape}")
    # Rows are the red, green and blue 32x32 planes, each row-major.
    images = data.reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1)
    return np.ascontiguousarray(images), labels


_IDX_DTYPES = {0x08: np.dtype(">u1"), 0x09: np.dtype(">i1"), 0x0B: np.dtype(">i2"),
               0x0C: np.dtype(">i4"), 0x0D: np.dtype(">f4"), 0x0E: np.dtype(">f8")}

def _read_bytes(path: Path) -> bytes:
    if path.suffix != ".gz":
        return path.read_bytes()
    try:
        with gzip.open(path, "rb") as f:
            return f.read()
    except (OSError, EOFError, zlib.error) as e:
        raise ValueError(f"{path} is not a valid gzip file: {e}") from e


def read_idx(path, expected_magic: int | None = None) -> np.ndarray:
    """Parses one IDX file (the MNIST format), plain or gzipped (``.gz`` suffix).

    Format: a big-endian 4-byte magic number ``0x00 0x00 TYPE NDIM``, then NDIM
    big-endian uint32 sizes, then the values row-major, big-endian, TYPE one of
    0x08 uint8, 0x09 int8, 0x0B int16, 0x0C int32, 0x0D float32, 0x0E float64.

    Args:
      path: the file.
      expected_magic: if given, the magic number the file must carry (e.g.
        ``0x803`` = 2051 for uint8 images [N, H, W], ``0x801`` = 2049 for uint8
        labels [N]).

    Returns:
      An array of the header's shape, in native byte order.

    Raises:
      FileNotFoundError: ``path`` does not exist.
      ValueError: a bad magic number, unknown type code, truncated header, or a
        data size that differs from what the header's sizes require (names the
        file, both sizes or both magic numbers).
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: expected an IDX file")
    raw = _read_bytes(path)
    if len(raw) < 4:
        raise ValueError(f"{path}: {len(raw)} bytes is too short for an IDX header")
    magic = int.from_bytes(raw[:4], "big")
    if expected_magic is not None and magic != expected_magic:
        raise ValueError(f"{path}: bad IDX magic number 0x{magic:08x}, expected "
                         f"0x{expected_magic:08x}")
    zero, code, ndim = raw[0:2], raw[2], raw[3]
    if zero != b"\x00\x00" or code not in _IDX_DTYPES:
        raise ValueError(f"{path}: bad IDX magic number 0x{magic:08x} (expected 0x0000TTNN "
                         f"with type TT in {[hex(c) for c in _IDX_DTYPES]})")
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise ValueError(f"{path}: truncated IDX header ({len(raw)} bytes, need {header} "
                         f"for {ndim} dimensions)")
    dims = tuple(int(d) for d in np.frombuffer(raw, ">u4", count=ndim, offset=4))
    dtype = _IDX_DTYPES[code]
    need = math.prod(dims) * dtype.itemsize
    have = len(raw) - header
    if have != need:
        raise ValueError(f"{path}: size mismatch, the header's dims {dims} need {need} bytes of "
                         f"data but the file holds {have}")
    return np.frombuffer(raw, dtype, offset=header).reshape(dims).astype(dtype.newbyteorder("="))
