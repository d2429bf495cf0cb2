"""Fold a ``GenerateStreamChunk`` stream into one ``GenerateResponse``, validating as it goes.

Rules (protocol-facts 1.3 ``WireSamplingMask``, 5.2 response-side checks). Any violation raises
``MalformedResponse`` (an ``InvalidArgument``); nothing malformed is returned silently:

- every chunk: ``index == 0``; ``num_tokens == len(token_ids)``; ``logprobs`` empty or one per
  token; ``top_logprobs`` empty or one per token, each with equal-length ids / logprobs; the
  logprob presence is the same in every non-empty chunk; only the terminal chunk carries
  ``finish_reason`` / ``matched_stop`` / ``num_output_tokens`` / ``sampling_mask``; nothing after
  the terminal chunk; a stream without a terminal chunk is an error;
- terminal chunk: ``finish_reason`` != NOT_FINISHED; ``num_output_tokens`` == tokens streamed;
  a matched stop only with STOP;
- sampling mask (CSR): ``offsets`` starts at 0, is nondecreasing, ends at ``len(token_ids)``, and
  has one row per generated token (``len(offsets) == num_output_tokens + 1``); a mask with token ids
  but no offsets is an error. ``require_mask=True`` makes a missing mask an error.
- non-finite logprobs: NaN is an error; -inf is clamped to ``LOGPROB_FLOOR`` (Python side, -1e30).
"""
from __future__ import annotations

import math
from typing import Iterable

from ..errors import InvalidArgument
from ..v1 import generate_pb2 as gpb

LOGPROB_FLOOR = -1e30

__all__ = ["MalformedResponse", "fold", "check_sampling_mask", "mask_rows", "LOGPROB_FLOOR"]


class MalformedResponse(InvalidArgument):
    """A response stream that breaks the protocol (counts, alignment, terminal state, mask)."""


def _logprobs(values: Iterable[float], where: str) -> list[float]:
    out: list[float] = []
    for i, v in enumerate(values):
        if math.isnan(v):
            raise MalformedResponse(f"{where}: logprob[{i}] is NaN")
        out.append(LOGPROB_FLOOR if v == -math.inf else max(v, LOGPROB_FLOOR) if v < LOGPROB_FLOOR else v)
    return out


def check_sampling_mask(mask: gpb.SamplingMask, num_tokens: int) -> None:
    """Raise MalformedResponse unless ``mask`` is a well-formed CSR of ``num_tokens`` rows."""
    offsets = list(mask.offsets)
    if not offsets:
        raise MalformedResponse(f"sampling_mask: no offsets ({len(mask.token_ids)} token ids, {num_tokens} "
                                f"generated tokens need {num_tokens + 1} offsets)")
    if offsets[0] != 0:
        raise MalformedResponse(f"sampling_mask: offsets must start at 0, got {offsets[0]}")
    for i in range(1, len(offsets)):
        if offsets[i] < offsets[i - 1]:
            raise MalformedResponse(f"sampling_mask: offsets decrease at {i} ({offsets[i - 1]} -> {offsets[i]})")
    if offsets[-1] != len(mask.token_ids):
        raise MalformedResponse(f"sampling_mask: offsets end at {offsets[-1]} but there are "
                                f"{len(mask.token_ids)} token ids")
    if len(offsets) - 1 != num_tokens:
        raise MalformedResponse(f"sampling_mask: {len(offsets) - 1} rows but {num_tokens} generated tokens")


def mask_rows(mask: gpb.SamplingMask) -> list[list[int]]:
    """Rows of a (checked) mask: allowed token ids per generated position."""
    ids, off = list(mask.token_ids), list(mask.offsets)
    return [ids[off[i]:off[i + 1]] for i in range(len(off) - 1)]


def fold(chunks: Iterable[gpb.GenerateStreamChunk], *, request_id: str = "",
         require_mask: bool = False) -> gpb.GenerateResponse:
    """One ``GenerateResponse`` from a stream's chunks; MalformedResponse on any rule the stream breaks."""
    out = gpb.GenerateResponse(request_id=request_id)
    terminal = None
    has_logprobs = has_top = None
    n = 0
    for c, chunk in enumerate(chunks):
        where = f"chunk {c}"
        if terminal is not None:
            raise MalformedResponse(f"{where}: chunk after the terminal chunk")
        if chunk.index != 0:
            raise MalformedResponse(f"{where}: index {chunk.index} (only one sequence, index 0)")
        k = len(chunk.token_ids)
        if chunk.num_tokens != k:
            raise MalformedResponse(f"{where}: num_tokens {chunk.num_tokens} but {k} token ids carried")
        if chunk.logprobs and len(chunk.logprobs) != k:
            raise MalformedResponse(f"{where}: {len(chunk.logprobs)} logprobs for {k} tokens")
        if chunk.top_logprobs and len(chunk.top_logprobs) != k:
            raise MalformedResponse(f"{where}: {len(chunk.top_logprobs)} top_logprobs rows for {k} tokens")
        if k:
            for flag, have, name in ((has_logprobs, bool(chunk.logprobs), "logprobs"),
                                     (has_top, bool(chunk.top_logprobs), "top_logprobs")):
                if flag is not None and flag != have:
                    raise MalformedResponse(f"{where}: {name} present in some chunks and absent in others")
            has_logprobs, has_top = bool(chunk.logprobs), bool(chunk.top_logprobs)
        for r, row in enumerate(chunk.top_logprobs):
            if len(row.token_ids) != len(row.logprobs):
                raise MalformedResponse(f"{where}: top_logprobs[{r}] has {len(row.token_ids)} ids and "
                                        f"{len(row.logprobs)} logprobs")
            out.top_logprobs.add(token_ids=row.token_ids, logprobs=_logprobs(row.logprobs, where))
        if c == 0:
            out.num_prompt_tokens = chunk.num_prompt_tokens
        elif chunk.num_prompt_tokens:
            raise MalformedResponse(f"{where}: num_prompt_tokens after the first chunk")
        out.token_ids.extend(chunk.token_ids)
        out.logprobs.extend(_logprobs(chunk.logprobs, where))
        n += k
        if chunk.terminal:
            terminal = chunk
        elif (chunk.finish_reason or chunk.HasField("matched_stop") or chunk.num_output_tokens
              or chunk.HasField("sampling_mask")):
            raise MalformedResponse(f"{where}: finish data on a non-terminal chunk")
    if terminal is None:
        raise MalformedResponse("stream ended without a terminal chunk")
    if terminal.finish_reason == gpb.FINISH_REASON_NOT_FINISHED:
        raise MalformedResponse("terminal chunk says NOT_FINISHED")
    if terminal.num_output_tokens != n:
        raise MalformedResponse(f"terminal num_output_tokens {terminal.num_output_tokens} but {n} tokens streamed")
    if terminal.HasField("matched_stop") and terminal.matched_stop.WhichOneof("matched") is not None \
            and terminal.finish_reason != gpb.FINISH_REASON_STOP:
        raise MalformedResponse("matched_stop on a stream that did not finish with STOP")
    out.finish_reason = terminal.finish_reason
    if terminal.HasField("matched_stop"):
        out.matched_stop.CopyFrom(terminal.matched_stop)
    out.num_output_tokens = n
    if terminal.HasField("sampling_mask"):
        check_sampling_mask(terminal.sampling_mask, n)
        out.sampling_mask.CopyFrom(terminal.sampling_mask)
    elif require_mask:
        raise MalformedResponse("sampling mask requested but the terminal chunk carries none")
    return out
