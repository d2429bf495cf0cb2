"""Bridge: our ``GenerateRequest`` -> SMG / ``vllm serve --grpc`` (``smg_grpc_proto``
``vllm.grpc.engine.GenerateRequest``).

Features become SMG's per-modality batched form: ``mm_inputs`` (first batch) and
``extra_mm_inputs`` (further batches); per key, batched fields are concatenated along dim 0 across
the batch's items (``pixel_values`` -> ``pixel_values``, others -> ``model_specific_tensors`` and
``batched_keys``); a shared field is carried once (not listed in ``batched_keys``: SMG's "shared
across all images"); ``keep_on_cpu_keys`` follow the fields.

Tensors are carried inline (``TensorData.inline``, ``to_smg``) or, with ``to_smg_shm``, as
``ShmHandle``s a stock worker reads: each tensor is put in its OWN daemon-owned segment
(``Producer.put(dedicated=True)``, handle ``name`` = that segment, offset 0), because the stock
reader unlinks the segment after reading; the daemon tolerates that and reclaims the object when
the returned handles are released and ``hold_ms`` (if any) has passed.

Not representable (rejected, the message names the control): explicit ``top_k`` -1/0 and
``min_p`` 0 (SMG's plain ``uint32`` / ``float`` read 0 as unset); ``seed`` outside int32;
``lora_name``, ``cache_salt``, ``priority`` (no field); ``return_sampling_mask``; sparse
``is_embed`` masks (SMG's PlaceholderRange has no mask); flat fields (SMG's ``flat_keys`` name a
sizes tensor, not slices); per-item identities other than blake3 (SMG's ``mm_hashes`` are blake3
hex: ``blake3:<hex>`` is translated losslessly to ``<hex>``; pass ``drop_identities=True`` to send
other schemes' items without hashes, the worker then hashes itself). Defaults SMG cannot omit are
written out: ``skip_special_tokens`` and ``spaces_between_special_tokens`` default to true, n = 1.
"""
from __future__ import annotations

from ...client import Consumer
from ...errors import InvalidArgument
from ...v1 import generate_pb2 as gpb
from ..limits import DEFAULT_LIMITS, Limits
from ..sampling import project_sampling, prompt_token_ids
from .common import item_payloads, unrepresentable

TARGET = "SMG vllm_engine.GenerateRequest"
_I32 = (-(1 << 31), (1 << 31) - 1)

__all__ = ["to_smg", "to_smg_shm", "SmgRequest", "TARGET"]


class SmgRequest:
    """An SMG request whose tensors live in dedicated segments; ``release()`` once the worker has
    read them (or rely on ``hold_ms``). A context manager."""

    def __init__(self, request, producer, handles):
        self.request = request
        self._producer = producer
        self.handles = handles

    def release(self) -> None:
        if self.handles:
            handles, self.handles = self.handles, []
            self._producer.release(handles)

    def __enter__(self) -> "SmgRequest":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def to_smg_shm(req: gpb.GenerateRequest, consumer: Consumer | None, producer, *, hold_ms: int = 0,
               drop_identities: bool = False, limits: Limits = DEFAULT_LIMITS) -> SmgRequest:
    """Like ``to_smg`` but every batched tensor goes into its own dedicated segment (ShmHandle)."""
    handles: list = []

    def sink(td, tensor) -> None:
        h = producer.put(tensor, hold_ms=hold_ms, dedicated=True)
        handles.append(h)
        td.shape.extend(h.shape)
        td.dtype = h.dtype
        s = h.shm
        td.shm.name, td.shm.offset, td.shm.nbytes, td.shm.owner_id = s.name, s.offset, s.nbytes, s.owner_id

    try:
        msg = to_smg(req, consumer, drop_identities=drop_identities, limits=limits, _sink=sink)
    except BaseException:
        if handles:
            producer.release(handles)
        raise
    return SmgRequest(msg, producer, handles)


def _pb():
    from smg_grpc_proto.generated import vllm_engine_pb2

    return vllm_engine_pb2


