"""Bridge: our ``GenerateRequest`` -> SMG / ``vllm serve --grpc`` (``smg_grpc_proto``
``vllm.grpc.engine.GenerateRequest``).

Features become one ``MultimodalInputs`` per modality (``mm_inputs``, then ``extra_mm_inputs``),
laid out so that SMG's reader (``VllmEngineServicer._build_preprocessed_mm_inputs``:
``MultiModalKwargsItems.from_hf_inputs`` over one tensor per key) rebuilds exactly our items:

- batched: the items' tensors stacked (``torch.stack``), key in ``batched_keys``; SMG hands item i
  ``batch[i]``. Items must share one shape (ragged batched items are refused: declare them flat).
- flat (along dim 0): the items' tensors concatenated, key in ``flat_keys`` naming an int64 sizes
  tensor of the item lengths (``patches_per_image`` / ``patches_per_video``, one per distinct set
  of lengths; in ``batched_keys`` and ``keep_on_cpu_keys``). SMG slices consecutive runs
  (``flat_from_sizes``), so items of different lengths come back intact; our slice bookkeeping is
  re-derived as those runs (the items' tensors are what vLLM feeds the model). SMG's items then
  also carry the sizes key (the item's own length, 0-d); models ignore it.
- shared: sent once, listed nowhere (SMG gives every item the whole tensor); refused when the
  items' tensors differ or the field is ``keep_on_cpu`` (SMG drops that flag for shared fields).
- ``keep_on_cpu`` -> ``keep_on_cpu_keys``. Float tensors are cast by SMG to the model dtype (as
  vLLM's own processor output is).

The primary tensor travels in ``MultimodalInputs.pixel_values`` (SMG's Generate refuses a batch
without it): ``pixel_values`` for images, ``pixel_values_videos`` for videos (SMG renames a video
batch's ``pixel_values`` back to it; a video kwarg literally named ``pixel_values`` is refused);
a batch without either sends its first key there, named by ``encoder_input_key``.

Dtypes: SMG's ``tensor_from_proto`` takes float32, bfloat16, float16, uint8, int64, uint32; any
other dtype (bool, int8, uint16, int16, int32, float64, uint64) is refused, not converted: a
converted kwarg would reach the model with a dtype the producer did not choose.

Tensors are carried inline (``TensorData.inline``, ``to_smg``) or, with ``to_smg_shm``, as
``ShmHandle``s a stock worker reads: each tensor is put in its OWN daemon-owned segment
(``Producer.put(dedicated=True)``, handle ``name`` = that segment, offset 0), because the stock
reader unlinks the segment after reading; the daemon tolerates that and reclaims the object when
the returned handles are released and ``hold_ms`` (if any) has passed.

Not representable (``Unrepresentable``, naming the control; always before any tensor is emitted):
explicit ``top_k`` -1/0 and ``min_p`` 0 (SMG's plain ``uint32`` / ``float`` read 0 as unset);
``seed`` outside int32; ``lora_name``, ``cache_salt``, ``priority`` (no field);
``return_sampling_mask``; sparse ``is_embed`` masks (SMG's PlaceholderRange has no mask); audio
(SMG's ``modality_name`` reads every non-video batch as image); the dtypes above; ragged batched
items; flat fields along another dim or differing beyond dim 0; shared fields that differ across
items or are kept on CPU; 0-d or empty tensors as sent (SMG's reader cannot rebuild them); items
of one modality with different keys or dtypes; a kwarg name used by two modalities (SMG merges all
batches into one dict); per-item identities other than blake3 (SMG's ``mm_hashes`` are blake3 hex: ``blake3:<hex>``
is translated losslessly to ``<hex>``; pass ``drop_identities=True`` to send other schemes' items
without hashes, the worker then hashes itself). Defaults SMG cannot omit are written out:
``skip_special_tokens`` and ``spaces_between_special_tokens`` default to true, n = 1.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

from ..client import Consumer, Handle, Producer
from ..errors import InvalidArgument
from ..protocol.limits import DEFAULT_LIMITS, Limits
from ..protocol.sampling import project_sampling, prompt_token_ids
from ..v1 import features_pb2 as fpb
from ..v1 import generate_pb2 as gpb
from .common import ItemPayload, item_payloads, unrepresentable

if TYPE_CHECKING:
    import torch

    # writes one tensor into an SMG TensorData message (inline bytes, or a ShmHandle)
    _Sink = Callable[[Any, torch.Tensor], None]

TARGET = "SMG vllm_engine.GenerateRequest"
_I32 = (-(1 << 31), (1 << 31) - 1)

__all__ = ["to_smg", "to_smg_shm", "SmgRequest", "TARGET"]


class SmgRequest:
    """An SMG request whose tensors live in dedicated segments; ``release()`` once the worker has
    read them (or rely on ``hold_ms``). A context manager."""

    def __init__(self, request: Any, producer: Producer, handles: list[Handle]) -> None:
        """``request``: SMG's ``vllm_engine_pb2.GenerateRequest``."""
        self.request = request
        self._producer = producer
        self.handles = handles

    def release(self) -> None:
        """Release the dedicated segments of the request's tensors; idempotent."""
        if self.handles:
            handles, self.handles = self.handles, []
            self._producer.release(handles)

    def __enter__(self) -> "SmgRequest":
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def to_smg_shm(req: gpb.GenerateRequest, consumer: Consumer | None, producer: Producer, *, hold_ms: int = 0,
               drop_identities: bool = False, limits: Limits = DEFAULT_LIMITS) -> SmgRequest:
    """Like ``to_smg`` but every batched tensor goes into its own dedicated segment (ShmHandle)."""
    handles: list[Handle] = []

    def sink(td: Any, tensor: torch.Tensor) -> None:
        h = producer.put(tensor, hold_ms=hold_ms, dedicated=True)
        handles.append(h)
        if not _shm_name_ok(h.shm.name):
            raise InvalidArgument(f"segment name {h.shm.name!r} is not one SMG's shm reader opens")
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


