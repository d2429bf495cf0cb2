"""A small, real multimodal model with fixed weights (torch): vision + audio encoders, vLLM-style
merge of encoder outputs into the token embeddings at the ``is_embed`` positions, a 2-layer GRU
decoder and a sampler that honours the Generate sampling / stopping controls.

It is small on purpose (d = 64) — the point is a worker that really consumes the tensors on its
device, not a good model — but every stage does what a vLLM worker does with the same inputs:

- vision (Qwen2-VL grids): ``pixel_values`` / ``pixel_values_videos`` rows are 3x2x14x14 = 1176
  patches, ordered by the processor so that every 4 consecutive rows are one 2x2 merge window;
  ``Linear(1176 -> d)`` per patch, then the 2x2 spatial merge ``Linear(4d -> d)``: t*h*w / 4 embeds.
- audio (Whisper log-mel ``input_features`` (n_mels, frames)): 8 frames per token,
  ``Linear(8*n_mels -> d) -> GELU -> Linear(d -> d)``: frames / 8 embeds.
- merge: ``inputs_embeds[is_mm_embed] = cat(encoder outputs in prompt order)``.
- decoder: ``Embedding -> GRU(d, 2 layers) -> Linear(d -> vocab)``, optional LoRA-style low-rank
  delta on the head per adapter name (deterministic weights derived from the name).
"""
from __future__ import annotations

import dataclasses
import hashlib
from typing import Any, Iterator, Sequence

import torch
from torch import nn

from ..errors import InvalidArgument
from ..protocol.spec import (  # noqa: F401
    AUDIO_END,
    AUDIO_FRAMES_PER_TOKEN,
    AUDIO_PAD,
    AUDIO_START,
    BOS,
    D_MODEL,
    EOS,
    IMAGE_PAD,
    KNOWN_ADAPTERS,
    MERGE,
    N_MELS,
    PATCH_DIM,
    TEXT_IDS,
    VIDEO_PAD,
    VISION_END,
    VISION_START,
    VOCAB,
)

WEIGHT_SEED = 1234
DEFAULT_MAX_TOKENS = 16


def num_embeds(modality: str, kwargs: dict[str, Any]) -> int:
    """Embeddings one item produces (what its placeholder's is_embed must count)."""
    if modality in ("image", "video"):
        key = "image_grid_thw" if modality == "image" else "video_grid_thw"
        grid = kwargs[key]
        g = (grid.reshape(-1, 3).to(torch.int64) if isinstance(grid, torch.Tensor)
             else torch.as_tensor(grid).reshape(-1, 3))
        return int((g[:, 0] * g[:, 1] * g[:, 2]).sum()) // (MERGE * MERGE)
    if modality == "audio":
        return int(kwargs["input_features"].shape[-1]) // AUDIO_FRAMES_PER_TOKEN
    raise InvalidArgument(f"the model has no encoder for modality {modality!r}")


@dataclasses.dataclass
class MMItem:
    """One multimodal item as the model takes it: tensors (zero-copy views or device copies) and
    its placeholder (``offset``, ``length``, ``is_embed`` bool tensor or None = dense)."""

    modality: str
    kwargs: dict[str, torch.Tensor]
    offset: int
    length: int
    is_embed: torch.Tensor | None = None


@dataclasses.dataclass
class Sampling:
    """The sampling and stopping controls the model honours, named as vLLM's ``SamplingParams`` fields."""

    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = dataclasses.field(default_factory=dict)
    max_tokens: int = DEFAULT_MAX_TOKENS
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    @classmethod
    def from_engine_kwargs(cls, kw: dict[str, Any]) -> "Sampling":
        """The controls among vLLM ``SamplingParams`` kwargs ``kw``; the others are ignored."""
        names = {f.name for f in dataclasses.fields(cls)}
        args = {k: v for k, v in kw.items() if k in names}
        if "stop_token_ids" in args:
            args["stop_token_ids"] = tuple(int(t) for t in args["stop_token_ids"])
        if args.get("seed") is not None:
            args["seed"] = int(args["seed"])
        return cls(**args)


