"""Shared pieces of the bridges: the typed item payloads (leases copied out and released)."""
from __future__ import annotations

import dataclasses
from typing import Any

from ..client import Consumer
from ..embedmask import PlaceholderRange
from ..errors import InvalidArgument
from ..protocol.items import FieldConfig
from ..protocol.limits import DEFAULT_LIMITS, Limits
from ..protocol.msgpack_kwargs import encode_kwargs_item
from ..v1 import features_pb2 as fpb


class Unrepresentable(InvalidArgument):
    """A control the bridge target has no way to express (named in the message)."""


def unrepresentable(target: str, control: str, why: str) -> Unrepresentable:
    """The error for a ``control`` that ``target`` cannot express, saying ``why``."""
    return Unrepresentable(f"{control}: cannot be represented by {target} ({why})")


@dataclasses.dataclass
class ItemPayload:
    """One feature item copied out of shared memory: its placement, identity and kwargs, with no lease held."""

    modality: str
    placeholder: PlaceholderRange
    mm_hash: str
    kwargs: dict[str, Any]  # key -> a copy, independent of any lease: a tensor or vLLM's non-tensor data
    fields: dict[str, FieldConfig]
    msgpack: bytes  # vLLM's kwargs MessagePack: the producer's exact bytes when it sent them


def item_payloads(multimodal: fpb.MultimodalRequest, consumer: Consumer | None,
                  limits: Limits = DEFAULT_LIMITS, verify: str = "always") -> list[ItemPayload]:
    """Open the features (identity verified), copy each item out of shared memory, release."""
    from ..worker.request import open_request

    raws = [it.kwargs_msgpack if it.HasField("kwargs_msgpack") else None
            for b in multimodal.batches for it in b.items]
    out: list[ItemPayload] = []
    with open_request(consumer, multimodal, verify=verify, limits=limits) as inputs:
        k = 0
        for modality, items in inputs.mm_kwargs.items():
            for j, kw in enumerate(items):
                fields = inputs.mm_fields[modality][j]
                copied = {key: _copied(v) for key, v in kw.items()}
                raw = raws[k]
                if raw is None:
                    raw = encode_kwargs_item(copied, fields)
                out.append(ItemPayload(modality, inputs.mm_placeholders[modality][j].range,
                                       inputs.mm_hashes[modality][j], copied, fields, bytes(raw)))
                k += 1
    return out


def _copied(value: Any) -> Any:
    """A tensor cloned out of its lease; vLLM's non-tensor data (numbers, lists) copied around it."""
    if isinstance(value, list):
        return [_copied(v) for v in value]
    return value.clone() if hasattr(value, "clone") else value
