"""Multimodal families other than Qwen2-VL, end to end on vLLM's real engine, each a tiny
random-weight model built here (``engine.tiny_families``): Qwen2.5-VL (images and video as flat
patch rows; grids and video timing kept on the CPU), LLaVA-1.5 (a CLIP tower; one batched
``pixel_values`` per image), Gemma 3 (a SigLIP tower; placeholders holding tokens that are not
embedded) and Qwen2-Audio (a Whisper-style audio tower; log-mel features and their mask).

For each family, source media are rendered by vLLM's own processor in the frontend
(``VllmRenderer``), and every path must answer exactly what vLLM's offline engine answers for the
same media, which it processes itself: ours (``GeneratorClient`` to ``shmtransport vllm-worker``,
every tensor through shared memory, handles to the model), and vLLM's stock gRPC server fed by the
SMG bridge (tensors in SMG's shared-memory segments, and inline) where SMG's request can carry the
items, elsewhere the bridge's typed refusal.

One family's engines run at a time (a module-scoped fixture): our worker and the stock server side
by side (no stock server where the bridge refuses the family), and the offline engine in a child
process.
"""
from __future__ import annotations

import functools
import json
import os

import numpy as np
import pytest
from vllm_engine import MAX_TOKENS, raw_offline_arrays, start_offline, stop_offline

from shmtransport import NO_INLINE, GeneratorClient, testing
from shmtransport.bridges.common import Unrepresentable
from shmtransport.engine import paths, process
from shmtransport.engine.tiny_families import FAMILIES
from shmtransport.frontend.media import synthetic_image, synthetic_video

pytestmark = pytest.mark.timeout(900)

VIDEO_FPS = 2.0
AUDIO_RATE = 16_000  # the rate the family's feature extractor takes (vLLM would resample others)
# name -> items in prompt order: (modality, synthetic_image / synthetic_video / _waveform arguments)
SCENARIOS = {
    "images": [("image", (112, 84, 41)), ("image", (200, 150, 42))],
    "video": [("video", (4, 84, 84, 43))],
    "image-and-video": [("image", (140, 98, 44)), ("video", (2, 112, 84, 45))],
    "audio": [("audio", (1.5, 46))],
}
CASES = [(family, scenario) for family, f in FAMILIES.items() for scenario, items in SCENARIOS.items()
         if all(m in f.modalities for m, _ in items)]
# What SMG's GenerateRequest cannot carry, so the bridge refuses it typed before any tensor moves.
STOCK_REFUSES = {
    "gemma3": "is_embed mask",  # Gemma 3's placeholders hold tokens that are not embedded
    "qwen2_audio": "audio",  # SMG's servicer takes every batch that is not video for images
}
LIMITS = json.loads(dict(zip(process.ENGINE_FLAGS[::2], process.ENGINE_FLAGS[1::2]))["--limit-mm-per-prompt"])


def _waveform(seconds: float, seed: int) -> np.ndarray:
    """A chirp with noise, float32 in [-1, 1]."""
    t = np.arange(int(seconds * AUDIO_RATE)) / AUDIO_RATE
    noise = np.random.default_rng(seed).standard_normal(t.size) * 0.05
    return (0.5 * np.sin(2 * np.pi * (200 + 400 * t) * t) + noise).astype(np.float32)


def _source(modality: str, args: tuple):
    """An item as vLLM takes it: an HxWx3 image, (TxHxWx3 frames, metadata), (waveform, rate)."""
    if modality == "image":
        return np.asarray(synthetic_image(*args).convert("RGB"))
    if modality == "audio":
        return _waveform(*args), AUDIO_RATE
    frames = np.stack([np.asarray(f.convert("RGB")) for f in synthetic_video(*args)])
    n = len(frames)
    return frames, {"fps": VIDEO_FPS, "duration": n / VIDEO_FPS, "total_num_frames": n,
                    "frames_indices": list(range(n)), "video_backend": "opencv"}


def _media(items) -> dict[str, list]:
    media: dict[str, list] = {}
    for modality, source in items:
        media.setdefault(modality, []).append(source)
    return media


