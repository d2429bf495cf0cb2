"""The public client of the worker's ``Generator`` service (``GeneratorClient``,
``AsyncGeneratorClient``) against real workers: vLLM's engine behind ``shmtransport vllm-worker``
(the suite's shared ``vllm_session``) and the reference ``shmtransport worker``.

Each request must give vLLM's offline engine's tokens and logprobs, leave the daemon with no live
object and no lease once the worker is done, and fail with a typed error when it is bad. A cancelled
request must also stop the engine (it goes idle), not only the stream.
"""
from __future__ import annotations

import asyncio
import os
import socket
import threading

import numpy as np
import pytest
from vllm_engine import RAW_SCENARIOS, raw_media, raw_prompt

from shmtransport import (
    NO_INLINE,
    AsyncGeneratorClient,
    AsyncProducer,
    Completion,
    FeatureItem,
    GeneratorClient,
    InvalidArgument,
    PlaceholderRange,
    Producer,
    WorkerUnavailable,
    testing,
)
from shmtransport.engine import paths

pytestmark = pytest.mark.timeout(900)  # the first engine test may pay for starting the engines
MAX_TOKENS = 6  # the offline reference's length
MAX_MODEL_LEN = 4096  # engine.process.ENGINE_FLAGS


def _long(prompt) -> int:
    """A request long enough that an engine still generating it would stay busy for many seconds."""
    return MAX_MODEL_LEN - len(prompt.token_ids) - 8


def _settled(s: dict) -> None:
    stat = testing.settle_daemon(s["daemon"], max_leases=0, max_objects=0, timeout_s=10)
    assert (stat.live_objects, stat.live_leases) == (0, 0), testing.describe_daemon_state(s["daemon"], stat)


def _assert_offline(s: dict, name: str, token_ids: list[int], logprobs: list[float]) -> None:
    want = s["offline"][name]
    assert token_ids == want["token_ids"], (name, token_ids, want["token_ids"])
    np.testing.assert_allclose(logprobs, want["logprobs"], rtol=0, atol=1e-5, err_msg=name)


def _engine_went_idle(s: dict) -> bool:
    """Whether our worker's engine stops computing within a few seconds (vLLM's CPU engine busy-polls
    for about a second after its last request); a request it still generates keeps it busy."""
    return bool(s["servers"]["ours"].wait_idle(timeout_s=6.0, window_s=0.5, max_busy=0.2))


GREEDY = dict(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=1)


@pytest.fixture(scope="module")
def vllm_renderer(vllm_session):
    import json

    from shmtransport.engine.process import ENGINE_FLAGS
    from shmtransport.frontend.vllm_renderer import VllmRenderer

    limits = json.loads(dict(zip(ENGINE_FLAGS[::2], ENGINE_FLAGS[1::2]))["--limit-mm-per-prompt"])
    return VllmRenderer(vllm_session["model"], limit_mm_per_prompt=limits)


@pytest.mark.parametrize("name", list(RAW_SCENARIOS))
def test_source_media_rendered_by_vllms_processor_give_the_offline_engines_tokens(vllm_session, vllm_renderer, name):
    """Images and video as a user has them: vLLM's own processor renders them in the frontend
    (``VllmRenderer``), the tensors go through shared memory, and the worker's engine answers what
    vLLM's offline engine answers for the same media (which it processes itself)."""
    s = vllm_session
    tokens, media = raw_prompt(s["model"], raw_media(name))
    rendered = vllm_renderer.render(tokens, media)
    assert len(rendered.features) == len(RAW_SCENARIOS[name])
    _assert_offline(s, name, *_tokens_and_logprobs(s["ours"].generate(rendered, **GREEDY)))
    _settled(s)


@pytest.mark.parametrize("name", ["single-image", "image-and-video"])
def test_sync_stream_gives_the_offline_engines_tokens(vllm_session, name):
    """The public client with its default inline policy, with every tensor in shared memory (the
    ``paths.send_ours`` path) and with no producer at all (tensors inline): the same tokens and
    logprobs as vLLM's offline engine, chunk by chunk as documented."""
    s = vllm_session
    prompt = s["scenarios"][name]
    address = s["servers"]["ours"].address
    with GeneratorClient(address, s["producer"], timeout_s=300) as client:
        with client.generate_stream(prompt, **GREEDY) as stream:
            chunks = list(stream)
        assert stream.finish_reason == "length" and not stream.cancelled
        assert chunks[0].num_prompt_tokens == len(prompt.token_ids)
        assert [c.finish_reason for c in chunks] == [None] * (len(chunks) - 1) + ["length"]
        assert all(len(c.logprobs) == len(c.token_ids) == len(c.top_logprobs) for c in chunks)
        assert all(c.top_logprobs[i][t] == c.logprobs[i] for c in chunks for i, t in enumerate(c.token_ids))
        _assert_offline(s, name, [t for c in chunks for t in c.token_ids], [v for c in chunks for v in c.logprobs])
        # the same request joined, from token ids and items given apart
        joined = client.generate(prompt.token_ids, prompt.features, **GREEDY)
    assert isinstance(joined, Completion) and joined.finish_reason == "length"
    assert joined.num_prompt_tokens == len(prompt.token_ids)
    _assert_offline(s, name, joined.token_ids, joined.logprobs)
    ours = paths.send_ours(s["ours"], prompt.token_ids, prompt.features, max_tokens=MAX_TOKENS)
    assert (ours.token_ids, ours.logprobs) == (joined.token_ids, joined.logprobs)
    with GeneratorClient(address, timeout_s=300) as inline:  # no producer: the bytes ride in the message
        _assert_offline(s, name, *_tokens_and_logprobs(inline.generate(prompt, **GREEDY)))
    _settled(s)


