"""Kernel backend selection: ``SHMTRANSPORT_BACKEND=auto|c|python``.

``kernels`` is the module that implements the kernel API (``_native`` over the cffi extension, or
``_purepy``, the reference that specifies it). ``auto`` falls back to Python only when the
extension cannot be imported, and logs that once.
"""
from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Protocol, cast

if TYPE_CHECKING:
    import numpy as np

_log = logging.getLogger("shmtransport")

_CHOICES = ("auto", "c", "python")


class _Xxh3Stream(Protocol):
    def update(self, buf: Any) -> None: ...
    def copy_update(self, dst: Any, src: Any) -> None: ...
    def digest(self) -> bytes: ...
    def reset(self) -> None: ...


class Kernels(Protocol):
    """The kernel API (``_purepy.__all__``, less the ``TREE_CHUNK_NBYTES`` constant), which both
    backend modules implement."""

    @property
    def Xxh3Stream(self) -> type[_Xxh3Stream]:
        """The streaming XXH3-128 class (``update``, ``copy_update``, ``digest``, ``reset``)."""

    def xxh3_128(self, buf: Any) -> bytes:
        """16-byte canonical XXH3-128 (seed 0) of ``buf``."""

    def xxh3_128_many(self, bufs: Iterable[Any]) -> bytes:
        """XXH3-128 of the concatenation of ``bufs``."""

    def tree_digest(self, buf: Any, threads: int | None = None) -> bytes:
        """Tree-mode digest of ``buf`` (see ``_purepy``); independent of ``threads``."""

    def copy_tree_digest(self, dst: Any, src: Any, threads: int | None = None) -> bytes:
        """Copy ``src`` into ``dst`` and return ``tree_digest(src)``."""

    def copy(self, dst: Any, src: Any, threads: int | None = None) -> None:
        """Copy ``src`` into ``dst`` (same nbytes, no overlap)."""

    def mask_pack(self, bools: Any) -> np.ndarray:
        """Pack booleans into MSB-first bytes; padding bits are zero."""

    def mask_unpack(self, packed: Any, nbits: Any) -> np.ndarray:
        """The ``nbits`` booleans of a packed mask."""

    def mask_popcount(self, packed: Any, nbits: Any) -> int:
        """Number of set bits among the first ``nbits``."""

    def mask_indices(self, packed: Any, nbits: Any) -> np.ndarray:
        """Positions of the set bits, ascending, int64."""

    def mask_runs(self, packed: Any, nbits: Any) -> np.ndarray:
        """(start, length) of each maximal run of set bits, int64, shape (k, 2)."""

    def mask_cumsum(self, packed: Any, nbits: Any) -> np.ndarray:
        """Inclusive cumulative sum of the bits, int64, length nbits."""

    def mask_window(self, packed: Any, nbits: Any, start: Any, end: Any) -> tuple[int, int]:
        """(#set in [0, start), #set in [0, end))."""


def _select() -> tuple[str, Kernels]:
    wanted = os.environ.get("SHMTRANSPORT_BACKEND", "auto").strip().lower() or "auto"
    if wanted not in _CHOICES:
        raise ValueError(f"SHMTRANSPORT_BACKEND must be one of {', '.join(_CHOICES)}, got {wanted!r}")
    if wanted == "python":
        from . import _purepy

        return "python", _purepy
    try:
        from . import _native
    except ImportError as exc:
        if wanted == "c":
            raise ImportError(f"SHMTRANSPORT_BACKEND=c but the C extension is not importable: {exc}") from exc
        _log.warning("shmtransport: the C kernels are not importable (%s); using the pure-Python kernels, "
                     "about 1.5x slower to hash, 3x to put with a digest, and every acquire and release a round trip "
                     "to the daemon (no object table). Reinstall with a C compiler present for the C kernels; "
                     "SHMTRANSPORT_BACKEND=python selects the pure-Python ones without this warning.", exc)
        from . import _purepy

        return "python", _purepy
    # A computed __all__ (the specification's) hides _native's names from mypy's check of the
    # module against Kernels; tests/test_kernels_equivalence.py checks that it implements them all.
    return "c", cast("Kernels", _native)


BACKEND, kernels = _select()