def _shm_name_ok(name: str) -> bool:
    """SMG opens ``/dev/shm/<name>`` (leading ``/`` stripped) and refuses a path-like name."""
    name = name.lstrip("/")
    return bool(name) and "/" not in name and "\x00" not in name and name not in (".", "..")


def _pb() -> Any:
    from smg_grpc_proto.generated import vllm_engine_pb2

    return vllm_engine_pb2


def to_smg(req: gpb.GenerateRequest, consumer: Consumer | None = None, *, drop_identities: bool = False,
           limits: Limits = DEFAULT_LIMITS, _sink: _Sink | None = None) -> Any:
    """SMG's ``vllm_engine_pb2.GenerateRequest`` for ``req`` (features inline unless ``_sink``)."""
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


# SMG's TensorData dtypes (``smg_grpc_servicer.tensor_wire.PROTO_DTYPE_MAP``); it refuses others.
SMG_DTYPES = ("float32", "bfloat16", "float16", "uint8", "int64", "uint32")
_SMG_MODALITIES = ("image", "video")  # SMG's modality_name reads anything else (AUDIO) as image
_PRIMARY = "pixel_values"  # the wire name of the tensor in MultimodalInputs.pixel_values


def _wire_key(modality: str, key: str) -> str:
    """The name SMG's reader maps back to ``key``: it renames a video batch's ``pixel_values`` to
    ``pixel_values_videos`` (mm_keys.modality_key)."""
    return _PRIMARY if modality == "video" and key == "pixel_values_videos" else key


class _Batch:
    """One SMG MultimodalInputs, planned before any tensor is emitted."""

    def __init__(self, modality: str, items: list[ItemPayload]) -> None:
        self.modality, self.items = modality, items
        self.tensors: dict[str, torch.Tensor] = {}  # wire key -> the one tensor SMG reads
        self.batched: list[str] = []
        self.flat: dict[str, tuple[int, ...]] = {}  # wire key -> item lengths along dim 0
        self.cpu: list[str] = []
        self.primary = ""
        self.hashes: list[str] = []  # blake3 hex, one per item or none


