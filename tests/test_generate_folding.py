"""Folding a chunk stream into one response, with the terminal sampling mask validated."""
from __future__ import annotations

import pytest

from shmtransport.errors import InvalidArgument
from shmtransport.protocol.folding import LOGPROB_FLOOR, MalformedResponse, fold, mask_rows
from shmtransport.v1 import generate_pb2 as gpb


def chunk(ids, *, logprobs=None, top=None, terminal=False, reason=gpb.FINISH_REASON_LENGTH, n_out=None,
          mask=None, prompt=0, num_tokens=None, **kw):
    c = gpb.GenerateStreamChunk(token_ids=ids, num_tokens=len(ids) if num_tokens is None else num_tokens,
                                num_prompt_tokens=prompt, **kw)
    if logprobs is not None:
        c.logprobs.extend(logprobs)
    for row in top or []:
        c.top_logprobs.add(token_ids=row[0], logprobs=row[1])
    if terminal:
        c.terminal = True
        c.finish_reason = reason
        c.num_output_tokens = n_out if n_out is not None else 0
        if mask is not None:
            c.sampling_mask.token_ids.extend(mask[0])
            c.sampling_mask.offsets.extend(mask[1])
    return c


def good_stream():
    return [chunk([5, 6], logprobs=[-0.5, -1.0], top=[([5, 9], [-0.5, -2.0]), ([6, 1], [-1.0, -3.0])], prompt=4),
            chunk([7], logprobs=[-0.25], top=[([7, 3], [-0.25, -4.0])]),
            chunk([], terminal=True, reason=gpb.FINISH_REASON_STOP, n_out=3,
                  mask=([5, 9, 6, 7, 3], [0, 2, 3, 5]), matched_stop=gpb.MatchedStop(stop_token_id=7))]


def test_good_stream_folds():
    out = fold(good_stream(), request_id="r1")
    assert list(out.token_ids) == [5, 6, 7] and list(out.logprobs) == [-0.5, -1.0, -0.25]
    assert len(out.top_logprobs) == 3 and list(out.top_logprobs[2].token_ids) == [7, 3]
    assert out.finish_reason == gpb.FINISH_REASON_STOP and out.matched_stop.stop_token_id == 7
    assert out.num_output_tokens == 3 and out.num_prompt_tokens == 4 and out.request_id == "r1"
    assert mask_rows(out.sampling_mask) == [[5, 9], [6], [7, 3]]


def test_tokens_on_the_terminal_chunk_and_empty_rows():
    out = fold([chunk([1]), chunk([2, 3], terminal=True, n_out=3, mask=([1, 3], [0, 1, 1, 2]))])
    assert list(out.token_ids) == [1, 2, 3] and mask_rows(out.sampling_mask) == [[1], [], [3]]


def test_no_mask_is_fine_unless_required():
    out = fold([chunk([1, 2], terminal=True, n_out=2)])
    assert not out.HasField("sampling_mask")
    with pytest.raises(MalformedResponse, match="requested"):
        fold([chunk([1, 2], terminal=True, n_out=2)], require_mask=True)


def test_negative_infinity_logprob_clamped_nan_rejected():
    out = fold([chunk([1], logprobs=[float("-inf")], terminal=True, n_out=1)])
    assert out.logprobs[0] == pytest.approx(LOGPROB_FLOOR)
    with pytest.raises(MalformedResponse, match="NaN"):
        fold([chunk([1], logprobs=[float("nan")], terminal=True, n_out=1)])


MALFORMED = {
    "num_tokens mismatch": ([chunk([1, 2], num_tokens=3), chunk([], terminal=True, n_out=2)], "num_tokens"),
    "logprobs misaligned": ([chunk([1, 2], logprobs=[-1.0]), chunk([], terminal=True, n_out=2)], "logprobs"),
    "top rows misaligned": ([chunk([1, 2], top=[([1], [-1.0])]), chunk([], terminal=True, n_out=2)],
                            "top_logprobs"),
    "top row ids vs logprobs": ([chunk([1], top=[([1, 2], [-1.0])], terminal=True, n_out=1)], "top_logprobs"),
    "logprobs in some chunks only": ([chunk([1], logprobs=[-1.0]), chunk([2], terminal=True, n_out=2)],
                                     "some chunks"),
    "terminal not finished": ([chunk([1], terminal=True, reason=gpb.FINISH_REASON_NOT_FINISHED, n_out=1)],
                              "NOT_FINISHED"),
    "no terminal": ([chunk([1]), chunk([2])], "without a terminal"),
    "empty stream": ([], "without a terminal"),
    "chunk after terminal": ([chunk([1], terminal=True, n_out=1), chunk([2])], "after the terminal"),
    "num_output_tokens mismatch": ([chunk([1, 2], terminal=True, n_out=3)], "num_output_tokens"),
    "finish data early": ([chunk([1], finish_reason=gpb.FINISH_REASON_STOP), chunk([], terminal=True, n_out=1)],
                          "non-terminal"),
    "index != 0": ([chunk([1], terminal=True, n_out=1, index=1)], "index"),
    "prompt count late": ([chunk([1]), chunk([2], terminal=True, n_out=2, prompt=3)], "num_prompt_tokens"),
    "matched stop without STOP": ([chunk([1], terminal=True, n_out=1, matched_stop=gpb.MatchedStop(stop_string="x"))],
                                  "STOP"),
    "mask without offsets": ([chunk([1], terminal=True, n_out=1, mask=([1], []))], "no offsets"),
    "mask offsets not from 0": ([chunk([1], terminal=True, n_out=1, mask=([1, 2], [1, 2]))], "start at 0"),
    "mask offsets decrease": ([chunk([1, 2], terminal=True, n_out=2, mask=([1, 2], [0, 2, 1]))], "decrease"),
    "mask offsets short of ids": ([chunk([1], terminal=True, n_out=1, mask=([1, 2], [0, 1]))], "end at"),
    "mask offsets past ids": ([chunk([1], terminal=True, n_out=1, mask=([1], [0, 2]))], "end at"),
    "mask rows != tokens": ([chunk([1, 2], terminal=True, n_out=2, mask=([1, 2], [0, 2]))], "rows"),
    "mask rows > tokens": ([chunk([1], terminal=True, n_out=1, mask=([1, 2], [0, 1, 2]))], "rows"),
}


@pytest.mark.parametrize("name", list(MALFORMED))
def test_malformed_streams_are_typed_errors(name):
    chunks, needle = MALFORMED[name]
    with pytest.raises(MalformedResponse, match=needle) as info:
        fold(chunks)
    assert isinstance(info.value, InvalidArgument)


def test_mask_on_a_non_terminal_chunk_rejected():
    c = chunk([1])
    c.sampling_mask.offsets.extend([0, 0])
    with pytest.raises(MalformedResponse, match="non-terminal"):
        fold([c, chunk([], terminal=True, n_out=1)])
