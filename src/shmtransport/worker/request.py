"""Worker side: typed ``MultimodalRequest`` -> engine-ready inputs, verified before execution.

``open_request`` validates the request (``validate.validate_request``), leases every shm tensor in
one Acquire, recomputes each item's identity from the leased bytes with the frontend's code
(``identity.tensor_digest`` + ``combine``; ``grpc_mm_identity`` for grpc-mm items) and rejects a
mismatch (IdentityMismatch) or a routing marker that does not match the payload, all before it
returns anything to execute. Kwargs tensors are zero-copy torch views of the leases, on private
copy-on-write pages (``Lease.tensor``): an in-place op in model code stays local to this worker.

The leases are released by ``EngineInputs.consumed()`` (or leaving its ``with`` block) once the
engine has consumed the tensors, and on every error path of ``open_request``.

``multi_modal_uuids`` are keyed by backend modality (``image`` -> ``vision_chunk`` with
``unified_vision``); modalities without any UUID are omitted. An item without an mm_hash gets a
fallback UUID ``"shmtransport-fallback:" + identity`` computed on the worker in aggregated mode
only (the prefix is not a scheme name and not hex, so it never equals a content identity); in
disaggregated mode it has no UUID.
"""
from __future__ import annotations

import dataclasses
from types import TracebackType
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from ..client import Consumer, Lease
from ..embedmask import PlaceholderRange
from ..errors import IdentityMismatch, InvalidArgument
from ..handle import Handle
from ..identity import combine, identity_scheme, item_identity, tensor_digest
from ..protocol import routing
from ..protocol.items import FieldConfig
from ..protocol.limits import DEFAULT_LIMITS, Limits
from ..protocol.msgpack_kwargs import map_tensors
from ..protocol.validate import CheckedBatch, CheckedItem, CheckedRequest, validate_request
from ..tensors import DTYPES, to_torch
from ..v1 import features_pb2 as fpb

if TYPE_CHECKING:
    import torch

FALLBACK_UUID_PREFIX = "shmtransport-fallback:"
VERIFY = ("always", "never")
MODES = ("aggregated", "disaggregated")

__all__ = ["EnginePlaceholder", "EngineInputs", "open_request", "backend_modality",
           "FALLBACK_UUID_PREFIX"]


@dataclasses.dataclass(frozen=True)
class EnginePlaceholder:
    """vLLM's PlaceholderRange as the engine takes it: ``is_embed`` a torch.bool tensor (or None =
    dense); ``range`` keeps the packed mask with vLLM's semantics (num_embeds, cumsum, windows)."""

    range: PlaceholderRange
    is_embed: torch.Tensor | None  # bool, shape (length,); None = dense

    @property
    def offset(self) -> int:
        """First prompt position of the placeholder."""
        return self.range.offset

    @property
    def length(self) -> int:
        """Number of prompt positions the placeholder covers."""
        return self.range.length

    def get_num_embeds(self) -> int:
        """Number of embedding positions (vLLM's method)."""
        return self.range.get_num_embeds()


def backend_modality(modality: str, unified_vision: bool = False) -> str:
    """The engine's name for ``modality``: ``vision_chunk`` for images on unified-vision models."""
    return "vision_chunk" if unified_vision and modality == "image" else modality


