"""Typed Generate request -> engine sampling parameters, omitted vs explicit vs disabled kept exact.

``project_sampling(req)`` returns an ``EngineSampling`` whose ``kwargs`` are shaped like vLLM's
``SamplingParams(**kwargs)``: a control the request OMITS is absent from ``kwargs`` (the engine
applies its own default); a control the request SETS is present with that value, including the
disabled sentinels (``top_k`` -1 or 0, ``min_p`` 0, ``temperature`` 0 = greedy, neutral penalties).
``explicit`` lists the names that were set, so a bridge can tell "disabled" from "default".

Value rules (vLLM ``SamplingParams._verify_args``): temperature >= 0 and finite; 0 < top_p <= 1;
top_k >= -1; 0 <= min_p <= 1; -2 <= presence/frequency_penalty <= 2; repetition_penalty > 0;
logprobs / prompt_logprobs >= -1 (-1 = whole vocabulary); min_tokens <= max_tokens; max_tokens >= 1;
logit_bias values finite. The prompt must be token ids (a text prompt is rejected).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

from ..errors import InvalidArgument
from ..v1 import generate_pb2 as gpb

__all__ = ["EngineSampling", "project_sampling", "prompt_token_ids", "SAMPLING_FIELDS", "STOPPING_FIELDS",
           "RESPONSE_FIELDS"]

# proto field name -> vLLM SamplingParams kwarg
SAMPLING_FIELDS = {
    "temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p", "seed": "seed",
    "presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty",
    "repetition_penalty": "repetition_penalty", "logprobs": "logprobs", "prompt_logprobs": "prompt_logprobs",
}
STOPPING_FIELDS = {
    "max_tokens": "max_tokens", "min_tokens": "min_tokens",
    "include_stop_str_in_output": "include_stop_str_in_output", "ignore_eos": "ignore_eos",
}
RESPONSE_FIELDS = {"skip_special_tokens": "skip_special_tokens",
                   "spaces_between_special_tokens": "spaces_between_special_tokens"}


@dataclasses.dataclass
class EngineSampling:
    """vLLM ``SamplingParams`` kwargs (omitted controls absent) plus response options."""

    kwargs: dict[str, Any]
    explicit: frozenset[str]  # kwarg names the request set explicitly
    output_token_ids: bool = True
    return_sampling_mask: bool = False

    def is_disabled(self, name: str) -> bool:
        """True when ``name`` was set explicitly to its disabled / neutral value."""
        if name not in self.kwargs:
            return False
        v = self.kwargs[name]
        disabled: dict[str, bool] = {
            "top_k": v in (-1, 0), "min_p": v == 0.0, "temperature": v == 0.0, "top_p": v == 1.0,
            "presence_penalty": v == 0.0, "frequency_penalty": v == 0.0, "repetition_penalty": v == 1.0}
        return disabled.get(name, False)


def _finite(name: str, v: float) -> float:
    if not math.isfinite(v):
        raise InvalidArgument(f"sampling.{name} must be finite, got {v}")
    return float(v)


def _check(name: str, v: Any) -> Any:
    if name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
        v = _finite(name, v)
    if name == "temperature" and v < 0:
        raise InvalidArgument(f"sampling.temperature must be >= 0, got {v}")
    if name == "top_p" and not 0 < v <= 1:
        raise InvalidArgument(f"sampling.top_p must be in (0, 1], got {v}")
    if name == "top_k" and v < -1:
        raise InvalidArgument(f"sampling.top_k must be -1, 0 (disabled) or positive, got {v}")
    if name == "min_p" and not 0 <= v <= 1:
        raise InvalidArgument(f"sampling.min_p must be in [0, 1], got {v}")
    if name in ("presence_penalty", "frequency_penalty") and not -2 <= v <= 2:
        raise InvalidArgument(f"sampling.{name} must be in [-2, 2], got {v}")
    if name == "repetition_penalty" and v <= 0:
        raise InvalidArgument(f"sampling.repetition_penalty must be > 0, got {v}")
    if name in ("logprobs", "prompt_logprobs") and v < -1:
        raise InvalidArgument(f"sampling.{name} must be -1 (all) or >= 0, got {v}")
    if name == "max_tokens" and v < 1:
        raise InvalidArgument(f"stopping.max_tokens must be >= 1, got {v}")
    return v


def prompt_token_ids(req: gpb.GenerateRequest) -> list[int]:
    """The request's prompt token ids; InvalidArgument for a text prompt, a missing or an empty one."""
    which = req.WhichOneof("prompt")
    if which == "text":
        raise InvalidArgument("prompt: a text prompt is not accepted: send token_ids (tokenize on the frontend)")
    if which is None:
        raise InvalidArgument("prompt: token_ids is required")
    if not req.token_ids.ids:
        raise InvalidArgument("prompt: token_ids is empty")
    return list(req.token_ids.ids)


def project_sampling(req: gpb.GenerateRequest) -> EngineSampling:
    """vLLM ``SamplingParams`` kwargs of the request's controls (omitted ones absent), each value checked."""
    kwargs: dict[str, Any] = {}
    explicit: set[str] = set()
    for msg, table in ((req.sampling, SAMPLING_FIELDS), (req.stopping, STOPPING_FIELDS),
                       (req.response, RESPONSE_FIELDS)):
        for field, kwarg in table.items():
            if msg.HasField(field):
                kwargs[kwarg] = _check(kwarg, getattr(msg, field))
                explicit.add(kwarg)
    if req.sampling.logit_bias:
        bias = {}
        for tok, v in sorted(req.sampling.logit_bias.items()):
            bias[int(tok)] = _finite(f"logit_bias[{tok}]", v)
        kwargs["logit_bias"] = bias
        explicit.add("logit_bias")
    if req.stopping.stop:
        if any(s == "" for s in req.stopping.stop):
            raise InvalidArgument("stopping.stop must not contain an empty string")
        kwargs["stop"] = list(req.stopping.stop)
        explicit.add("stop")
    if req.stopping.stop_token_ids:
        kwargs["stop_token_ids"] = list(req.stopping.stop_token_ids)
        explicit.add("stop_token_ids")
    if "min_tokens" in kwargs and "max_tokens" in kwargs and kwargs["min_tokens"] > kwargs["max_tokens"]:
        raise InvalidArgument(f"stopping.min_tokens ({kwargs['min_tokens']}) must be <= max_tokens "
                              f"({kwargs['max_tokens']})")
    resp = req.response
    return EngineSampling(
        kwargs, frozenset(explicit),
        output_token_ids=resp.output_token_ids if resp.HasField("output_token_ids") else True,
        return_sampling_mask=resp.return_sampling_mask if resp.HasField("return_sampling_mask") else False,
    )
