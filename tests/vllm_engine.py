"""The suite's one vLLM engine session (fixture ``vllm_session``, registered by conftest.py), shared
by every test module and doc example that needs vLLM's real engine: it takes about a minute to
start on two cores, so it starts once per run.

One session starts, side by side: our daemon, vLLM's stock gRPC server (SMG's ``VllmEngineServicer``
over AsyncLLM, the unmodified ``vllm serve --grpc``), our zero-copy ``shmtransport vllm-worker`` over
a tiny random-weight Qwen2-VL built at run time, and vLLM's offline engine in a child process that
runs every scenario once (``offline``: the reference tokens and logprobs).

The session is a dict: ``daemon``, ``producer``, ``consumer``, ``channels`` (``stock``, ``ours``),
``ours`` (a ``GeneratorClient`` of our worker that sends every tensor through shared memory),
``servers`` (``process.EngineServer``s), ``model`` (the model directory), ``scenarios``, ``offline``,
``renderer``, ``root``, ``encoder_log`` (``model_worker.ENCODER_INPUT_LOG_ENV`` of our worker).
Everything vLLM-specific is imported inside the fixture: this module loads without vLLM.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import numpy as np
import pytest

HERE = os.path.dirname(__file__)
MAX_TOKENS = 6  # what the offline reference generates per scenario


def _scenarios(renderer: Any) -> dict:
    from shmtransport.frontend.media import synthetic_image, synthetic_video

    img = lambda w, h, seed: renderer.image(synthetic_image(w, h, seed))  # noqa: E731
    vid = lambda n, w, h, seed: renderer.video(synthetic_video(n, w, h, seed))  # noqa: E731
    items = {
        "single-image": [img(112, 84, 1)],
        "ragged-images": [img(112, 84, 2), img(200, 150, 3), img(56, 56, 4)],
        # large enough that vLLM's encoder cache keeps only the first image between two requests
        "ragged-images-large": [img(224, 224, 12), img(448, 336, 13), img(112, 84, 14)],
        "video": [vid(4, 112, 112, 5)],
        "image-and-video": [img(140, 98, 6), vid(2, 84, 84, 7)],
    }
    return {name: renderer.prompt("describe this", its) for name, its in items.items()}


# Source media with one placeholder per item, rendered by vLLM's own processor on both sides: in
# the offline engine, and through ``frontend.vllm_renderer`` on our path.
RAW_SCENARIOS = {
    "raw-image": [("image", (112, 84, 21))],
    "raw-images-and-video": [("image", (140, 98, 22)), ("video", (4, 84, 84, 23)), ("image", (56, 112, 24))],
}


def raw_media(name: str) -> list[tuple[str, np.ndarray]]:
    """The items of RAW_SCENARIOS ``name`` in prompt order: (modality, an HxWx3 image or a TxHxWx3 video)."""
    from shmtransport.frontend.media import synthetic_image, synthetic_video

    items = []
    for modality, args in RAW_SCENARIOS[name]:
        if modality == "image":
            items.append((modality, np.asarray(synthetic_image(*args).convert("RGB"))))
        else:
            items.append((modality, np.stack([np.asarray(f.convert("RGB")) for f in synthetic_video(*args)])))
    return items


def raw_prompt(model: str, items: list[tuple[str, np.ndarray]]) -> tuple[list[int], dict[str, list[np.ndarray]]]:
    """Token ids with one placeholder per item (the tiny model's special tokens), and the media by modality."""
    from shmtransport.engine import tiny_model

    ids = tiny_model.special_token_ids(model)
    tokens = [1, 2]
    media: dict[str, list[np.ndarray]] = {}
    for modality, source in items:
        tokens += [ids["vision_start"], ids[f"{modality}_pad"], ids["vision_end"]]
        media.setdefault(modality, []).append(source)
    return tokens + [7, 8], media


def raw_offline_arrays(requests: dict[str, tuple[list[int], list[tuple[str, Any]]]]) -> dict[str, np.ndarray]:
    """Requests of source media for tests/engine/offline_vllm.py: name -> (token ids with one
    placeholder per item, items in prompt order as (modality, source)); a source may be vLLM's
    (array, metadata) pair: a video with its metadata, an audio clip with its sample rate."""
    arrays = {}
    for name, (tokens, items) in requests.items():
        metadata = {}
        for i, (_, source) in enumerate(items):
            if isinstance(source, tuple):
                source, metadata[str(i)] = source
            arrays[f"{name}/{i}/media"] = source
        meta = {"raw": True, "token_ids": tokens, "modalities": [m for m, _ in items], "max_tokens": MAX_TOKENS,
                "logprobs": 1, "metadata": metadata}
        arrays[f"{name}/meta"] = np.frombuffer(json.dumps(meta).encode(), np.uint8)
    return arrays


def _offline_requests(scenarios: dict, path: str, model: str) -> None:
    """The scenarios as tensors + JSON for tests/engine/offline_vllm.py, and RAW_SCENARIOS as media."""
    from shmtransport.identity import item_identity

    arrays = raw_offline_arrays({name: (raw_prompt(model, raw_media(name))[0], raw_media(name))
                                 for name in RAW_SCENARIOS})
    for name, prompt in scenarios.items():
        meta = {"token_ids": prompt.token_ids, "max_tokens": MAX_TOKENS, "logprobs": 1, "items": []}
        for i, f in enumerate(prompt.features):
            for key, value in f.kwargs.items():
                arrays[f"{name}/{i}/{key}"] = value
            meta["items"].append({
                "modality": f.modality, "offset": f.placeholder.offset, "length": f.placeholder.length,
                "mm_hash": item_identity(f.modality, f.kwargs, "xxh3-128"),
                "fields": {k: {"kind": c.kind, "dim": c.dim, "keep_on_cpu": c.keep_on_cpu,
                               "slices": [[s.start, s.stop] for s in c.slices]}
                           for k, c in f.fields.items()}})
        arrays[f"{name}/meta"] = np.frombuffer(json.dumps(meta).encode(), np.uint8)
    np.savez(path, **arrays)


def start_offline(model: str, requests_path: str, out_path: str, root: Any) -> subprocess.Popen:
    """vLLM's offline engine over ``requests_path`` in a child process (its own session, its log
    ``root/offline.log``); it writes the reference outputs to ``out_path`` and exits."""
    from shmtransport.engine import environment

    env = environment.with_defaults(environment.isolated_environment(root / "runtime"), os.environ)
    with open(root / "offline.log", "wb") as log:  # the child keeps its own copy of the fd
        return subprocess.Popen([sys.executable, os.path.join(HERE, "engine", "offline_vllm.py"), model,
                                 requests_path, out_path], env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)


def stop_offline(offline: subprocess.Popen | None) -> None:
    """Kill the offline engine's process group if it still runs."""
    if offline is not None and offline.poll() is None:
        os.killpg(offline.pid, 9)
        offline.wait()


@pytest.fixture(scope="session")
def vllm_session(tmp_path_factory):
    for module in ("torch", "vllm", "transformers"):  # conftest: a failure under SHMTRANSPORT_REQUIRE_EXTRAS
        pytest.importorskip(module)
    import grpc

    from shmtransport import NO_INLINE, GeneratorClient, testing
    from shmtransport.client import Consumer, Producer
    from shmtransport.engine import model_worker, process, tiny_model
    from shmtransport.engine.qwen2_vl import Qwen2VLRenderer

    root = tmp_path_factory.mktemp("vllm")
    model = tiny_model.build(root / "model")
    renderer = Qwen2VLRenderer(model)
    scenarios = _scenarios(renderer)
    _offline_requests(scenarios, str(root / "offline.npz"), str(model))
    daemon = testing.start_daemon(arena_nbytes=256 << 20)
    runtime = root / "runtime"
    offline_out = root / "offline.json"
    offline = None
    servers: dict = {}
    try:
        offline = start_offline(str(model), str(root / "offline.npz"), str(offline_out), root)
        encoder_log = root / "encoder_inputs.jsonl"  # where each tensor our worker's model encodes lies
        servers = process.start_stock_and_ours(model, daemon.config.socket_path, runtime_dir=runtime, log_dir=root,
                                               ours_env={model_worker.ENCODER_INPUT_LOG_ENV: str(encoder_log)})
        assert offline.wait(600) == 0, (root / "offline.log").read_text()[-4000:]
        producer, consumer = Producer(daemon.config.socket_path), Consumer(daemon.config.socket_path)
        channels = {name: grpc.insecure_channel(server.address) for name, server in servers.items()}
        # every tensor through shared memory: the path the parity tests and the copy counts are about
        ours = GeneratorClient(servers["ours"].address, producer, channel=channels["ours"], inline=NO_INLINE,
                               timeout_s=300)
        session = {"daemon": daemon, "producer": producer, "consumer": consumer, "channels": channels, "ours": ours,
                   "servers": servers, "model": str(model),
                   "scenarios": scenarios, "offline": json.loads(offline_out.read_text()), "renderer": renderer,
                   "root": root, "encoder_log": encoder_log}
        all_paths(session, "single-image")  # connects every channel and compiles vLLM's logprobs code
        yield session
        ours.close()
        for ch in channels.values():
            ch.close()
        producer.close()
        consumer.close()
    finally:
        stop_offline(offline)
        for server in servers.values():
            server.stop()
        testing.stop_daemon(daemon)


def all_paths(s: dict, name: str) -> dict:
    """Scenario ``name`` down every path: ``ours``, ``stock-shm``, ``stock-inline`` -> ``paths.Completion``."""
    from shmtransport.engine import paths

    prompt = s["scenarios"][name]
    kw = dict(max_tokens=MAX_TOKENS, logprobs=1)
    return {
        "ours": paths.send_ours(s["ours"], prompt.token_ids, prompt.features, **kw),
        "stock-shm": paths.send_stock(s["channels"]["stock"], s["producer"], s["consumer"], prompt.token_ids,
                                      prompt.features, shm=True, **kw),
        "stock-inline": paths.send_stock(s["channels"]["stock"], None, None, prompt.token_ids, prompt.features,
                                         shm=False, **kw),
    }
