"""Sample media and the real processors (optional extra ``renderer``: transformers + pillow).

- ``synthetic_image`` / ``synthetic_video`` / ``synthetic_audio``: media generated at run time
  (PIL drawing, a sine tone with harmonics and noise): no downloads.
- ``Renderer``: Qwen2-VL's image processor (the PIL variant, constructed with defaults: no hub
  access) for images; video through the same processor per frame, then paired into Qwen2-VL's
  video patches (temporal_patch_size 2: each 1176-wide row is 3 channels x 2 frames x 14 x 14) —
  the pairing writes straight into the caller's buffer, which is a shared-memory loan on the
  shm path (loan -> commit, no extra copy); ``WhisperFeatureExtractor`` (defaults: 80 mel bins,
  30 s window, 16 kHz) for audio.
- ``synthetic_features``: tensors of the same shapes and dtypes without transformers (tests of
  the worker and pipeline that must run without the extra).

Where the bytes go (shared-memory path): images are written in place — ``Renderer.image_into``
points the processor's last step (its patchify transpose, a copy it makes anyway) at a loaned
shared-memory buffer, and the frontend commits the loan with the digest computed from shared
memory (loan -> commit, no extra copy). Video patches are assembled by our pairing step straight
into a loan (same). The Whisper feature extractor's log-mel output is a fresh array with no
``out=``, so it is copied ONCE into shared memory with the digest fused into the copy
(``Producer.put_many(digest=True)``).
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Callable

import numpy as np
import numpy.typing as npt

from ..protocol.spec import MERGE, PATCH_DIM

if TYPE_CHECKING:
    from PIL import Image

    from ..client import Loan

    # where image_into writes pixel_values: a plain array or a shared-memory loan (its .array)
    PixelBuffer = npt.NDArray[np.float32] | Loan

SAMPLE_RATE = 16_000
TEMPORAL_PATCH = 2


def synthetic_image(width: int, height: int, seed: int = 0) -> Image.Image:
    """A PIL image with gradients, shapes and text-like strokes (deterministic per seed)."""
    from PIL import Image, ImageDraw

    rng = np.random.default_rng(seed)
    x = np.linspace(0, 1, width, dtype=np.float32)[None, :]
    y = np.linspace(0, 1, height, dtype=np.float32)[:, None]
    base = np.stack([x * np.ones_like(y), y * np.ones_like(x), (x + y) / 2], axis=-1)
    img = Image.fromarray((base * 255).astype(np.uint8))
    draw = ImageDraw.Draw(img)
    for _ in range(12):
        x0, y0 = int(rng.integers(0, width - 10)), int(rng.integers(0, height - 10))
        x1, y1 = x0 + int(rng.integers(5, width // 3)), y0 + int(rng.integers(5, height // 3))
        color = tuple(int(c) for c in rng.integers(0, 256, 3))
        (draw.ellipse if rng.random() < 0.5 else draw.rectangle)([x0, y0, x1, y1], fill=color)
    for i in range(6):
        draw.line([(0, i * height // 6), (width, (i + 1) * height // 7)], fill=(255, 255, 255), width=3)
    return img


def synthetic_video(frames: int, width: int, height: int, seed: int = 0) -> list[Image.Image]:
    """``frames`` PIL frames: a shape moving over a gradient."""
    from PIL import ImageDraw

    out = []
    for f in range(frames):
        img = synthetic_image(width, height, seed)
        draw = ImageDraw.Draw(img)
        cx = int((f + 1) / (frames + 1) * width)
        draw.ellipse([cx - 30, height // 2 - 30, cx + 30, height // 2 + 30], fill=(250, 20, 20))
        out.append(img)
    return out


def synthetic_audio(seconds: float, seed: int = 0) -> np.ndarray:
    """A float32 waveform at 16 kHz: a 220 Hz tone with harmonics, an amplitude envelope, noise."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * SAMPLE_RATE), dtype=np.float32) / SAMPLE_RATE
    wave = sum(np.sin(2 * math.pi * 220 * k * t) / k for k in (1, 2, 3))
    wave = wave * (0.5 + 0.5 * np.sin(2 * math.pi * 0.5 * t)) + 0.01 * rng.standard_normal(t.shape)
    return (0.3 * wave).astype(np.float32)


def synthetic_features(modality: str, *, grid: tuple[int, int, int] = (1, 32, 32), frames: int = 3000,
                       n_mels: int = 80, seed: int = 0) -> dict[str, np.ndarray]:
    """Tensors with the processors' shapes and dtypes (no transformers needed)."""
    rng = np.random.default_rng(seed)
    t, h, w = grid
    if modality in ("image", "video"):
        key, gkey = ("pixel_values", "image_grid_thw") if modality == "image" else \
            ("pixel_values_videos", "video_grid_thw")
        return {key: rng.standard_normal((t * h * w, PATCH_DIM), dtype=np.float32),
                gkey: np.array([[t, h, w]], dtype=np.int64)}
    if modality == "audio":
        return {"input_features": rng.standard_normal((n_mels, frames), dtype=np.float32)}
    raise ValueError(f"unknown modality {modality!r}")