def _tokens_and_logprobs(c: Completion) -> tuple[list[int], list[float]]:
    return c.token_ids, c.logprobs


def test_items_built_by_hand_as_feature_items(vllm_session):
    """``FeatureItem``s a frontend builds itself from numpy arrays (here: the renderer's tensors
    copied into new arrays, with the placeholder of the prompt) go the same way."""
    s = vllm_session
    prompt = s["scenarios"]["single-image"]
    f = prompt.features[0]
    item = FeatureItem("image", {k: np.array(v) for k, v in f.kwargs.items()},
                       PlaceholderRange(f.placeholder.offset, f.placeholder.length), fields=dict(f.fields))
    with GeneratorClient(s["servers"]["ours"].address, s["producer"], timeout_s=300) as client:
        c = client.generate(list(prompt.token_ids), [item], **GREEDY)
    _assert_offline(s, "single-image", c.token_ids, c.logprobs)
    _settled(s)


@pytest.mark.parametrize("producer_kind", ["async", "sync", "none"])
def test_asyncio_stream_gives_the_offline_engines_tokens(vllm_session, producer_kind):
    s = vllm_session
    prompt = s["scenarios"]["video"]

    async def main() -> tuple[list, str | None]:
        producer = {"async": lambda: AsyncProducer(s["daemon"].config.socket_path), "sync": lambda: s["producer"],
                    "none": lambda: None}[producer_kind]()
        try:
            async with AsyncGeneratorClient(s["servers"]["ours"].address, producer, timeout_s=300) as client:
                stream = client.generate_stream(prompt, **GREEDY)
                chunks = [chunk async for chunk in stream]
                joined = await client.generate(prompt.token_ids, prompt.features, **GREEDY)
                assert (joined.token_ids, joined.finish_reason) == ([t for c in chunks for t in c.token_ids], "length")
                return chunks, stream.finish_reason
        finally:
            if isinstance(producer, AsyncProducer):
                await producer.close()

    chunks, finish = asyncio.run(main())
    assert finish == "length" and chunks[0].num_prompt_tokens == len(prompt.token_ids)
    _assert_offline(s, "video", [t for c in chunks for t in c.token_ids], [v for c in chunks for v in c.logprobs])
    _settled(s)


@pytest.mark.parametrize("when", ["before-the-first-chunk", "mid-stream"])
def test_cancel_stops_the_engine_and_frees_everything(vllm_session, when):
    """``TokenStream.cancel()`` ends iteration, the worker aborts the request in vLLM (its engine
    goes idle although thousands of tokens were asked for) and the daemon ends with nothing live."""
    s = vllm_session
    prompt = s["scenarios"]["ragged-images"].variant(1 if when == "mid-stream" else 2)  # new bytes: a new upload
    with GeneratorClient(s["servers"]["ours"].address, s["producer"], inline=NO_INLINE, timeout_s=300) as client:
        stream = client.generate_stream(prompt, max_tokens=_long(prompt), ignore_eos=True, temperature=0.0)
        got = []
        if when == "mid-stream":
            for chunk in stream:
                got += chunk.token_ids
                if len(got) >= 2:
                    break
            # the control: a request being generated keeps the engine busy (so "idle" below means aborted)
            assert not s["servers"]["ours"].wait_idle(timeout_s=1.5, window_s=0.5, max_busy=0.2)
        else:  # the producer still holds the request's tensors: cancel must drop them
            # (read from the daemon's books in-process: a gRPC Stat from the producer here stalled
            # for its whole 10 s deadline in about one full run in three, with every Python thread
            # idle, so inside gRPC; it is not what this test is about, and it left the request
            # uncancelled for the tests after it)
            assert s["daemon"].stat().live_objects > 0
        stream.cancel()
        assert list(stream) == [] and stream.cancelled and stream.finish_reason is None
        assert len(got) < _long(prompt)
    assert _engine_went_idle(s), "the engine kept generating the cancelled request"
    _settled(s)


