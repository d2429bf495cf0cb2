"""Plain data types shared by the frontend, the envelope decoder and the worker."""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from ..embedmask import PlaceholderRange
from ..errors import InvalidArgument
from ..v1 import features_pb2 as fpb

FIELD_KINDS = ("batched", "flat", "shared")

_MODALITY_TO_PB = {"image": fpb.MODALITY_IMAGE, "video": fpb.MODALITY_VIDEO, "audio": fpb.MODALITY_AUDIO}
_PB_TO_MODALITY: dict[int, str] = {v: k for k, v in _MODALITY_TO_PB.items()}
_KIND_TO_PB = {"batched": fpb.FIELD_KIND_BATCHED, "flat": fpb.FIELD_KIND_FLAT, "shared": fpb.FIELD_KIND_SHARED}
_PB_TO_KIND: dict[int, str] = {v: k for k, v in _KIND_TO_PB.items()}


def modality_to_pb(name: str) -> int:
    """The wire enum value of a modality name; InvalidArgument for an unknown one."""
    try:
        return _MODALITY_TO_PB[name]
    except KeyError:
        raise InvalidArgument(f"unknown modality {name!r}: expected one of image, video, audio") from None


def modality_from_pb(value: int) -> str:
    """The modality name of a wire enum value; InvalidArgument for UNSPECIFIED or unknown."""
    try:
        return _PB_TO_MODALITY[value]
    except KeyError:
        raise InvalidArgument(f"modality must be IMAGE, VIDEO or AUDIO, got enum value {value}") from None


@dataclasses.dataclass(frozen=True)
class FieldConfig:
    """vLLM ``MultiModalFieldConfig`` of one kwarg: ``(kind, {keep_on_cpu, slices, dim, batch_size})``."""

    kind: str = "batched"
    keep_on_cpu: bool = False
    slices: tuple[slice | tuple[slice, ...], ...] = ()  # flat: each entry a slice or a tuple of slices
    dim: int = 0  # flat
    batch_size: int = 0  # shared

    def __post_init__(self) -> None:
        if self.kind not in FIELD_KINDS:
            raise InvalidArgument(f"field kind must be one of {', '.join(FIELD_KINDS)}, got {self.kind!r}")

    # -- proto ----------------------------------------------------------------------------------
    def to_proto(self) -> fpb.FieldLayout:
        """The layout as it travels in a request (``FieldLayout``)."""
        msg = fpb.FieldLayout(kind=_KIND_TO_PB[self.kind], keep_on_cpu=self.keep_on_cpu)
        if self.kind == "flat":
            msg.dim = self.dim
            for entry in self.slices:
                spec = msg.slices.add(nested=isinstance(entry, tuple))
                for s in entry if isinstance(entry, tuple) else (entry,):
                    pb_slice = spec.slices.add()
                    for name in ("start", "stop", "step"):
                        if getattr(s, name) is not None:
                            setattr(pb_slice, name, getattr(s, name))
        elif self.kind == "shared":
            msg.batch_size = self.batch_size
        return msg

    @classmethod
    def from_proto(cls, msg: fpb.FieldLayout) -> "FieldConfig":
        """The layout a request's ``FieldLayout`` describes; an invalid one is ``InvalidArgument``."""
        if msg.kind not in _PB_TO_KIND:
            raise InvalidArgument(f"field layout kind must be BATCHED, FLAT or SHARED, got {msg.kind}")
        kind = _PB_TO_KIND[msg.kind]
        slices: list[slice | tuple[slice, ...]] = []
        for spec in msg.slices:
            items = tuple(
                slice(*(getattr(s, n) if s.HasField(n) else None for n in ("start", "stop", "step")))
                for s in spec.slices
            )
            if not spec.nested and len(items) != 1:
                raise InvalidArgument("a non-nested flat slice entry must hold exactly one slice")
            slices.append(items if spec.nested else items[0])
        return cls(kind, msg.keep_on_cpu, tuple(slices), msg.dim if kind == "flat" else 0,
                   msg.batch_size if kind == "shared" else 0)

    # -- vLLM's msgpack tuple -------------------------------------------------------------------
    def to_wire(self) -> list[Any]:
        """vLLM's MessagePack form of the field: ``[kind, {options}]``."""
        # Option order is vLLM's: its encoder writes dataclasses.fields(field), keep_on_cpu first.
        if self.kind == "batched":
            return ["batched", {"keep_on_cpu": self.keep_on_cpu}]
        if self.kind == "shared":
            return ["shared", {"keep_on_cpu": self.keep_on_cpu, "batch_size": self.batch_size}]

        def bounds(s: slice) -> list[int | None]:  # vLLM's enc_hook: (int(v) or None for start, stop, step)
            return [None if v is None else int(v) for v in (s.start, s.stop, s.step)]

        wire = [[bounds(s) for s in e] if isinstance(e, (tuple, list)) else bounds(e) for e in self.slices]
        return ["flat", {"keep_on_cpu": self.keep_on_cpu, "slices": wire, "dim": int(self.dim)}]


@dataclasses.dataclass
class FeatureItem:
    """One preprocessed item before it goes on the wire.

    ``kwargs`` maps key -> tensor (numpy array, CPU torch tensor, ``(dtype, shape, buffer)``), an
    already-committed ``Handle`` (loan -> commit with ``digest=True``) or vLLM's non-tensor data
    (int, float, a list/tuple of these and tensors; such an item travels as its kwargs MessagePack,
    ``kwargs_msgpack`` when it came as bytes). ``fields`` defaults to
    batched for every key. ``mm_hash`` is the producer's identity when it already has one (the
    envelope's); it is checked against the recomputed identity, never trusted.
    """

    modality: str
    kwargs: Mapping[str, Any]
    placeholder: PlaceholderRange
    fields: Mapping[str, FieldConfig] = dataclasses.field(default_factory=dict)
    mm_hash: str | None = None
    kwargs_msgpack: bytes | None = None  # the exact inline bytes it was decoded from, if any
    routing_marker: str | None = None  # a KV-routing marker the caller claims; checked vs the payload

    def field(self, key: str) -> FieldConfig:
        """The layout of ``kwargs[key]`` (batched when ``fields`` does not name it)."""
        return self.fields.get(key) or FieldConfig()