class EngineInputs:
    """Engine-ready multimodal inputs of one request, keyed by modality. Holds the leases."""

    def __init__(self, consumer: Consumer | None, leases: list[Lease]) -> None:
        self._consumer = consumer
        self._leases = leases
        self.mm_kwargs: dict[str, list[dict[str, Any]]] = {}
        self.mm_fields: dict[str, list[dict[str, FieldConfig]]] = {}
        self.mm_handles: dict[str, list[dict[str, Handle]]] = {}  # the shm tensors' handles, by key
        self.mm_hashes: dict[str, list[str]] = {}
        self.mm_identifiers: dict[str, list[str]] = {}
        self.mm_placeholders: dict[str, list[EnginePlaceholder]] = {}
        self.identities: dict[str, list[str]] = {}  # recomputed (verify="always") or as sent
        self.routing_markers: dict[str, list[str | None]] = {}
        self.multi_modal_uuids: dict[str, list[str | None]] = {}

    @property
    def leases(self) -> list[Lease]:
        """A copy of the leases the inputs hold (empty once released)."""
        return list(self._leases)

    def engine_prompt(self, prompt_token_ids: list[int]) -> dict[str, Any]:
        """The input Dynamo hands vLLM (``{"type": "multimodal", ...}``)."""
        return {"type": "multimodal", "prompt_token_ids": list(prompt_token_ids), "mm_kwargs": self.mm_kwargs,
                "mm_hashes": self.mm_hashes, "mm_placeholders": self.mm_placeholders}

    def consumed(self) -> None:
        """The engine has consumed the tensors: drop our views and release every lease."""
        self.mm_kwargs = {}
        leases, self._leases = self._leases, []
        if leases and self._consumer is not None:
            self._consumer.release(leases)

    def __enter__(self) -> "EngineInputs":
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.consumed()



def _mask_tensor(p: PlaceholderRange) -> torch.Tensor | None:
    import torch

    if p.is_embed is None:
        return None
    return torch.from_numpy(np.ascontiguousarray(p.is_embed.to_bools(), dtype=np.bool_))


def open_request(consumer: Consumer | None, request: fpb.MultimodalRequest, *, verify: str = "always",
                 mode: str = "aggregated", unified_vision: bool = False, prompt_len: int | None = None,
                 limits: Limits = DEFAULT_LIMITS, ttl_ms: int = 0, copy_on_write: bool = True) -> EngineInputs:
    """``copy_on_write=False``: shm kwargs tensors over the read-only shared mapping itself (no
    page-table setup, and a pinned arena stays pinned) — only for a caller that copies them to a
    device before any other code sees them: an in-place op on such a tensor dies of SIGSEGV."""
    if verify not in VERIFY:
        raise InvalidArgument(f"verify must be one of {VERIFY}, got {verify!r}")
    if mode not in MODES:
        raise InvalidArgument(f"mode must be one of {MODES}, got {mode!r}")
    checked = validate_request(request, limits, prompt_len)
    if checked.raw_media:
        raise InvalidArgument("raw media is not preprocessed features: it takes the worker's processing path")
    shm = [(m, it.index, key, t) for m, it in checked.items for key, t in it.tensors.items() if t.kind == "shm"]
    leases: list[Lease] = []
    if shm:
        if consumer is None:
            raise InvalidArgument("shared-memory tensors need a Consumer")
        leases = consumer.acquire_many([t.source for *_, t in shm], ttl_ms=ttl_ms)
    out = EngineInputs(consumer, leases)
    try:
        _fill(out, checked, {(m, i, k): lease for (m, i, k, _), lease in zip(shm, leases)}, verify, mode,
              unified_vision, copy_on_write)
    except BaseException:
        out.consumed()
        raise
    return out


_LeaseKey = tuple[str, int, str]  # (modality, item index, kwargs key)


def _inline_tensor(tensor: tuple[str, tuple[int, ...], Any]) -> torch.Tensor:
    """A decoded ``(dtype, shape, bytes)`` as a torch tensor over those bytes (vLLM's reader's form)."""
    dtype, shape, data = tensor
    return to_torch(np.frombuffer(data, dtype=DTYPES[dtype]).reshape(shape), dtype)


def _fill(out: EngineInputs, checked: CheckedRequest, lease_of: dict[_LeaseKey, Lease], verify: str, mode: str,
          unified_vision: bool, copy_on_write: bool) -> None:
    for batch in checked.batches:
        for it in batch.items:
            arrays: dict[str, npt.NDArray[Any]] = {}
            try:
                _fill_item(out, batch, it, lease_of, arrays, verify, mode, unified_vision, copy_on_write)
            finally:
                arrays.clear()  # a traceback must not keep lease views alive (it would defer release)
    out.multi_modal_uuids = {m: u for m, u in out.multi_modal_uuids.items() if any(x is not None for x in u)}


