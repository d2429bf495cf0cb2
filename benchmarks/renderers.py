"""Rendering cost in the frontend: vLLM's own processor (``VllmRenderer``) against the hand-written
Qwen2-VL renderer (``engine.qwen2_vl.Qwen2VLRenderer``), which is kept only while it is faster.

    .venv/bin/python benchmarks/renderers.py [--reps 15] [--json benchmarks/results/renderers.json]

Both render the same source media for the tiny Qwen2-VL (``engine.tiny_model``) into the items and
prompt a ``GeneratorClient`` sends (token ids, tensors, placeholders); tests/test_vllm_renderer.py
checks that their outputs are equal. Reported per request kind: the median wall time of each, and
vLLM's over the hand-written one.
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from typing import Callable

import numpy as np

KINDS = {"image_224": [(224, 224)], "image_448": [(448, 448)], "image_1344x896": [(1344, 896)],
         "4_images_448": [(448, 448)] * 4, "video_4f_448": "video"}


def _median_ms(render: Callable[[], object], reps: int) -> float:
    render()  # warm: first-call imports and caches
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        render()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def _renders(sizes, theirs, ours, ids) -> tuple[Callable[[], object], Callable[[], object]]:
    """The request kind rendered by vLLM's processor, and by the hand-written renderer."""
    from shmtransport.frontend.media import synthetic_image, synthetic_video

    if sizes == "video":
        frames = synthetic_video(4, 448, 448, 7)
        video = np.stack([np.asarray(f.convert("RGB")) for f in frames])
        tokens = [1, ids["vision_start"], ids["video_pad"], ids["vision_end"], 7]
        return (lambda: theirs.render(tokens, {"video": [video]}),
                lambda: ours.prompt("x", [ours.video(frames)]))
    images = [synthetic_image(w, h, i) for i, (w, h) in enumerate(sizes)]
    arrays = [np.asarray(img.convert("RGB")) for img in images]
    tokens = [1, *[t for _ in images for t in (ids["vision_start"], ids["image_pad"], ids["vision_end"])], 7]
    return (lambda: theirs.render(tokens, {"image": arrays}),
            lambda: ours.prompt("x", [ours.image(img) for img in images]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()

    from shmtransport.engine import environment
    environment.apply_defaults(environment.isolated_environment())
    from shmtransport.engine import tiny_model
    from shmtransport.engine.qwen2_vl import Qwen2VLRenderer
    from shmtransport.frontend.vllm_renderer import VllmRenderer

    model = str(tiny_model.build(tempfile.mkdtemp(prefix="shmt-renderers-")))
    ids = tiny_model.special_token_ids(model)
    theirs = VllmRenderer(model, limit_mm_per_prompt={"image": 4, "video": 1})
    ours = Qwen2VLRenderer(model)
    rows = {}
    for kind, sizes in KINDS.items():
        vllm_render, hand_render = _renders(sizes, theirs, ours, ids)
        vllm_ms, hand_ms = _median_ms(vllm_render, args.reps), _median_ms(hand_render, args.reps)
        rows[kind] = {"vllm_ms": round(vllm_ms, 2), "hand_written_ms": round(hand_ms, 2),
                      "vllm_over_hand_written": round(vllm_ms / hand_ms, 2)}
        print(f"{kind:16s} vLLM {vllm_ms:7.2f} ms   hand-written {hand_ms:7.2f} ms   "
              f"ratio {vllm_ms / hand_ms:5.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"reps": args.reps, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