def test_asyncio_task_cancellation_cancels_the_request(vllm_session):
    s = vllm_session
    prompt = s["scenarios"]["ragged-images"].variant(3)

    async def main() -> int:
        async with AsyncGeneratorClient(s["servers"]["ours"].address, s["producer"], timeout_s=300) as client:
            streaming = asyncio.Event()
            seen = 0

            async def consume() -> None:
                nonlocal seen
                async for chunk in client.generate_stream(prompt, max_tokens=_long(prompt), ignore_eos=True):
                    seen += len(chunk.token_ids)
                    streaming.set()

            task = asyncio.create_task(consume())
            await asyncio.wait_for(streaming.wait(), 120)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            return seen

    assert asyncio.run(main()) < _long(prompt)
    assert _engine_went_idle(s), "the engine kept generating the cancelled request"
    _settled(s)


def test_a_bad_request_is_a_typed_error(vllm_session):
    """What the worker refuses (a token id outside the vocabulary: vLLM's own check) arrives as
    ``InvalidArgument``, sync and asyncio; what the client can tell is wrong (a placeholder past
    the prompt's end) raises before anything is sent. Nothing stays behind in the daemon."""
    s = vllm_session
    prompt = s["scenarios"]["single-image"]
    out_of_vocabulary = list(prompt.token_ids) + [10 ** 7]
    address = s["servers"]["ours"].address
    with GeneratorClient(address, s["producer"], timeout_s=300) as client:
        with pytest.raises(InvalidArgument, match="engine rejected"):
            client.generate(out_of_vocabulary, prompt.features, max_tokens=2)
        with pytest.raises(InvalidArgument):
            client.generate(prompt.token_ids[:5], prompt.features, max_tokens=2)

    async def main() -> None:
        async with AsyncGeneratorClient(address, s["producer"], timeout_s=300) as client:
            with pytest.raises(InvalidArgument, match="engine rejected"):
                async for _ in client.generate_stream(out_of_vocabulary, prompt.features, max_tokens=2):
                    pass

    asyncio.run(main())
    _settled(s)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_a_worker_that_is_not_there_is_worker_unavailable(daemon):
    tokens = [1, 2, 3]
    items = [FeatureItem("image", {"pixel_values": np.ones((4, 8), np.float32)}, PlaceholderRange(1, 2))]
    address = f"127.0.0.1:{_free_port()}"
    with Producer(daemon.socket_path) as producer:
        with GeneratorClient(address, producer, timeout_s=10) as client:
            with pytest.raises(WorkerUnavailable):
                client.generate(tokens, items, max_tokens=1)

        async def main() -> None:
            async with AsyncGeneratorClient(address, producer, timeout_s=10) as client:
                with pytest.raises(WorkerUnavailable):
                    await client.generate(tokens, items, max_tokens=1)

        asyncio.run(main())
    # the daemon fixture fails the test if the request's tensors stayed in shared memory


def test_the_reference_worker_serves_the_same_client(daemon, tmp_path):
    """``shmtransport worker`` (the reference model, no vLLM) through the same client: greedy tokens
    equal to the internal ``Frontend``'s for the same items, and a cancel mid-stream."""
    from shmtransport.frontend.generate import Frontend, Item
    from shmtransport.frontend.media import synthetic_features
    from shmtransport.frontend.prompt import expand_prompt
    from shmtransport.worker.process import WorkerProcess

    kwargs = synthetic_features("image", grid=(1, 16, 16), seed=5)
    expanded = expand_prompt("what is this", [("image", kwargs)])
    items = [FeatureItem("image", kwargs, expanded.placeholders[0])]
    tmp = testing.short_tmpdir("shmtcl")  # an AF_UNIX path short enough
    worker = WorkerProcess(os.path.join(tmp, "w.sock"), daemon.socket_path, extra_args=("--torch-threads", "1"))
    try:
        with Producer(daemon.socket_path) as producer, \
                GeneratorClient(worker.address, producer, timeout_s=60) as client, \
                Frontend(worker.address, producer, timeout_s=60) as frontend:
            got = client.generate(expanded.token_ids, items, max_tokens=8, temperature=0.0)
            want = frontend.generate([Item("image", kwargs)], "what is this",
                                     sampling={"temperature": 0.0}, stopping={"max_tokens": 8})
            assert got.token_ids == want.token_ids and len(got.token_ids) == 8
            stream = client.generate_stream(expanded.token_ids, items, max_tokens=500, ignore_eos=True)
            first = next(stream)
            canceller = threading.Thread(target=stream.cancel)  # cancel is thread-safe
            canceller.start()
            canceller.join()
            rest = list(stream)
            assert stream.cancelled and len(first.token_ids) + sum(len(c.token_ids) for c in rest) < 500
    finally:
        worker.stop()
        testing.remove_tree(tmp)
    # the daemon fixture fails the test if the worker or the client left a lease or an object
