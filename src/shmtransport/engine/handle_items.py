"""Multimodal items that carry our handles through vLLM's engine instead of the tensor bytes.

The API process (``vllm-worker``) puts into each item, for every shared-memory tensor the model
reads on its device, an empty tensor of the same dtype in place of the bytes (the field, with its
slices and dim, stays as vLLM built it) and one extra entry, ``MARKER_KEY``, whose bytes name each
such key's ``Handle``. Fields vLLM reads on the CPU (``keep_on_cpu``: Qwen2-VL's
``image_grid_thw``, which the scheduler and M-RoPE use) stay real. vLLM's EngineCore forwards the
item as it forwards any other (a few hundred bytes instead of megabytes through its ZMQ socket and
its broadcast ring); the process where the model runs (``model_worker``) swaps each handle for a
read-only view of the arena before the model runner sees the item.

The marker entry is a batched field that is not ``keep_on_cpu``, so vLLM's own stripping of
prefix-cache-covered items (``strip_covered_mm_data``) drops it with the bytes it stands for: an
item whose encoder never runs is never acquired.

Format of the marker bytes: a version byte, a u16 entry count, then per key ``u16 key length,
key (UTF-8), u16 handle length, handle`` (``Handle.to_bytes``), little-endian. ``parse_marker`` refuses anything
else with InvalidArgument.
"""
from __future__ import annotations

import struct
from typing import TYPE_CHECKING, Any, Mapping

from ..errors import InvalidArgument
from ..handle import Handle

if TYPE_CHECKING:
    import torch

MARKER_KEY = "shmtransport_handles"
MARKER_VERSION = 1
_U16 = struct.Struct("<H")

__all__ = ["MARKER_KEY", "encode_marker", "parse_marker", "handle_item", "is_handle_item"]


def encode_marker(handles: Mapping[str, Handle]) -> bytes:
    """The marker bytes naming ``handles`` (kwargs key -> handle)."""
    out = bytearray([MARKER_VERSION]) + _U16.pack(len(handles))
    for key, handle in handles.items():
        name, wire = key.encode(), handle.to_bytes()
        if len(name) > 0xFFFF or len(wire) > 0xFFFF:
            raise InvalidArgument(f"marker entry {key!r} too long")
        out += _U16.pack(len(name)) + name + _U16.pack(len(wire)) + wire
    return bytes(out)


def parse_marker(data: bytes) -> dict[str, Handle]:
    """kwargs key -> ``Handle`` from marker bytes; InvalidArgument for anything ``encode_marker``
    does not write (truncated, extended, another version, a repeated key, a bad handle)."""
    if len(data) < 3 or data[0] != MARKER_VERSION:
        raise InvalidArgument(f"not a version-{MARKER_VERSION} handle marker")
    (count,) = _U16.unpack_from(data, 1)
    handles: dict[str, Handle] = {}
    pos = 3

    def field() -> bytes:
        nonlocal pos
        if pos + 2 > len(data):
            raise InvalidArgument("truncated handle marker")
        (n,) = _U16.unpack_from(data, pos)
        if pos + 2 + n > len(data):
            raise InvalidArgument("truncated handle marker")
        pos += 2 + n
        return data[pos - n:pos]

    for _ in range(count):
        try:
            key = field().decode()
        except UnicodeDecodeError as exc:
            raise InvalidArgument(f"handle marker key is not UTF-8: {exc}") from exc
        wire = field()
        if not key or key in handles:
            raise InvalidArgument(f"handle marker key {key!r} is empty or repeated")
        handles[key] = Handle.from_bytes(wire)
    if not handles or pos != len(data):
        raise InvalidArgument("handle marker: no entry, or bytes past its last entry")
    return handles


def is_handle_item(item: Any) -> bool:
    """Whether a vLLM ``MultiModalKwargsItem`` (or None) carries our handles."""
    return item is not None and MARKER_KEY in item


def handle_item(kwargs: Mapping[str, Any], fields: Mapping[str, Any], handles: Mapping[str, Handle]) -> Any:
    """A vLLM ``MultiModalKwargsItem``: each key of ``handles`` whose field is not ``keep_on_cpu``
    goes by handle (an empty tensor of its dtype in its place, named in the marker); every other
    key keeps its tensor from ``kwargs`` (a copy, for a shared-memory one). ``fields``: key ->
    vLLM field object. An item with no key to carry by handle is returned as a plain item."""
    import torch
    from vllm.multimodal.inputs import MultiModalBatchedField, MultiModalFieldElem, MultiModalKwargsItem

    by_handle = {key: h for key, h in handles.items() if not fields[key].keep_on_cpu}
    elems = {}
    for key, value in kwargs.items():
        data: torch.Tensor = value
        if key in by_handle:
            data = torch.empty((0,), dtype=value.dtype)
        elif key in handles:  # small and read on the CPU: copied, so vLLM's references pin no lease
            data = value.clone()
        elems[key] = MultiModalFieldElem(data=data, field=fields[key])
    if by_handle:
        marker = torch.frombuffer(bytearray(encode_marker(by_handle)), dtype=torch.uint8)
        elems[MARKER_KEY] = MultiModalFieldElem(data=marker, field=MultiModalBatchedField(keep_on_cpu=False))
    return MultiModalKwargsItem(elems)