class Renderer:
    """The real processors, constructed offline with their defaults."""

    def __init__(self) -> None:
        try:
            from transformers import Qwen2VLImageProcessorPil as ImageProcessor  # no torchvision needed
        except ImportError:
            from transformers import Qwen2VLImageProcessor as ImageProcessor
        from transformers import WhisperFeatureExtractor

        self.image_processor = ImageProcessor()
        self.audio_extractor = WhisperFeatureExtractor()

    def image(self, image: Image.Image) -> dict[str, np.ndarray]:
        """Qwen2-VL's kwargs of one image: ``pixel_values`` and ``image_grid_thw``."""
        out = self.image_processor(images=[image], return_tensors="np")
        return {"pixel_values": np.asarray(out["pixel_values"]), "image_grid_thw": np.asarray(out["image_grid_thw"])}

    def image_into(self, image: Image.Image, alloc: Callable[[tuple[int, ...]], PixelBuffer]
                   ) -> tuple[PixelBuffer, np.ndarray]:
        """Render one image with its ``pixel_values`` written straight into ``alloc(shape)`` (e.g. a
        shared-memory loan's array): the processor's own last step — the patchify transpose, the
        one copy it makes anyway — writes into that buffer instead of a fresh array. Returns
        ``(alloc's buffer, image_grid_thw)``. Needs the PIL processor's ``patchify`` (transformers
        >= 5); older processors fall back to one copy of their output into the buffer."""
        proc = self.image_processor
        captured: dict[str, PixelBuffer] = {}
        if not hasattr(type(proc), "patchify"):
            out = self.image(image)
            buf = alloc(out["pixel_values"].shape)
            np.copyto(buf if isinstance(buf, np.ndarray) else buf.array, out["pixel_values"])
            return buf, out["image_grid_thw"]

        def patchify(img: Any, patch_size: int, merge_size: int,
                     temporal_patch_size: int) -> tuple[npt.NDArray[np.float32], int, int]:
            img = np.asarray(img, dtype=np.float32)
            c, height, width = img.shape
            gh, gw = height // patch_size, width // patch_size
            buf = alloc((gh * gw, c * temporal_patch_size * patch_size * patch_size))
            captured["buf"] = buf
            dst = (buf if isinstance(buf, np.ndarray) else buf.array).reshape(
                gh // merge_size, gw // merge_size, merge_size, merge_size, c, temporal_patch_size, patch_size,
                patch_size)
            src = img.reshape(c, gh // merge_size, merge_size, patch_size, gw // merge_size, merge_size, patch_size)
            np.copyto(dst, np.transpose(src, (1, 4, 2, 5, 0, 3, 6))[:, :, :, :, :, None])  # broadcast over time
            del dst
            return np.empty((0, c * temporal_patch_size * patch_size * patch_size), np.float32), gh, gw

        proc.patchify = patchify  # this instance only, for this call
        try:
            out = proc(images=[image], return_tensors="np")
        except BaseException:
            held = captured.get("buf")
            if held is not None and hasattr(held, "release"):
                held.release()
            raise
        finally:
            del proc.patchify
        return captured["buf"], np.asarray(out["image_grid_thw"])

    def video_frames(self, frames: list[Image.Image]) -> tuple[list[np.ndarray], tuple[int, int, int]]:
        """Per-frame processor output (each row duplicates its frame over the temporal patch) and
        the video grid (t, h, w); an odd frame count repeats the last frame (as Qwen2-VL pads)."""
        if len(frames) % TEMPORAL_PATCH:
            frames = list(frames) + [frames[-1]] * (TEMPORAL_PATCH - len(frames) % TEMPORAL_PATCH)
        outs = [self.image(f) for f in frames]
        _, h, w = (int(x) for x in outs[0]["image_grid_thw"].reshape(3))
        return [o["pixel_values"] for o in outs], (len(frames) // TEMPORAL_PATCH, h, w)

    @staticmethod
    def assemble_video(frame_patches: list[np.ndarray], grid: tuple[int, int, int], out: np.ndarray) -> np.ndarray:
        """Pair frames into Qwen2-VL video patches, writing straight into ``out`` ((t*h*w, 1176) float32:
        a loaned shared-memory buffer on the shm path)."""
        t, h, w = grid
        n = h * w
        dst = out.reshape(t, n, 3, TEMPORAL_PATCH, PATCH_DIM // (3 * TEMPORAL_PATCH))
        for g in range(t):
            for k in range(TEMPORAL_PATCH):
                src = frame_patches[g * TEMPORAL_PATCH + k].reshape(n, 3, TEMPORAL_PATCH, -1)
                np.copyto(dst[g, :, :, k], src[:, :, 0])
        return out

    def audio(self, wave: np.ndarray) -> dict[str, np.ndarray]:
        """Whisper features of one wave at ``SAMPLE_RATE``, as a (mel bins, frames) view."""
        out = self.audio_extractor(wave, sampling_rate=SAMPLE_RATE, return_tensors="np")
        feats = np.asarray(out["input_features"])
        return {"input_features": feats.reshape(feats.shape[-2], feats.shape[-1])}  # a view, no copy


def video_shape(grid: tuple[int, int, int]) -> tuple[int, int]:
    """Shape of a video's flattened patches for its (t, h, w) patch grid; h and w must be multiples of the merge."""
    t, h, w = grid
    assert h % MERGE == 0 and w % MERGE == 0
    return (t * h * w, PATCH_DIM)


def as_numpy(kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` with every value as a numpy array (tensors converted, arrays as they are)."""
    return {k: np.asarray(v) for k, v in kwargs.items()}
