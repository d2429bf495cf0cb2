"""Bridge: our ``GenerateRequest`` <-> vLLM's gRPC schema (``package vllm``, ``proto/vllm/inference.proto``).

Features are re-inlined as vLLM's kwargs MessagePack (the producer's exact bytes when it sent
them, else ``msgpack_kwargs.encode_kwargs_item``) with the grpc-mm identity: ``identifier ==
mm_hash == grpc_mm_identity(modality, kwargs)``, unprefixed (vLLM #55047 prefixes the LoRA name
on the server). Limits of that schema: 64 features, 16 MiB aggregate kwargs -> ResourceExhausted
naming the limit. ``is_embed`` is sent as a plain bool list (empty = dense). Features are sent in
offset order.

proto3 "zero = unset" rules (protocol-facts 1.5): the schema cannot express an explicitly disabled
``top_k`` (-1 or 0) or ``min_p == 0`` -> rejected (as Dynamo does). Lossless translations: explicit
presence/frequency penalty 0 = "no penalty" = the wire's 0; explicit min_tokens 0 = the wire's 0;
logprobs k -> output_logprobs + CandidateTokens.top_n k, -1 -> CandidateTokens.all. Omitted
temperature stays omitted (vLLM gRPC then samples greedily: its engine default). Rejected:
spaces_between_special_tokens and return_sampling_mask (no field).
"""
from __future__ import annotations

from typing import Iterable

from ..client import Consumer
from ..embedmask import EmbedMask
from ..errors import InvalidArgument
from ..identity import SCHEMES, grpc_mm_identity
from ..protocol.items import modality_from_pb, modality_to_pb
from ..protocol.limits import DEFAULT_LIMITS, Limits
from ..protocol.sampling import project_sampling, prompt_token_ids
from ..protocol.validate import limit_exceeded
from ..v1 import features_pb2 as fpb
from ..v1 import generate_pb2 as gpb
from ..v1 import vllm_inference_pb2 as vpb
from .common import item_payloads, unrepresentable

TARGET = "vLLM gRPC (package vllm)"
MAX_FEATURES = 64
MAX_KWARGS_BYTES = 16 << 20

_MOD_TO_V = {"image": vpb.MODALITY_IMAGE, "video": vpb.MODALITY_VIDEO, "audio": vpb.MODALITY_AUDIO}
_V_TO_MOD = {v: k for k, v in _MOD_TO_V.items()}

__all__ = ["to_vllm_grpc", "from_vllm_grpc", "chunks_from_vllm", "TARGET"]


def _candidates(k: int) -> vpb.CandidateTokens:
    return vpb.CandidateTokens(all=True) if k == -1 else vpb.CandidateTokens(top_n=k)