class TinyMultimodalModel(nn.Module):
    """The model of this module's docstring; weights fixed by ``WEIGHT_SEED``, in eval mode."""

    def __init__(self, d: int = D_MODEL, vocab: int = VOCAB, n_mels: int = N_MELS):
        super().__init__()
        gen = torch.Generator().manual_seed(WEIGHT_SEED)
        self.d, self.vocab, self.n_mels = d, vocab, n_mels
        self.patch_embed = nn.Linear(PATCH_DIM, d)
        self.merger = nn.Linear(MERGE * MERGE * d, d)
        self.audio_in = nn.Linear(AUDIO_FRAMES_PER_TOKEN * n_mels, d)
        self.audio_out = nn.Linear(d, d)
        self.embed = nn.Embedding(vocab, d)
        self.gru = nn.GRU(d, d, num_layers=2, batch_first=True)
        self.head = nn.Linear(d, vocab)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * (1.0 / max(1, p.shape[-1]) ** 0.5))
        self.eval()

    # -- encoders ----------------------------------------------------------------------------------
    def encode_vision(self, pixels: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """Embeddings of (N, 1176) patches in their grids: one per 2x2 merge window; InvalidArgument
        if they do not match."""
        if pixels.dim() != 2 or pixels.shape[1] != PATCH_DIM:
            raise InvalidArgument(f"vision patches must be (N, {PATCH_DIM}), got {tuple(pixels.shape)}")
        g = grid_thw.reshape(-1, 3).to(torch.int64)
        n = int((g[:, 0] * g[:, 1] * g[:, 2]).sum())
        if n != pixels.shape[0] or bool(((g[:, 1] % MERGE) != 0).any()) or bool(((g[:, 2] % MERGE) != 0).any()):
            raise InvalidArgument(f"grid {g.tolist()} does not match {pixels.shape[0]} patches (2x2 merge)")
        x: torch.Tensor = self.patch_embed(pixels.to(self.patch_embed.weight.dtype))
        merged: torch.Tensor = self.merger(x.reshape(-1, MERGE * MERGE * self.d))
        return merged

    def encode_audio(self, features: torch.Tensor) -> torch.Tensor:
        """Embeddings of (n_mels, frames) features: one per 8 frames (a partial tail is dropped)."""
        f = features.reshape(features.shape[-2], features.shape[-1]) if features.dim() == 3 else features
        if f.dim() != 2 or f.shape[0] != self.n_mels:
            raise InvalidArgument(f"audio features must be ({self.n_mels}, frames), got {tuple(features.shape)}")
        t = (f.shape[1] // AUDIO_FRAMES_PER_TOKEN) * AUDIO_FRAMES_PER_TOKEN
        x = f[:, :t].to(self.audio_in.weight.dtype).T.reshape(-1, AUDIO_FRAMES_PER_TOKEN * self.n_mels)
        out: torch.Tensor = self.audio_out(torch.nn.functional.gelu(self.audio_in(x)))
        return out

    def encode(self, item: MMItem) -> torch.Tensor:
        """Embeddings of one item by its modality; InvalidArgument for one without an encoder."""
        kw = item.kwargs
        if item.modality == "image":
            return self.encode_vision(kw["pixel_values"], kw["image_grid_thw"])
        if item.modality == "video":
            return self.encode_vision(kw["pixel_values_videos"], kw["video_grid_thw"])
        if item.modality == "audio":
            return self.encode_audio(kw["input_features"])
        raise InvalidArgument(f"the model has no encoder for modality {item.modality!r}")

    # -- merge (vLLM semantics) -------------------------------------------------------------------
    def merge(self, token_ids: torch.Tensor, items: Sequence[MMItem], encoded: Sequence[torch.Tensor]) -> torch.Tensor:
        """``inputs_embeds[is_mm_embed] = cat(encoder outputs in prompt order)``."""
        embeds: torch.Tensor = self.embed(token_ids)
        if not items:
            return embeds
        is_mm = torch.zeros(token_ids.shape[0], dtype=torch.bool, device=token_ids.device)
        order = sorted(range(len(items)), key=lambda i: items[i].offset)
        for i in order:
            it = items[i]
            span = it.is_embed.to(token_ids.device) if it.is_embed is not None else True
            if it.offset + it.length > token_ids.shape[0]:
                raise InvalidArgument(f"{it.modality} placeholder [{it.offset}, {it.offset + it.length}) beyond "
                                      f"the prompt ({token_ids.shape[0]} tokens)")
            n_mask = int(it.is_embed.sum()) if it.is_embed is not None else it.length
            if n_mask != encoded[i].shape[0]:
                raise InvalidArgument(f"{it.modality} placeholder marks {n_mask} embed positions but the encoder "
                                      f"produced {encoded[i].shape[0]} embeddings")
            is_mm[it.offset:it.offset + it.length] |= span
        out = torch.cat([encoded[i].to(embeds.dtype) for i in order])
        if int(is_mm.sum()) != out.shape[0]:
            raise InvalidArgument("placeholders overlap")
        embeds = embeds.clone()
        embeds[is_mm] = out
        return embeds

    # -- decoder ------------------------------------------------------------------------------------
    def adapter_delta(self, name: str, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
        """The low-rank (A, B) logit delta of the adapter ``name``: deterministic in the name, on ``device``."""
        seed = int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "little") & ((1 << 63) - 1)
        gen = torch.Generator().manual_seed(seed)
        a = torch.randn(self.d, 4, generator=gen) * 0.5
        b = torch.randn(4, self.vocab, generator=gen) * 0.5
        return a.to(device), b.to(device)

    @torch.no_grad()
    def generate(self, inputs_embeds: torch.Tensor, prompt_ids: Sequence[int], sampling: Sampling,
                 adapter: str | None = None) -> Iterator[tuple[int, str | None]]:
        """Yield ``(token, finish)`` per generated token; finish is None, "length" or "stop"."""
        device = inputs_embeds.device
        lora = self.adapter_delta(adapter, device) if adapter else None
        out, h = self.gru(inputs_embeds.unsqueeze(0))
        last = out[0, -1]
        gen = torch.Generator(device="cpu")
        if sampling.seed is not None:
            gen.manual_seed(sampling.seed)
        else:
            gen.seed()
        counts = torch.zeros(self.vocab, dtype=torch.float32)
        prompt_seen = torch.zeros(self.vocab, dtype=torch.bool)
        prompt_seen[torch.as_tensor([t for t in prompt_ids if 0 <= t < self.vocab], dtype=torch.int64)] = True
        bias = torch.zeros(self.vocab)
        for tok, v in sampling.logit_bias.items():
            if 0 <= tok < self.vocab:
                bias[tok] = v
        stops = set(sampling.stop_token_ids)
        for step in range(sampling.max_tokens):
            logits = self.head(last)
            if lora is not None:
                logits = logits + (last @ lora[0]) @ lora[1]
            tok = _sample(logits.float().cpu() + bias, sampling, counts, prompt_seen, step, gen)
            counts[tok] += 1
            finish = None
            if step + 1 >= sampling.min_tokens and (tok in stops or (tok == EOS and not sampling.ignore_eos)):
                finish = "stop"
            elif step + 1 >= sampling.max_tokens:
                finish = "length"
            yield tok, finish
            if finish:
                return
            out, h = self.gru(self.embed(torch.tensor([[tok]], device=device)), h)
            last = out[0, -1]


def _sample(logits: torch.Tensor, s: Sampling, counts: torch.Tensor, prompt_seen: torch.Tensor, step: int,
            gen: torch.Generator) -> int:
    """vLLM's order: penalties, (min_tokens: no EOS/stop), temperature, min_p, top_k, top_p."""
    if s.repetition_penalty != 1.0:
        seen = prompt_seen | (counts > 0)
        logits = torch.where(seen, torch.where(logits > 0, logits / s.repetition_penalty,
                                                logits * s.repetition_penalty), logits)
    if s.frequency_penalty:
        logits = logits - s.frequency_penalty * counts
    if s.presence_penalty:
        logits = logits - s.presence_penalty * (counts > 0).float()
    if step < s.min_tokens:
        banned = list(s.stop_token_ids) + ([] if s.ignore_eos else [EOS])
        if banned:
            logits[torch.as_tensor(banned, dtype=torch.int64).clamp(0, logits.shape[0] - 1)] = -float("inf")
    if s.temperature == 0.0:
        return int(torch.argmax(logits))
    logits = logits / s.temperature
    probs = torch.softmax(logits, dim=-1)
    if s.min_p > 0.0:
        probs = torch.where(probs < s.min_p * probs.max(), torch.zeros_like(probs), probs)
    if s.top_k > 0:
        kth = torch.topk(probs, min(s.top_k, probs.shape[0])).values[-1]
        probs = torch.where(probs < kth, torch.zeros_like(probs), probs)
    if s.top_p < 1.0:
        sorted_p, idx = torch.sort(probs, descending=True)
        cum = torch.cumsum(sorted_p, 0) / sorted_p.sum()
        drop = cum - sorted_p / sorted_p.sum() >= s.top_p  # keep the smallest prefix reaching top_p
        sorted_p[drop] = 0.0
        probs = torch.zeros_like(probs).scatter_(0, idx, sorted_p)
    return int(torch.multinomial(probs / probs.sum(), 1, generator=gen))
