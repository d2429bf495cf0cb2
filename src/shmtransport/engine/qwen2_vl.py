"""Qwen2-VL as vLLM serves it: the real HF processors, vLLM's field layout, the real tokenizer.

``Qwen2VLRenderer`` turns images and videos into ``FeatureItem``s laid out as vLLM's own Qwen2-VL
processor lays them out, so the same items can go to vLLM's stock gRPC server (through the SMG
bridge), to our zero-copy worker, or into vLLM's offline engine:

- ``pixel_values`` / ``pixel_values_videos``: flat fields (one slice per item), one row of
  ``3 * temporal_patch * patch * patch`` values per patch;
- ``image_grid_thw`` / ``video_grid_thw``: batched fields kept on the CPU, ``(3,)`` int64 per item.

Pixels are raw 0..255 (``do_rescale=False, do_normalize=False``, uint8): vLLM 0.32 normalises
Qwen2-VL pixels itself on the device, so normalised pixels would be normalised twice. uint8 is also
a quarter of the float32 bytes and is never cast on the way in (only floating tensors are).

The prompt follows the model's chat template: ``<|vision_start|> <|image_pad|> x N <|vision_end|>``
per item, N = t*h*w / merge^2; each placeholder is that run of pad tokens (dense ``is_embed``).
"""
from __future__ import annotations

import dataclasses
import os
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

from ..embedmask import PlaceholderRange
from ..protocol.items import FeatureItem, FieldConfig
from . import tiny_model

if TYPE_CHECKING:
    from PIL import Image

KEYS = {"image": ("pixel_values", "image_grid_thw"), "video": ("pixel_values_videos", "video_grid_thw")}


@dataclasses.dataclass
class Rendered:
    """One rendered item: vLLM's per-item kwargs and field layout, and its embedding count."""

    modality: str
    kwargs: dict[str, np.ndarray]
    fields: dict[str, FieldConfig]
    num_embeds: int

    @property
    def nbytes(self) -> int:
        """Bytes of all the item's kwargs tensors."""
        return sum(int(v.nbytes) for v in self.kwargs.values())


@dataclasses.dataclass
class Prompt:
    """A rendered request: the prompt's token ids (placeholders expanded) and its feature items."""

    token_ids: list[int]
    features: list[FeatureItem]

    def variant(self, k: int) -> "Prompt":
        """The same request with different pixel content (the first two values of every item's
        pixels encode ``k``), so its identities are new: vLLM answers a repeated identity from its
        encoder cache, which would hide the transport in a measurement."""
        features = []
        for f in self.features:
            kwargs = dict(f.kwargs)
            for key, field in f.fields.items():
                if field.kind == "flat":
                    pixels = kwargs[key].copy()
                    pixels.reshape(-1)[:2] = (k % 256, k // 256 % 256)
                    kwargs[key] = pixels
            features.append(dataclasses.replace(f, kwargs=kwargs))
        return Prompt(list(self.token_ids), features)


class Qwen2VLRenderer:
    """The real Qwen2-VL image and video processors of a model directory (no hub access)."""

    def __init__(self, model_dir: str | os.PathLike[str], *, pixel_dtype: str = "uint8"):
        """``pixel_dtype``: ``uint8`` (raw bytes, the compact form) or ``float32`` (the same values
        as floats, as a renderer that resizes in floating point hands them over)."""
        from transformers import AutoTokenizer, Qwen2VLImageProcessor, Qwen2VLVideoProcessor

        model_dir = str(model_dir)
        self.image_processor = Qwen2VLImageProcessor.from_pretrained(model_dir)
        self.video_processor = Qwen2VLVideoProcessor.from_pretrained(model_dir)
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.ids = tiny_model.special_token_ids(model_dir)
        self.merge = self.image_processor.merge_size
        if pixel_dtype not in ("uint8", "float32"):
            raise ValueError(f"pixel_dtype must be uint8 or float32, got {pixel_dtype!r}")
        self.pixel_dtype = np.dtype(pixel_dtype)

    def _item(self, modality: str, pixels: Any, grid: Any) -> Rendered:
        pixel_key, grid_key = KEYS[modality]
        pixels = np.ascontiguousarray(np.asarray(pixels))
        grid = np.asarray(grid, dtype=np.int64).reshape(3)
        if pixels.dtype != np.uint8:
            raise TypeError(f"{modality} pixels must be raw uint8, got {pixels.dtype}")
        pixels = pixels.astype(self.pixel_dtype, copy=False)
        # the grid stays on the CPU (vLLM's own layout): vLLM drops the other fields of an item whose
        # encoder output it has cached, and still reads the grid for M-RoPE positions
        fields = {pixel_key: FieldConfig("flat", slices=(slice(0, pixels.shape[0]),)),
                  grid_key: FieldConfig(keep_on_cpu=True)}
        return Rendered(modality, {pixel_key: pixels, grid_key: grid}, fields, int(grid.prod()) // self.merge ** 2)

    def image(self, image: Image.Image) -> Rendered:
        """Render one image (its pixel values as given: no rescaling, no normalization)."""
        out = self.image_processor(images=[image], return_tensors="np", do_rescale=False, do_normalize=False)
        return self._item("image", out["pixel_values"], out["image_grid_thw"][0])

    def video(self, frames: Sequence[Image.Image]) -> Rendered:
        """``frames``: PIL images (an even count: frames are paired into temporal patches)."""
        video = np.stack([np.asarray(f.convert("RGB")) for f in frames])  # (T, H, W, 3)
        out = self.video_processor(videos=[video], return_tensors="np", do_rescale=False, do_normalize=False,
                                   do_sample_frames=False, cap_pixels_per_frame=False)
        return self._item("video", out["pixel_values_videos"], out["video_grid_thw"][0])

    def prompt(self, text: str, items: Sequence[Rendered]) -> Prompt:
        """Chat-templated token ids with each item's pad run, and one FeatureItem per item."""
        pads = {"image": self.ids["image_pad"], "video": self.ids["video_pad"]}
        head = self.tokenizer.encode("<|im_start|>user\n", add_special_tokens=False)
        tail = self.tokenizer.encode(text + "<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
        tokens = list(head)
        features = []
        fields = _batch_fields(items)
        for it, item_fields in zip(items, fields):
            tokens.append(self.ids["vision_start"])
            features.append(FeatureItem(it.modality, dict(it.kwargs), PlaceholderRange(len(tokens), it.num_embeds),
                                        fields=item_fields))
            tokens += [pads[it.modality]] * it.num_embeds
            tokens.append(self.ids["vision_end"])
        return Prompt(tokens + list(tail), features)


def _batch_fields(items: Sequence[Rendered]) -> list[dict[str, FieldConfig]]:
    """vLLM gives every item of a modality the same flat field, whose slices cover the whole batch
    (item i's data is slice i of the concatenation): do the same, so items match vLLM's own."""
    slices: dict[tuple[str, str], list[slice]] = {}
    for it in items:
        for key, f in it.fields.items():
            if f.kind == "flat":
                done = slices.setdefault((it.modality, key), [])
                start = done[-1].stop if done else 0
                done.append(slice(start, start + it.kwargs[key].shape[f.dim]))
    return [{key: dataclasses.replace(f, slices=tuple(slices[(it.modality, key)])) if f.kind == "flat" else f
             for key, f in it.fields.items()} for it in items]