def to_vllm_grpc(req: gpb.GenerateRequest, consumer: Consumer | None = None, *,
                 limits: Limits = DEFAULT_LIMITS) -> vpb.GenerateRequest:
    """vLLM's gRPC ``GenerateRequest`` for ``req``, features re-inlined (read through ``consumer``);
    Unrepresentable for a control the schema cannot express."""
    tokens = prompt_token_ids(req)
    sp = project_sampling(req)
    kw = sp.kwargs
    out = vpb.GenerateRequest(request_id=req.request_id, model=req.model, token_ids=vpb.TokenIds(ids=tokens))
    # -- sampling --------------------------------------------------------------------------------
    if "temperature" in kw:
        out.temperature = kw["temperature"]
    if "top_k" in kw:
        if kw["top_k"] in (-1, 0):
            raise unrepresentable(TARGET, f"sampling.top_k={kw['top_k']}",
                                  "top_k=-1 or top_k=0 (explicitly disabled): RandomSampling.top_k 0 means default")
        out.sampling.top_k = kw["top_k"]
    if "top_p" in kw:
        out.sampling.top_p = kw["top_p"]
    if "min_p" in kw:
        if kw["min_p"] == 0:
            raise unrepresentable(TARGET, "sampling.min_p=0", "min_p 0 means default on the wire")
        out.sampling.min_p = kw["min_p"]
    if "seed" in kw:
        out.sampling.seed = kw["seed"]
    for name in ("presence_penalty", "frequency_penalty", "repetition_penalty"):
        if name in kw:
            setattr(out.decoding, name, kw[name])
    for tok, bias in kw.get("logit_bias", {}).items():
        out.decoding.logit_bias[tok] = bias
    # -- stopping --------------------------------------------------------------------------------
    if "max_tokens" in kw:
        out.stopping.max_new_tokens = kw["max_tokens"]
    if "min_tokens" in kw:
        out.stopping.min_new_tokens = kw["min_tokens"]
    out.stopping.stop_strings.extend(kw.get("stop", []))
    out.stopping.stop_token_ids.extend(kw.get("stop_token_ids", []))
    out.stopping.include_stop_strings = kw.get("include_stop_str_in_output", False)
    out.stopping.ignore_eos = kw.get("ignore_eos", False)
    # -- response --------------------------------------------------------------------------------
    if "logprobs" in kw:
        out.response.output_logprobs = True
        out.response.output_candidates.CopyFrom(_candidates(kw["logprobs"]))
    if "prompt_logprobs" in kw:
        out.response.prompt_logprobs = True
        out.response.prompt_candidates.CopyFrom(_candidates(kw["prompt_logprobs"]))
    if "skip_special_tokens" in kw:
        out.response.skip_special_tokens = kw["skip_special_tokens"]
    if "spaces_between_special_tokens" in kw:
        raise unrepresentable(TARGET, "response.spaces_between_special_tokens", "no such field")
    if sp.return_sampling_mask:
        raise unrepresentable(TARGET, "response.return_sampling_mask", "no sampling-mask field")
    out.response.output_token_ids = sp.output_token_ids
    # -- identity of the request -----------------------------------------------------------------
    if req.HasField("lora_name"):
        out.lora_name = req.lora_name
    if req.HasField("cache_salt"):
        out.kv.cache_salt = req.cache_salt
    if req.HasField("priority"):
        out.priority = req.priority
    # -- media -----------------------------------------------------------------------------------
    mm = req.multimodal
    if mm.batches and mm.raw_media:
        raise InvalidArgument("raw media and preprocessed media features cannot be mixed")
    for i, media in enumerate(mm.raw_media):
        modality = modality_from_pb(media.modality)
        which = media.WhichOneof("source")
        if which is None:
            raise InvalidArgument(f"raw_media[{i}] has no source")
        item = out.media.add(modality=_MOD_TO_V[modality], mime_type=media.mime_type, uuid=media.uuid)
        setattr(item, which, getattr(media, which))
    if mm.batches:
        n = sum(len(b.items) for b in mm.batches)
        if n > MAX_FEATURES:
            raise limit_exceeded("vllm_grpc.max_features", n, MAX_FEATURES)
        total = sum(len(it.kwargs_msgpack) for b in mm.batches for it in b.items if it.HasField("kwargs_msgpack"))
        if total > MAX_KWARGS_BYTES:
            raise limit_exceeded("vllm_grpc.max_kwargs_bytes", total, MAX_KWARGS_BYTES)
        payloads = item_payloads(mm, consumer, limits)
        total = sum(len(p.msgpack) for p in payloads)
        if total > MAX_KWARGS_BYTES:
            raise limit_exceeded("vllm_grpc.max_kwargs_bytes", total, MAX_KWARGS_BYTES)
        for p in sorted(payloads, key=lambda p: p.placeholder.offset):
            ident = grpc_mm_identity(p.modality, p.msgpack)
            feats = vpb.PreprocessedMediaFeatures(kwargs=p.msgpack, identifier=ident, mm_hash=ident,
                                                  offset=p.placeholder.offset, length=p.placeholder.length)
            if p.placeholder.is_embed is not None:
                feats.is_embed.extend(bool(b) for b in p.placeholder.is_embed.to_bools())
            out.media.add(modality=_MOD_TO_V[p.modality], features=feats)
    return out