@pytest.fixture(scope="module")
def family(request, tmp_path_factory):
    for module in ("torch", "vllm", "transformers", "smg_grpc_proto"):  # conftest: REQUIRE_EXTRAS fails instead
        pytest.importorskip(module)
    import grpc

    from shmtransport.client import Consumer, Producer
    from shmtransport.frontend.vllm_renderer import VllmRenderer

    fam = FAMILIES[request.param]
    root = tmp_path_factory.mktemp(fam.name)
    model = str(fam.build(root / "model"))
    requests = {}
    for name in (scenario for f, scenario in CASES if f == fam.name):
        items = [(m, _source(m, args)) for m, args in SCENARIOS[name]]
        requests[name] = (fam.prompt_ids(model, [m for m, _ in items]), items)
    np.savez(root / "offline.npz", **raw_offline_arrays(requests))
    daemon = testing.start_daemon(arena_nbytes=64 << 20)
    before = set(os.listdir("/dev/shm"))
    offline = None
    servers: dict = {}
    try:
        offline = start_offline(model, str(root / "offline.npz"), str(root / "offline.json"), root)
        # where the bridge refuses the family's items, no stock server: nothing would reach it
        refused = fam.name in STOCK_REFUSES
        servers = process.start_stock_and_ours(model, daemon.config.socket_path, runtime_dir=root / "runtime",
                                               log_dir=root, stock=not refused)
        assert offline.wait(600) == 0, (root / "offline.log").read_text()[-4000:]
        producer, consumer = Producer(daemon.config.socket_path), Consumer(daemon.config.socket_path)
        # connected here: a channel's sockets outlive the test that would otherwise open them
        stock = grpc.insecure_channel(f"unix:{root}/no-server" if refused else servers["stock"].address)
        to_ours = grpc.insecure_channel(servers["ours"].address)
        for channel in (to_ours,) if refused else (stock, to_ours):
            grpc.channel_ready_future(channel).result(timeout=60)
        ours = GeneratorClient(servers["ours"].address, producer, channel=to_ours, inline=NO_INLINE, timeout_s=300)
        session = {"family": fam, "daemon": daemon, "producer": producer, "consumer": consumer, "stock": stock,
                   "ours": ours, "requests": requests, "renderer": VllmRenderer(model, limit_mm_per_prompt=LIMITS),
                   "offline": json.loads((root / "offline.json").read_text())}
        # the first request opens the clients' remaining connections and warms vLLM's logprobs code
        ours.generate(_render(session, next(iter(requests))), max_tokens=1)
        yield session
        ours.close()
        stock.close()
        to_ours.close()
        producer.close()
        consumer.close()
    finally:
        stop_offline(offline)
        for server in servers.values():
            server.stop()
        process.remove_vllm_orphans(before)
        testing.stop_daemon(daemon)


def _render(family: dict, scenario: str):
    """The scenario rendered by vLLM's processor in the frontend."""
    tokens, items = family["requests"][scenario]
    return family["renderer"].render(tokens, _media(items))


def _assert_offline(family: dict, name: str, token_ids: list[int], logprobs: list[float]) -> None:
    want = family["offline"][name]
    assert token_ids == want["token_ids"], (family["family"].name, name, token_ids, want["token_ids"])
    np.testing.assert_allclose(logprobs, want["logprobs"], rtol=0, atol=1e-5, err_msg=name)


def _settled(family: dict) -> None:
    stat = testing.settle_daemon(family["daemon"], max_leases=0, max_objects=0, timeout_s=10)
    assert (stat.live_objects, stat.live_leases) == (0, 0), testing.describe_daemon_state(family["daemon"], stat)


@pytest.mark.parametrize(("family", "scenario"), CASES, indirect=["family"], scope="module")
def test_ours_gives_the_offline_engines_tokens(family, scenario):
    request = _render(family, scenario)
    assert len(request.features) == len(SCENARIOS[scenario])
    out = family["ours"].generate(request, max_tokens=MAX_TOKENS, temperature=0.0, logprobs=1)
    _assert_offline(family, scenario, out.token_ids, out.logprobs)
    _settled(family)


@pytest.mark.parametrize("shm", [True, False], ids=["stock-shm", "stock-inline"])
@pytest.mark.parametrize(("family", "scenario"), CASES, indirect=["family"], scope="module")
def test_the_stock_server_gives_the_offline_engines_tokens_or_the_bridge_refuses_typed(family, scenario, shm):
    """vLLM's stock server fed by the SMG bridge, where SMG's request can carry the items; where it
    cannot, the bridge's typed refusal, before anything reaches the server or shared memory."""
    request = _render(family, scenario)
    f = family
    send = functools.partial(paths.send_stock, f["stock"], f["producer"] if shm else None,
                             f["consumer"] if shm else None, request.token_ids, request.features, shm=shm,
                             max_tokens=MAX_TOKENS, logprobs=1)
    refused = STOCK_REFUSES.get(f["family"].name)
    if refused is None:
        out = send()
        _assert_offline(f, scenario, out.token_ids, out.logprobs)
    else:
        with pytest.raises(Unrepresentable, match=refused):
            send()
    _settled(f)
