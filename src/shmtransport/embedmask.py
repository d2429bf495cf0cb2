"""is_embed masks and vLLM ``PlaceholderRange`` semantics over them.

A placeholder ``(offset, length)`` spans the prompt positions of one item; ``is_embed`` marks the
positions that receive encoder embeddings. On the wire the mask is packed bits + a bit count
(MSB-first within each byte, ``np.packbits`` order); absent means every position is an embed.
All heavy lifting is done by the backend kernels (``shmtransport._backend.kernels``).
"""
from __future__ import annotations

import dataclasses
import functools
import operator
from typing import Any

import numpy as np

from ._backend import kernels
from .errors import InvalidArgument

__all__ = ["EmbedMask", "PlaceholderRange", "WindowOutOfRange", "get_num_embeds", "embeds_cumsum",
           "extract_embeds_range", "get_embeds_indices_in_range"]


def _int(value: Any, name: str) -> int:
    if isinstance(value, bool):
        raise InvalidArgument(f"{name} must be an int, not bool")
    try:
        return operator.index(value)
    except TypeError:
        raise InvalidArgument(f"{name} must be an int, got {type(value).__name__}") from None


class EmbedMask:
    """An immutable packed bit mask: ``packed`` holds exactly ceil(nbits/8) bytes, MSB-first.

    Padding bits of the last byte are ignored on input and stored as zero, so ``packed`` is
    canonical and equal masks compare (and hash) equal.
    """

    __slots__ = ("_packed", "_nbits", "_num_embeds")

    def __init__(self, packed: Any, nbits: Any):
        count = _int(nbits, "nbits")
        if count < 0:
            raise InvalidArgument(f"nbits must be >= 0, got {count}")
        try:
            raw = bytearray(memoryview(packed).cast("B"))
        except TypeError:
            raise InvalidArgument(f"packed must be a bytes-like buffer, got {type(packed).__name__}") from None
        needed = (count + 7) // 8
        if len(raw) != needed:
            raise InvalidArgument(f"packed has {len(raw)} bytes but nbits={count} needs exactly {needed}")
        if count % 8:
            raw[-1] &= (0xFF << (8 - count % 8)) & 0xFF
        self._packed = bytes(raw)
        self._nbits = count
        self._num_embeds: int | None = None

    @classmethod
    def from_bools(cls, bools: Any) -> "EmbedMask":
        """The mask of ``bools`` (nonzero = set); InvalidArgument if they are not one-dimensional
        booleans or numbers."""
        try:
            packed = kernels.mask_pack(bools)
        except (TypeError, ValueError) as exc:
            raise InvalidArgument(str(exc)) from exc
        return cls(packed, len(np.asarray(bools)))

    @property
    def packed(self) -> bytes:
        """The canonical packed bytes: ceil(nbits/8) of them, MSB-first, padding bits zero."""
        return self._packed

    @property
    def nbits(self) -> int:
        """Number of bits (positions) the mask covers."""
        return self._nbits

    def __len__(self) -> int:
        return self._nbits

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, EmbedMask):
            return NotImplemented
        return self._nbits == other._nbits and self._packed == other._packed

    def __hash__(self) -> int:
        return hash((self._nbits, self._packed))

    def __repr__(self) -> str:
        return f"EmbedMask(nbits={self._nbits}, num_embeds={self.num_embeds()})"

    def to_bools(self) -> np.ndarray:
        """The mask as a new bool array of length ``nbits``."""
        return kernels.mask_unpack(self._packed, self._nbits)

    def num_embeds(self) -> int:
        """Number of set bits (embedding positions); computed once, then cached."""
        if self._num_embeds is None:
            self._num_embeds = kernels.mask_popcount(self._packed, self._nbits)
        return self._num_embeds

    def indices(self) -> np.ndarray:
        """Positions (relative to the placeholder) that are embeds, int64."""
        return kernels.mask_indices(self._packed, self._nbits)

    def runs(self) -> np.ndarray:
        """(start, length) of each run of embeds, int64, shape (k, 2)."""
        return kernels.mask_runs(self._packed, self._nbits)

    def cumsum(self) -> np.ndarray:
        """Inclusive cumulative sum, int64, length nbits (vLLM's ``embeds_cumsum``)."""
        return kernels.mask_cumsum(self._packed, self._nbits)

    def window(self, start: Any, end: Any) -> tuple[int, int]:
        """(#embeds in [0, start), #embeds in [0, end)); requires 0 <= start <= end <= nbits."""
        start, end = _window(self._nbits, start, end)
        return kernels.mask_window(self._packed, self._nbits, start, end)


class WindowOutOfRange(InvalidArgument, IndexError):
    """A window bound past the mask: vLLM indexes its cumsum list there and raises IndexError, so
    this is both our typed InvalidArgument and an IndexError."""


def _window(length: int, start: Any, end: Any) -> tuple[int, int]:
    start = _int(start, "start")
    end = _int(end, "end")
    if not 0 <= start <= length:
        raise InvalidArgument(f"start={start} must be in [0, {length}]")
    if not start <= end <= length:
        raise InvalidArgument(f"end={end} must be in [start={start}, {length}]")
    return start, end