def _fill_item(out: EngineInputs, batch: CheckedBatch, it: CheckedItem, lease_of: dict[_LeaseKey, Lease],
               arrays: dict[str, npt.NDArray[Any]], verify: str, mode: str, unified_vision: bool,
               copy_on_write: bool) -> None:
    modality = batch.modality
    where = f"{modality}[{it.index}]"
    for key, t in it.tensors.items():
        if t.kind == "shm":
            arrays[key] = lease_of[(modality, it.index, key)].array
        else:
            arrays[key] = np.frombuffer(t.source, dtype=DTYPES[t.dtype]).reshape(t.shape)
    identity = it.mm_hash
    needs_identity = verify == "always" or (not it.mm_hash and mode == "aggregated")
    if needs_identity and (it.tensors or it.msgpack is not None):
        msgpack_identity = identity_scheme(batch.scheme).msgpack_identity
        if msgpack_identity is not None:  # the scheme is computed over the msgpack payload
            if it.msgpack is None:  # validate_request refuses such an item already
                raise InvalidArgument(f"{where}: the {batch.scheme} identity needs kwargs_msgpack (inline)")
            identity = msgpack_identity(modality, it.msgpack.raw)
        elif it.msgpack is not None:  # every value, non-tensor data included, as the frontend computes it
            identity = item_identity(modality, it.msgpack.values, batch.scheme)
        else:
            entries: list[tuple[str, str, tuple[int, ...], int, bytes]] = []
            for key, t in it.tensors.items():
                digest = tensor_digest(batch.scheme, arrays[key].reshape(-1).view(np.uint8))
                sent = t.source.digest if t.kind == "shm" else b""
                if verify == "always" and sent and sent != digest:
                    raise IdentityMismatch(f"{where}.{key}: content digest does not match shared memory")
                entries.append((key, t.dtype, t.shape, t.nbytes, digest))
            identity = combine(batch.scheme, modality, entries)
        if verify == "always" and it.mm_hash and identity != it.mm_hash:
            raise IdentityMismatch(f"{where}: payload identity {identity} != mm_hash {it.mm_hash}")
    if it.routing_marker is not None and identity:
        routing.check_marker_matches(it.routing_marker, identity, where)
    kwargs: dict[str, Any] = {
        k: lease_of[(modality, it.index, k)].tensor() if copy_on_write and it.tensors[k].kind == "shm"
        else to_torch(a, it.tensors[k].dtype) for k, a in arrays.items()}
    if it.msgpack is not None and it.msgpack.non_tensor_keys:  # vLLM's non-tensor data, in the item's key order
        kwargs = {k: kwargs[k] if k in kwargs else map_tensors(v, _inline_tensor)
                  for k, v in it.msgpack.values.items()}
    out.mm_kwargs.setdefault(modality, []).append(kwargs)
    out.mm_fields.setdefault(modality, []).append(dict(it.fields))
    out.mm_handles.setdefault(modality, []).append(
        {k: lease_of[(modality, it.index, k)].handle for k, t in it.tensors.items() if t.kind == "shm"})
    out.mm_hashes.setdefault(modality, []).append(it.mm_hash or identity)
    out.mm_identifiers.setdefault(modality, []).append(it.cache_identifier)
    out.mm_placeholders.setdefault(modality, []).append(EnginePlaceholder(it.placeholder,
                                                                          _mask_tensor(it.placeholder)))
    out.identities.setdefault(modality, []).append(identity)
    out.routing_markers.setdefault(modality, []).append(it.routing_marker)
    uuid: str | None
    if it.mm_hash:
        uuid = it.mm_hash
    elif mode == "aggregated" and identity:
        uuid = FALLBACK_UUID_PREFIX + identity
    else:
        uuid = None
    out.multi_modal_uuids.setdefault(backend_modality(modality, unified_vision), []).append(uuid)