def _plan(modality: str, items: list[ItemPayload], drop_identities: bool) -> _Batch:
    import torch

    from ..tensors import dtype_name

    if modality not in _SMG_MODALITIES:
        raise unrepresentable(TARGET, f"{modality} items", "SMG's modality_name reads every batch that is not "
                                                           "VIDEO as image")
    keys = sorted(items[0].kwargs)
    numbers = [k for p in items for k, v in p.kwargs.items() if not isinstance(v, torch.Tensor)]
    if numbers:
        raise unrepresentable(TARGET, f"{modality}.{numbers[0]} (int, float or list data)",
                              "SMG's TensorData carries one tensor per key")
    if not keys:
        raise unrepresentable(TARGET, f"{modality} items without tensors", "SMG skips a batch with no tensor")
    if any(sorted(p.kwargs) != keys for p in items):
        raise unrepresentable(TARGET, f"{modality} items with different kwargs keys",
                              "SMG builds every item from the same per-key tensors")
    plan = _Batch(modality, items)
    for p in items:
        if p.mm_hash.startswith("blake3:"):
            plan.hashes.append(p.mm_hash.split(":", 1)[1])
        elif not drop_identities:
            raise unrepresentable(TARGET, f"{modality} item identity {p.mm_hash.split(':', 1)[0]!r}",
                                  "mm_hashes are blake3 hex; use scheme blake3 or drop_identities=True")
    if len(plan.hashes) not in (0, len(items)):
        raise unrepresentable(TARGET, f"{modality} items of which some lack an identity", "mm_hashes are all or none")
    for key in keys:
        where = f"{modality}.{key}"
        if modality == "video" and key == _PRIMARY:
            raise unrepresentable(TARGET, f"{where} (video)", "SMG renames a video pixel_values to "
                                                              "pixel_values_videos")
        field = items[0].fields[key]
        if any(p.fields[key] != field for p in items):
            raise InvalidArgument(f"{where}: field layout differs across items")
        ts = [p.kwargs[key] for p in items]
        dtype = dtype_name(ts[0].dtype)
        if dtype not in SMG_DTYPES:
            raise unrepresentable(TARGET, f"{where} dtype {dtype}", f"SMG's TensorData takes {', '.join(SMG_DTYPES)}")
        if any(t.dtype != ts[0].dtype for t in ts):
            raise unrepresentable(TARGET, f"{where} items of different dtypes", "SMG carries one tensor per key")
        wire = _wire_key(modality, key)
        if field.kind == "batched":
            # SMG hands item i batch[i]: stack, so each item keeps its own shape (leading 1s too)
            if any(t.shape != ts[0].shape for t in ts):
                raise unrepresentable(TARGET, f"{where} batched items of different shapes",
                                      "SMG rebuilds item i as batch[i] of one stacked tensor")
            t = ts[0].unsqueeze(0) if len(ts) == 1 else torch.stack(ts)
            plan.batched.append(wire)
        elif field.kind == "flat":
            # SMG's flat_keys slice consecutive runs of dim 0 (flat_from_sizes); item lengths may differ
            if ts[0].dim() == 0 or field.dim % ts[0].dim() != 0:
                raise unrepresentable(TARGET, f"{where} flat along dim {field.dim}",
                                      "SMG's flat_keys slice dim 0 only")
            if any(t.shape[1:] != ts[0].shape[1:] for t in ts):
                raise unrepresentable(TARGET, f"{where} flat items differing beyond dim 0",
                                      "SMG carries one dense tensor per key")
            t = ts[0] if len(ts) == 1 else torch.cat(ts)
            plan.flat[wire] = tuple(x.shape[0] for x in ts)
        else:
            # not in batched_keys / flat_keys: SMG gives every item the whole tensor
            if field.keep_on_cpu:
                raise unrepresentable(TARGET, f"{where} shared field kept on CPU",
                                      "SMG builds shared fields without keep_on_cpu")
            if any(x.shape != ts[0].shape or not torch.equal(x, ts[0]) for x in ts[1:]):
                raise unrepresentable(TARGET, f"{where} shared field that differs across items",
                                      "SMG carries a shared tensor once")
            t = ts[0]
        if t.dim() == 0 or t.numel() == 0:
            raise unrepresentable(TARGET, f"{where} tensor of shape {list(t.shape)}",
                                  "SMG's reader cannot rebuild a 0-d or empty tensor")
        plan.tensors[wire] = t
        if field.keep_on_cpu:
            plan.cpu.append(wire)
    # SMG's Generate refuses a batch without MultimodalInputs.pixel_values (unless remote KV);
    # a batch without pixels names its first tensor as the encoder input instead
    plan.primary = _PRIMARY if _PRIMARY in plan.tensors else keys[0]
    return plan


