"""Tensors as dtype + shape + bytes: vLLM's dtype names, numpy/torch conversion, zero-copy.

numpy has no bfloat16, so bfloat16 bytes are carried as uint16 storage on the numpy side and
reinterpreted (never converted) on the torch side.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

from .errors import InvalidArgument, MissingDependency

if TYPE_CHECKING:
    import torch

# vLLM's 13 accepted tensor dtypes -> numpy storage dtype.
DTYPES: dict[str, np.dtype] = {
    "bool": np.dtype(np.bool_),
    "uint8": np.dtype(np.uint8),
    "int8": np.dtype(np.int8),
    "float16": np.dtype(np.float16),
    "bfloat16": np.dtype(np.uint16),
    "uint16": np.dtype(np.uint16),
    "int16": np.dtype(np.int16),
    "float32": np.dtype(np.float32),
    "uint32": np.dtype(np.uint32),
    "int32": np.dtype(np.int32),
    "float64": np.dtype(np.float64),
    "uint64": np.dtype(np.uint64),
    "int64": np.dtype(np.int64),
}
DTYPE_ITEMSIZE: dict[str, int] = {name: dt.itemsize for name, dt in DTYPES.items()}
MAX_RANK = 32
MAX_NBYTES = 2**63 - 1  # int64: what the wire, numpy and torch can count


def dtype_from_name(name: str) -> np.dtype:
    """The numpy dtype of a wire dtype name; InvalidArgument for one not in ``DTYPES``."""
    try:
        return DTYPES[name]
    except KeyError:
        raise InvalidArgument(f"dtype {name!r} is not one of {', '.join(DTYPES)}") from None


def tensor_nbytes(shape: Sequence[int], name: str) -> int:
    """Bytes of a ``name`` tensor of ``shape``, counted exactly (Python ints, never a wrapping
    int64): a forged shape must not pass for a plausible size. Refuses negative dims, a rank above
    MAX_RANK, and shapes whose elements or bytes (zero dims aside, as numpy counts) exceed int64."""
    itemsize = dtype_from_name(name).itemsize
    if len(shape) > MAX_RANK:
        raise InvalidArgument(f"rank {len(shape)} exceeds {MAX_RANK}")
    if any(d < 0 for d in shape):
        raise InvalidArgument(f"shape must not be negative: {tuple(shape)}")
    if math.prod(d for d in shape if d) * itemsize > MAX_NBYTES:
        raise InvalidArgument(f"shape {tuple(shape)} of {name} exceeds {MAX_NBYTES} bytes")
    return math.prod(shape) * itemsize


def _is_torch(obj: Any) -> bool:
    return type(obj).__module__.startswith("torch")


# Native-order numpy dtypes -> their names, the common case of dtype_name (others take its checks).
_NUMPY_NAMES: dict[np.dtype, str] = {np.dtype(name): name for name in DTYPES if name != "bfloat16"}


def dtype_name(x: Any) -> str:
    """vLLM's dtype name (``str(torch.dtype)`` minus ``torch.``) of a name, a numpy array / dtype,
    or a torch tensor / dtype. Only the 13 dtypes of ``DTYPES``; numpy data must be little-endian."""
    if np.little_endian and isinstance(x, (np.ndarray, np.dtype)):
        known = _NUMPY_NAMES.get(x.dtype if isinstance(x, np.ndarray) else x)
        if known is not None:
            return known
    if isinstance(x, str):
        name = x.removeprefix("torch.")
    elif isinstance(x, (np.ndarray, np.dtype)) or (isinstance(x, type) and issubclass(x, np.generic)):
        dt = x.dtype if isinstance(x, np.ndarray) else np.dtype(x)
        if dt.byteorder == ">" or (dt.byteorder == "=" and not np.little_endian and dt.itemsize > 1):
            raise InvalidArgument(f"dtype {dt} is big-endian; tensors travel as little-endian bytes")
        name = dt.name
    else:
        text = str(getattr(x, "dtype", x))
        if not text.startswith("torch."):
            raise InvalidArgument(f"not a dtype: {x!r}")
        name = text.removeprefix("torch.")
    if name not in DTYPES:
        raise InvalidArgument(f"dtype {name!r} is not one of {', '.join(DTYPES)}")
    return name


def as_byte_array(tensor: Any) -> tuple[np.ndarray, str, tuple[int, ...]]:
    """(flat uint8 view of the bytes, dtype name, shape) of a numpy array or CPU torch tensor.

    Contiguous inputs are viewed without a copy; others are made contiguous first (one copy).
    """
    if _is_torch(tensor):
        import torch

        if tensor.device.type != "cpu":
            raise InvalidArgument(f"tensor is on {tensor.device}; move it to the CPU first")
        name = dtype_name(tensor.dtype)
        shape = tuple(tensor.shape)
        flat = tensor.detach().contiguous().reshape(-1)
        if tensor.dtype is torch.bfloat16:
            flat = flat.view(torch.uint16)
        array = flat.numpy()
    elif isinstance(tensor, np.ndarray):
        name = dtype_name(tensor.dtype)
        shape = tuple(tensor.shape)
        array = np.ascontiguousarray(tensor).reshape(-1)
    else:
        raise InvalidArgument(f"expected a numpy array or torch tensor, got {type(tensor).__name__}")
    if len(shape) > MAX_RANK:
        raise InvalidArgument(f"rank {len(shape)} exceeds {MAX_RANK}")
    return array.view(np.uint8), name, shape


def to_torch(array: np.ndarray, name: str) -> torch.Tensor:
    """Zero-copy torch tensor over a numpy array holding ``name``-typed bytes.

    Torch has no read-only tensors: over a read-only mapping an in-place op dies of SIGSEGV, so a
    lease's tensors come from ``Lease.tensor`` (private copy-on-write pages), not from here."""
    import warnings

    try:
        import torch
    except ImportError as exc:
        raise MissingDependency("torch tensors need torch: pip install 'shmtransport[torch]' "
                                "(numpy views need nothing more: use .array)") from exc
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # read-only arrays: the caller owns writability
        tensor = torch.from_numpy(array)
    return tensor.view(torch.bfloat16) if name == "bfloat16" else tensor
