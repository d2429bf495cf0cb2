"""The real renderer (optional extra ``renderer``: transformers + pillow): processor output shapes,
the video patches written in place into a shared-memory loan, prompt expansion with sparse
is_embed, and one real rendered request end to end (shm vs inline parity). Skipped without
transformers; the worker / model / pipeline tests do not need it (test_pipeline_worker.py)."""
from __future__ import annotations

import dataclasses
import os

import numpy as np
import pytest

pytest.importorskip("transformers")
pytest.importorskip("PIL")

from shmtransport import testing  # noqa: E402
from shmtransport.client import Consumer, Producer  # noqa: E402
from shmtransport.frontend import media  # noqa: E402
from shmtransport.frontend.generate import Frontend, Item  # noqa: E402
from shmtransport.frontend.prompt import expand_prompt  # noqa: E402
from shmtransport.protocol.limits import DEFAULT_LIMITS  # noqa: E402
from shmtransport.worker.process import WorkerProcess, start_daemon_process, stop_process  # noqa: E402

TIMEOUT_S = 30.0


@pytest.fixture(scope="module")
def renderer():
    return media.Renderer()


def test_image_processor_shapes_and_sparse_is_embed(renderer):
    out = renderer.image(media.synthetic_image(1344, 896, seed=1))
    assert out["pixel_values"].shape == (4988, 1176) and out["pixel_values"].dtype == np.float32
    assert out["image_grid_thw"].tolist() == [[1, 58, 86]]
    prompt = expand_prompt("what is this", [("image", out)])
    ph = prompt.placeholders[0]
    assert ph.num_embeds == 58 * 86 // 4 and ph.length == ph.num_embeds + 2
    bools = ph.is_embed.to_bools()
    assert not bools[0] and not bools[-1] and bools[1:-1].all()


def test_image_written_in_place_matches_the_processor(renderer, daemon):
    """``image_into`` points the processor's own patchify step at a loan: same bytes, no extra copy."""
    image = media.synthetic_image(448, 336, seed=9)
    ref = renderer.image(image)
    buf, grid = renderer.image_into(image, lambda shape: np.empty(shape, np.float32))
    np.testing.assert_array_equal(buf, ref["pixel_values"])
    assert grid.tolist() == ref["image_grid_thw"].tolist()
    with Producer(daemon.socket_path) as producer:
        loan, grid = renderer.image_into(image, lambda shape: producer.loan(shape=shape, dtype=np.float32))
        np.testing.assert_array_equal(loan.array, ref["pixel_values"])
        loan.release()
    assert not hasattr(renderer.image_processor, "patchify") or "patchify" not in vars(renderer.image_processor)


def test_video_patches_written_into_a_loan(renderer, daemon):
    frames, grid = renderer.video_frames(media.synthetic_video(5, 224, 224, seed=2))  # odd: last frame repeated
    assert grid == (3, 16, 16)
    with Producer(daemon.socket_path) as producer:
        loan = producer.loan(shape=media.video_shape(grid), dtype=np.float32)
        media.Renderer.assemble_video(frames, grid, loan.array)
        handle = loan.commit(digest=True)
        with Consumer(daemon.socket_path) as consumer:
            lease = consumer.acquire(handle)
            lease.verify()
            rows = lease.array.reshape(3, 256, 3, 2, 196)
            # temporal patch 2: frame 2g in slot 0, frame 2g+1 in slot 1 (per-frame output duplicates its frame)
            np.testing.assert_array_equal(rows[1, :, :, 0], frames[2].reshape(256, 3, 2, 196)[:, :, 0])
            np.testing.assert_array_equal(rows[1, :, :, 1], frames[3].reshape(256, 3, 2, 196)[:, :, 0])
            del rows
            consumer.release([lease], wait=True)
        loan.release()  # after commit: drops the producer's reference
        producer.flush()
    prompt = expand_prompt("x", [("video", {"video_grid_thw": np.array([grid])})])
    assert prompt.placeholders[0].num_embeds == 3 * 64
    assert prompt.placeholders[0].length == 3 * 64 + 3 + 2  # a separator per temporal group + start/end


def test_audio_features(renderer):
    out = renderer.audio(media.synthetic_audio(3.0))
    assert out["input_features"].shape == (80, 3000) and out["input_features"].dtype == np.float32
    assert np.isfinite(out["input_features"]).all()


def test_rendered_request_end_to_end(renderer):
    tmp = testing.short_tmpdir("shmtrend")
    prefix = testing.unique_prefix()
    daemon = start_daemon_process(os.path.join(tmp, "d.sock"), 128 << 20, prefix)
    limits = dataclasses.replace(DEFAULT_LIMITS, max_inline_bytes=64 << 20)
    try:
        with WorkerProcess(os.path.join(tmp, "w.sock"), os.path.join(tmp, "d.sock"),
                           max_inline_bytes=64 << 20) as worker, \
                Producer(os.path.join(tmp, "d.sock")) as producer, \
                Frontend(worker.address, producer, timeout_s=TIMEOUT_S, limits=limits) as fe:
            image = renderer.image(media.synthetic_image(448, 448, seed=3))
            audio = renderer.audio(media.synthetic_audio(2.0))
            outs = [fe.generate([Item("image", image), Item("audio", audio)], mode=mode,
                                sampling={"seed": 1, "temperature": 0.7}, stopping={"max_tokens": 5})
                    for mode in ("shm", "inline")]
            assert outs[0].token_ids == outs[1].token_ids and outs[0].identities == outs[1].identities
            with Consumer(os.path.join(tmp, "d.sock")) as c:
                testing.wait_until(lambda: c.stat().live_leases == 0, timeout_s=10)
    finally:
        stop_process(daemon)
        testing.remove_tree(tmp)
    assert not testing.segments_of(prefix)