def _sizes_keys(plan: _Batch, taken: set[str]) -> dict[str, str]:
    """flat key -> the name of its int64 sizes tensor: one per distinct set of item lengths, the
    primary's named ``patches_per_<modality>`` (per modality: SMG merges all batches into one dict
    and refuses repeated keys), none clashing with a real kwarg."""
    order = sorted(plan.flat, key=lambda k: (k != plan.primary, k))
    names: dict[tuple[int, ...], str] = {}
    out: dict[str, str] = {}
    for key in order:
        sizes = plan.flat[key]
        if sizes not in names:
            name = f"patches_per_{plan.modality}" + (f"_{len(names)}" if names else "")
            while name in taken:
                name += "_"
            taken.add(name)
            names[sizes] = name
        out[key] = names[sizes]
    return out


def _features(pb: Any, out: Any, mm: fpb.MultimodalRequest, consumer: Consumer | None, drop_identities: bool,
              limits: Limits, sink: _Sink) -> None:
    """``pb``: SMG's ``vllm_engine_pb2``; ``out``: its ``GenerateRequest``, given ``mm_inputs``."""
    import torch

    from ..protocol.items import modality_to_pb

    # pre-checks on the typed request (before touching shared memory)
    for batch in mm.batches:
        for j, it in enumerate(batch.items):
            if it.placeholder.HasField("is_embed_nbits"):
                raise unrepresentable(TARGET, f"multimodal item {j} is_embed mask", "PlaceholderRange has no mask")
    payloads = item_payloads(mm, consumer, limits)
    by_modality: dict[str, list[ItemPayload]] = {}
    for p in payloads:
        by_modality.setdefault(p.modality, []).append(p)
    # plan every batch first: anything SMG cannot read is refused before a tensor is emitted
    plans = [_plan(modality, items, drop_identities) for modality, items in by_modality.items()]
    taken: set[str] = set()
    for plan in plans:
        real = {key for p in plan.items for key in p.kwargs}
        if real & taken:
            raise unrepresentable(TARGET, f"kwargs {sorted(real & taken)} in several modalities",
                                  "SMG merges all batches into one dict")
        taken |= real
    for b, plan in enumerate(plans):
        msg = out.mm_inputs if b == 0 else out.extra_mm_inputs.add()
        msg.modality = modality_to_pb(plan.modality)  # features.proto Modality uses SMG's numbers
        for p in plan.items:
            msg.mm_placeholders.add(offset=p.placeholder.offset, length=p.placeholder.length)
        msg.mm_hashes.extend(plan.hashes)
        sizes_keys = _sizes_keys(plan, taken)
        if plan.primary != _PRIMARY:
            msg.encoder_input_key = plan.primary
        for key, t in plan.tensors.items():
            sink(msg.pixel_values if key == plan.primary else msg.model_specific_tensors[key], t)
        for key, name in sizes_keys.items():
            msg.flat_keys[key] = name
            if name not in msg.model_specific_tensors:
                # batched: item i gets its own length, and batching items anywhere stays correct
                sink(msg.model_specific_tensors[name], torch.tensor(plan.flat[key], dtype=torch.int64))
                msg.batched_keys.append(name)
                msg.keep_on_cpu_keys.append(name)
        msg.batched_keys.extend(plan.batched)
        msg.keep_on_cpu_keys.extend(plan.cpu)


def _tensor_data(td: Any, tensor: torch.Tensor) -> None:
    from ..tensors import as_byte_array

    flat, dtype, shape = as_byte_array(tensor)
    td.shape.extend(shape)
    td.dtype = dtype
    td.inline = flat.tobytes()