def from_vllm_grpc(vreq: vpb.GenerateRequest) -> gpb.GenerateRequest:
    """Inverse projection (wire zeros read as omitted); features become grpc-mm msgpack items."""
    if vreq.WhichOneof("prompt") != "token_ids":
        raise InvalidArgument("prompt: token_ids is required")
    out = gpb.GenerateRequest(request_id=vreq.request_id, model=vreq.model,
                              token_ids=gpb.TokenIds(ids=vreq.token_ids.ids))
    s, sm, st, rs = vreq.sampling, out.sampling, vreq.stopping, vreq.response
    if vreq.HasField("temperature"):
        sm.temperature = vreq.temperature
    if s.top_k:
        sm.top_k = s.top_k
    if s.top_p:
        sm.top_p = s.top_p
    if s.min_p:
        sm.min_p = s.min_p
    if s.HasField("seed"):
        sm.seed = s.seed
    for name in ("presence_penalty", "frequency_penalty", "repetition_penalty"):
        if getattr(vreq.decoding, name):
            setattr(sm, name, getattr(vreq.decoding, name))
    for tok, bias in vreq.decoding.logit_bias.items():
        sm.logit_bias[tok] = bias
    for flag, cand, name in ((rs.output_logprobs, rs.output_candidates, "logprobs"),
                             (rs.prompt_logprobs, rs.prompt_candidates, "prompt_logprobs")):
        if flag:
            which = cand.WhichOneof("select")
            if which == "token_ids":
                raise InvalidArgument(f"{name}: a token_ids candidate selector is not supported")
            setattr(sm, name, -1 if which == "all" else cand.top_n if which == "top_n" else 1)
    if st.max_new_tokens:
        out.stopping.max_tokens = st.max_new_tokens
    if st.min_new_tokens:
        out.stopping.min_tokens = st.min_new_tokens
    out.stopping.stop.extend(st.stop_strings)
    out.stopping.stop_token_ids.extend(st.stop_token_ids)
    if st.include_stop_strings:
        out.stopping.include_stop_str_in_output = True
    if st.ignore_eos:
        out.stopping.ignore_eos = True
    if rs.HasField("skip_special_tokens"):
        out.response.skip_special_tokens = rs.skip_special_tokens
    if not rs.output_token_ids:
        out.response.output_token_ids = False
    if vreq.lora_name:
        out.lora_name = vreq.lora_name
    if vreq.kv.cache_salt:
        out.cache_salt = vreq.kv.cache_salt
    if vreq.priority:
        out.priority = vreq.priority
    batches: dict[str, fpb.MultimodalInputs] = {}
    for i, media in enumerate(vreq.media):
        if media.modality not in _V_TO_MOD:
            raise InvalidArgument(f"media[{i}]: modality must be IMAGE, VIDEO or AUDIO")
        modality = _V_TO_MOD[media.modality]
        which = media.WhichOneof("source")
        if which != "features":
            raw = out.multimodal.raw_media.add(modality=modality_to_pb(modality), mime_type=media.mime_type,
                                               uuid=media.uuid)
            setattr(raw, which, getattr(media, which))
            continue
        f = media.features
        if not f.HasField("kwargs"):
            raise InvalidArgument(f"media[{i}]: cache-only features are unsupported")
        ident = grpc_mm_identity(modality, f.kwargs)
        if f.HasField("mm_hash") and f.mm_hash != ident:
            raise InvalidArgument(f"media[{i}]: mm_hash does not match the kwargs payload")
        batch = batches.get(modality)
        if batch is None:
            batch = batches[modality] = out.multimodal.batches.add(
                modality=modality_to_pb(modality), identity_scheme=SCHEMES["grpc-mm"].pb,
                adapter=vreq.lora_name)
        ph = fpb.PlaceholderRange(offset=f.offset, length=f.length)
        if f.is_embed:
            if len(f.is_embed) != f.length:
                raise InvalidArgument(f"media[{i}]: is_embed has {len(f.is_embed)} entries for length {f.length}")
            m = EmbedMask.from_bools(list(f.is_embed))
            ph.is_embed, ph.is_embed_nbits = m.packed, m.nbits
        batch.items.add(kwargs_msgpack=f.kwargs, placeholder=ph, mm_hash=ident,
                        cache_identifier=f"{vreq.lora_name}:{ident}" if vreq.lora_name else ident)
        batch.mm_hashes.append(ident)
        batch.mm_placeholders.append(ph)
    return out


_V_FINISH = {vpb.FinishInfo.NOT_FINISHED: gpb.FINISH_REASON_NOT_FINISHED,
             vpb.FinishInfo.LENGTH: gpb.FINISH_REASON_LENGTH,
             vpb.FinishInfo.STOP: gpb.FINISH_REASON_STOP, vpb.FinishInfo.ABORTED: gpb.FINISH_REASON_ABORTED}


def chunks_from_vllm(responses: Iterable[vpb.GenerateResponse]) -> Iterable[gpb.GenerateStreamChunk]:
    """vLLM ``GenerateResponse`` stream -> our chunks (feed to ``folding.fold``, which validates)."""
    for r in responses:
        o = r.outputs
        if len(o.ranks) not in (0, len(o.token_ids)) or len(o.candidate_tokens) not in (0, len(o.token_ids)):
            from ..protocol.folding import MalformedResponse

            raise MalformedResponse("vLLM response: ranks / candidate_tokens do not align with token_ids")
        c = gpb.GenerateStreamChunk(index=o.index, num_tokens=o.num_tokens, token_ids=o.token_ids,
                                    logprobs=o.logprobs)
        for cand in o.candidate_tokens:
            c.top_logprobs.add(token_ids=[t.id for t in cand.tokens], logprobs=[t.logprob for t in cand.tokens])
        if r.HasField("prompt_info"):
            c.num_prompt_tokens = r.prompt_info.num_prompt_tokens
        if o.HasField("finish_info"):
            fi = o.finish_info
            c.terminal = True
            c.finish_reason = _V_FINISH[fi.reason]
            c.num_output_tokens = fi.num_output_tokens
            which = fi.WhichOneof("stop_reason")
            if which:
                setattr(c.matched_stop, which, getattr(fi, which))
        yield c