def to_smg(req: gpb.GenerateRequest, consumer: Consumer | None = None, *, drop_identities: bool = False,
           limits: Limits = DEFAULT_LIMITS, _sink=None):
    pb = _pb()
    tokens = prompt_token_ids(req)
    sp = project_sampling(req)
    kw = sp.kwargs
    out = pb.GenerateRequest(request_id=req.request_id, tokenized=pb.TokenizedInput(input_ids=tokens))
    s = out.sampling_params
    s.n = 1
    if "temperature" in kw:
        s.temperature = kw["temperature"]
    if "top_k" in kw:
        if kw["top_k"] in (-1, 0):
            raise unrepresentable(TARGET, f"sampling.top_k={kw['top_k']}", "uint32 top_k 0 means unset")
        s.top_k = kw["top_k"]
    if "top_p" in kw:
        s.top_p = kw["top_p"]
    if "min_p" in kw:
        if kw["min_p"] == 0:
            raise unrepresentable(TARGET, "sampling.min_p=0", "float min_p 0 means unset")
        s.min_p = kw["min_p"]
    if "seed" in kw:
        if not _I32[0] <= kw["seed"] <= _I32[1]:
            raise unrepresentable(TARGET, f"sampling.seed={kw['seed']}", "seed is int32")
        s.seed = kw["seed"]
    for name in ("presence_penalty", "frequency_penalty", "repetition_penalty"):
        if name in kw:
            setattr(s, name, kw[name])
    for tok, bias in kw.get("logit_bias", {}).items():
        if tok > _I32[1]:
            raise unrepresentable(TARGET, f"sampling.logit_bias[{tok}]", "token ids are int32 keys")
        s.logit_bias[tok] = bias
    for name in ("logprobs", "prompt_logprobs", "max_tokens"):
        if name in kw:
            setattr(s, name, kw[name])
    if "min_tokens" in kw:
        s.min_tokens = kw["min_tokens"]
    s.stop.extend(kw.get("stop", []))
    s.stop_token_ids.extend(kw.get("stop_token_ids", []))
    s.include_stop_str_in_output = kw.get("include_stop_str_in_output", False)
    s.ignore_eos = kw.get("ignore_eos", False)
    s.skip_special_tokens = kw.get("skip_special_tokens", True)
    s.spaces_between_special_tokens = kw.get("spaces_between_special_tokens", True)
    if sp.return_sampling_mask:
        raise unrepresentable(TARGET, "response.return_sampling_mask", "no sampling-mask field")
    for name in ("lora_name", "cache_salt", "priority"):
        if req.HasField(name):
            raise unrepresentable(TARGET, name, "no such field on GenerateRequest")
    mm = req.multimodal
    if mm.raw_media:
        raise unrepresentable(TARGET, "multimodal.raw_media", "SMG takes media_refs with unexpanded anchors, not "
                                                             "placeholder-aligned raw media")
    if mm.batches:
        _features(pb, out, mm, consumer, drop_identities, limits, _sink or _tensor_data)
    return out


def _features(pb, out, mm, consumer, drop_identities, limits, sink) -> None:
    import torch

    from ..items import modality_to_pb

    # pre-checks on the typed request (before touching shared memory)
    for batch in mm.batches:
        for j, it in enumerate(batch.items):
            if it.placeholder.HasField("is_embed_nbits"):
                raise unrepresentable(TARGET, f"multimodal item {j} is_embed mask", "PlaceholderRange has no mask")
    payloads = item_payloads(mm, consumer, limits)
    by_modality: dict[str, list] = {}
    for p in payloads:
        by_modality.setdefault(p.modality, []).append(p)
    for b, (modality, items) in enumerate(by_modality.items()):
        msg = out.mm_inputs if b == 0 else out.extra_mm_inputs.add()
        msg.modality = modality_to_pb(modality)  # features.proto Modality uses SMG's numbers
        keys = sorted(items[0].kwargs)
        for p in items:
            if sorted(p.kwargs) != keys:
                raise InvalidArgument(f"{modality}: items have different kwargs keys; SMG batches need one set")
            msg.mm_placeholders.add(offset=p.placeholder.offset, length=p.placeholder.length)
            if p.mm_hash.startswith("blake3:"):
                msg.mm_hashes.append(p.mm_hash.split(":", 1)[1])
            elif not drop_identities:
                raise unrepresentable(TARGET, f"{modality} item identity {p.mm_hash.split(':', 1)[0]!r}",
                                      "mm_hashes are blake3 hex; use scheme blake3 or drop_identities=True")
        if len(msg.mm_hashes) not in (0, len(items)):
            raise InvalidArgument(f"{modality}: some items carry identities and others do not")
        for key in keys:
            field = items[0].fields[key]
            if any(p.fields[key] != field for p in items):
                raise InvalidArgument(f"{modality}.{key}: field layout differs across items")
            if field.kind == "flat":
                raise unrepresentable(TARGET, f"{modality}.{key} flat field", "flat_keys name a sizes tensor")
            if field.kind == "batched":
                t = torch.cat([p.kwargs[key] for p in items], dim=0) if len(items) > 1 else items[0].kwargs[key]
            else:
                t = items[0].kwargs[key]
            td = msg.pixel_values if key == "pixel_values" else msg.model_specific_tensors[key]
            sink(td, t)
            if field.kind == "batched":
                msg.batched_keys.append(key)
            if field.keep_on_cpu:
                msg.keep_on_cpu_keys.append(key)


def _tensor_data(td, tensor) -> None:
    from ...tensors import as_byte_array

    flat, dtype, shape = as_byte_array(tensor)
    td.shape.extend(shape)
    td.dtype = dtype
    td.inline = flat.tobytes()