def _check_mask(length: int, is_embed: EmbedMask | None) -> None:
    if is_embed is not None:
        if not isinstance(is_embed, EmbedMask):
            raise InvalidArgument(f"is_embed must be an EmbedMask or None, got {type(is_embed).__name__}")
        if is_embed.nbits != length:
            raise InvalidArgument(f"is_embed has {is_embed.nbits} bits but length is {length}")


# ---------------------------------------------------------------------------------------------
# vLLM PlaceholderRange semantics (vllm/multimodal/inputs.py, 0.32), same results under vLLM's own
# idioms (tests/test_conformance_vllm.py). Indices given to get_embeds_indices_in_range are
# relative to the placeholder; extract_embeds_range returns absolute prompt positions.
# ---------------------------------------------------------------------------------------------
def get_num_embeds(length: int, is_embed: EmbedMask | None) -> int:
    """``length`` when the mask is absent, else the number of set bits."""
    length = _int(length, "length")
    _check_mask(length, is_embed)
    return length if is_embed is None else is_embed.num_embeds()


def embeds_cumsum(length: int, is_embed: EmbedMask | None) -> list[int] | None:
    """Inclusive cumulative sum of the mask as a list of ints (vLLM's type: its own callers write
    ``x[-1] if x else 0``, which an ndarray refuses); None when the mask is absent."""
    _check_mask(_int(length, "length"), is_embed)
    return None if is_embed is None else is_embed.cumsum().tolist()


def extract_embeds_range(offset: int, length: int, is_embed: EmbedMask | None) -> list[tuple[int, int]]:
    """INCLUSIVE absolute ``(start, end)`` runs of embeds; dense: ``[(offset, offset + length - 1)]``."""
    offset = _int(offset, "offset")
    length = _int(length, "length")
    _check_mask(length, is_embed)
    if is_embed is None:
        return [(offset, offset + length - 1)]
    return [(offset + int(s), offset + int(s) + int(n) - 1) for s, n in is_embed.runs().tolist()]


def get_embeds_indices_in_range(length: int, is_embed: EmbedMask | None, start: Any, end: Any) -> tuple[int, int]:
    """Encoder-output indices ``[a, b)`` of the embeds among placeholder positions ``[start, end)``.

    Example: offset=2, length=5, is_embed=[F,T,F,T,T], (3, 5) -> (1, 3). vLLM's rules, windows it
    accepts included: dense returns ``(start, end)`` unchanged (any ints, e.g. (0, 2) on length 1);
    with a mask each bound ``i`` maps to ``cumsum[i-1]`` if ``i > 0`` else 0, independently (so
    start > end is answered, not refused), and ``i > length`` raises ``WindowOutOfRange`` where vLLM
    raises IndexError. Non-int bounds raise InvalidArgument.
    """
    length = _int(length, "length")
    _check_mask(length, is_embed)
    start, end = _int(start, "start"), _int(end, "end")
    if is_embed is None:
        return start, end
    a, b = (_prefix_len(length, i, name) for i, name in ((start, "start"), (end, "end")))
    lo, hi = is_embed.window(min(a, b), max(a, b))  # one kernel pass for both prefix counts
    return (lo, hi) if a <= b else (hi, lo)


def _prefix_len(length: int, i: int, name: str) -> int:
    """How many mask positions vLLM's ``cumsum[i-1] if i > 0 else 0`` counts."""
    if i > length:
        raise WindowOutOfRange(f"{name}={i} is past the placeholder's length {length}")
    return max(i, 0)


@dataclasses.dataclass(frozen=True)
class PlaceholderRange:
    """vLLM's ``PlaceholderRange`` with a packed mask: prompt positions [offset, offset + length)."""

    offset: int
    length: int
    is_embed: EmbedMask | None = None

    def __post_init__(self) -> None:
        offset = _int(self.offset, "offset")
        length = _int(self.length, "length")
        if offset < 0:
            raise InvalidArgument(f"offset must be >= 0, got {offset}")
        if length <= 0:
            raise InvalidArgument(f"length must be > 0, got {length}")
        _check_mask(length, self.is_embed)

    @property
    def num_embeds(self) -> int:
        """How many of the positions take an embedding (``length`` without a mask)."""
        return get_num_embeds(self.length, self.is_embed)

    def get_num_embeds(self) -> int:
        """``num_embeds``, under vLLM's method name."""
        return get_num_embeds(self.length, self.is_embed)

    @functools.cached_property  # cached like vLLM's (frozen dataclasses allow it: it writes __dict__)
    def embeds_cumsum(self) -> list[int] | None:
        """Inclusive cumulative sum of ``is_embed`` as a list (vLLM's type), None without a mask; cached."""
        return embeds_cumsum(self.length, self.is_embed)

    def extract_embeds_range(self) -> list[tuple[int, int]]:
        """INCLUSIVE absolute ``(start, end)`` runs of embedding positions (vLLM's method)."""
        return extract_embeds_range(self.offset, self.length, self.is_embed)

    def get_embeds_indices_in_range(self, start: int, end: int) -> tuple[int, int]:
        """Encoder-output indices ``[a, b)`` of the embeddings among positions ``[start, end)``."""
        return get_embeds_indices_in_range(self.length, self.is_embed, start, end)
