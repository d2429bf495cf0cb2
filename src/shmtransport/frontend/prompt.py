"""Prompt expansion: text + multimodal items -> token ids with one placeholder span per item.

Every span carries structural tokens around (and, for video, between) its embedding positions, so
``is_embed`` is sparse as in Qwen2-VL / Qwen3-VL:

- image: ``<vision_start> <image_pad> x N <vision_end>`` (N = t*h*w / 4 for the 2x2 merge);
- video: ``<vision_start> (<frame_sep> <video_pad> x h*w/4) x t <vision_end>`` — one separator
  (timestamp) token per temporal patch group, as Qwen3-VL does;
- audio: ``<audio_start> <audio_pad> x frames/8 <audio_end>``.

The placeholder ``(offset, length)`` covers the whole span, start/end markers included.
A tiny deterministic "tokenizer" maps words to ids 3..999 (no vocabulary files, no downloads).
"""
from __future__ import annotations

import dataclasses
import hashlib
from typing import Any, Sequence

import numpy as np

from ..embedmask import EmbedMask, PlaceholderRange
from ..protocol import spec as m


def tokenize(text: str) -> list[int]:
    """Deterministic ids for the words of ``text`` (a hash per word into the text range, no vocabulary)."""
    out = []
    for word in text.split():
        h = int.from_bytes(hashlib.blake2b(word.encode(), digest_size=4).digest(), "little")
        out.append(m.TEXT_IDS.start + h % len(m.TEXT_IDS))
    return out


def _grid(kwargs: dict[str, Any], key: str) -> np.ndarray:
    g = kwargs[key]
    if hasattr(g, "shape") and not isinstance(g, np.ndarray) and hasattr(g, "numpy"):
        g = g.numpy()
    if not isinstance(g, np.ndarray):  # a committed Handle never carries a grid: grids are small arrays
        raise TypeError(f"{key} must be a numpy array")
    return g.reshape(-1, 3).astype(np.int64)


def item_span(modality: str, kwargs: dict[str, Any]) -> tuple[list[int], np.ndarray]:
    """(token ids of the span, is_embed bools) for one item."""
    if modality == "image":
        n = int(np.prod(_grid(kwargs, "image_grid_thw"), axis=1).sum()) // (m.MERGE * m.MERGE)
        tokens = [m.VISION_START] + [m.IMAGE_PAD] * n + [m.VISION_END]
    elif modality == "video":
        tokens = [m.VISION_START]
        for t, h, w in _grid(kwargs, "video_grid_thw"):
            per = int(h * w) // (m.MERGE * m.MERGE)
            for _ in range(int(t)):
                tokens += [m.FRAME_SEP] + [m.VIDEO_PAD] * per
        tokens.append(m.VISION_END)
    elif modality == "audio":
        feats = kwargs["input_features"]
        frames = int(feats.shape[-1])
        tokens = [m.AUDIO_START] + [m.AUDIO_PAD] * (frames // m.AUDIO_FRAMES_PER_TOKEN) + [m.AUDIO_END]
    else:
        raise ValueError(f"unknown modality {modality!r}")
    pads = (m.IMAGE_PAD, m.VIDEO_PAD, m.AUDIO_PAD)
    return tokens, np.isin(np.asarray(tokens), pads)


@dataclasses.dataclass
class ExpandedPrompt:
    """Token ids of the whole prompt and the placeholder span of each item, in item order."""

    token_ids: list[int]
    placeholders: list[PlaceholderRange]


def expand_prompt(text: str, items: Sequence[tuple[str, dict[str, Any]]]) -> ExpandedPrompt:
    """``BOS, <item 0 span>, <item 1 span>, ..., text tokens`` with one placeholder per item."""
    ids = [m.BOS]
    placeholders = []
    for i, (modality, kwargs) in enumerate(items):
        tokens, mask = item_span(modality, kwargs)
        placeholders.append(PlaceholderRange(len(ids), len(tokens), EmbedMask.from_bools(mask)))
        ids += tokens
        if i + 1 < len(items):
            ids += tokenize("and")
    ids += tokenize(text) or tokenize("describe")
    return ExpandedPrompt(ids, placeholders)
