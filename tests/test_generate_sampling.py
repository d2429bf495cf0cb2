"""Typed Generate request -> engine sampling kwargs: omitted / explicit / disabled per control."""
from __future__ import annotations

import pytest

from shmtransport.errors import InvalidArgument
from shmtransport.protocol.sampling import project_sampling, prompt_token_ids
from shmtransport.v1 import generate_pb2 as gpb

# (section, proto field, kwarg, explicit value, disabled / neutral value or None)
CONTROLS = [
    ("sampling", "temperature", "temperature", 0.5, 0.0),
    ("sampling", "top_p", "top_p", 0.5, 1.0),
    ("sampling", "top_k", "top_k", 40, -1),
    ("sampling", "top_k", "top_k", 40, 0),
    ("sampling", "min_p", "min_p", 0.25, 0.0),
    ("sampling", "seed", "seed", 1234, None),
    ("sampling", "presence_penalty", "presence_penalty", 0.5, 0.0),
    ("sampling", "frequency_penalty", "frequency_penalty", -0.5, 0.0),
    ("sampling", "repetition_penalty", "repetition_penalty", 1.25, 1.0),
    ("sampling", "logprobs", "logprobs", 5, -1),
    ("sampling", "prompt_logprobs", "prompt_logprobs", 3, -1),
    ("stopping", "max_tokens", "max_tokens", 17, None),
    ("stopping", "min_tokens", "min_tokens", 2, 0),
    ("stopping", "include_stop_str_in_output", "include_stop_str_in_output", True, False),
    ("stopping", "ignore_eos", "ignore_eos", True, False),
    ("response", "skip_special_tokens", "skip_special_tokens", False, True),
    ("response", "spaces_between_special_tokens", "spaces_between_special_tokens", False, True),
]
IDS = [f"{c[1]}={c[4]}" for c in CONTROLS]


def req(**sections) -> gpb.GenerateRequest:
    r = gpb.GenerateRequest(request_id="r", token_ids=gpb.TokenIds(ids=[1, 2, 3]))
    for section, fields in sections.items():
        for k, v in fields.items():
            setattr(getattr(r, section), k, v)
    return r


@pytest.mark.parametrize("section,field,kwarg,explicit,disabled", CONTROLS, ids=IDS)
def test_omitted_control_is_absent(section, field, kwarg, explicit, disabled):
    sp = project_sampling(req())
    assert kwarg not in sp.kwargs and kwarg not in sp.explicit


@pytest.mark.parametrize("section,field,kwarg,explicit,disabled", CONTROLS, ids=IDS)
def test_explicit_control_is_passed_through(section, field, kwarg, explicit, disabled):
    sp = project_sampling(req(**{section: {field: explicit}}))
    assert sp.kwargs[kwarg] == pytest.approx(explicit) and kwarg in sp.explicit
    assert not sp.is_disabled(kwarg)


@pytest.mark.parametrize("section,field,kwarg,explicit,disabled", [c for c in CONTROLS if c[4] is not None],
                         ids=[i for c, i in zip(CONTROLS, IDS) if c[4] is not None])
def test_explicit_disabled_sentinel_is_kept(section, field, kwarg, explicit, disabled):
    sp = project_sampling(req(**{section: {field: disabled}}))
    assert kwarg in sp.kwargs and sp.kwargs[kwarg] == disabled  # not dropped, not "defaulted"
    assert kwarg in sp.explicit
    if kwarg in ("top_k", "min_p", "temperature", "top_p", "presence_penalty", "frequency_penalty",
                 "repetition_penalty"):
        assert sp.is_disabled(kwarg)


def test_repeated_and_map_controls_omitted_and_set():
    sp = project_sampling(req())
    assert not {"stop", "stop_token_ids", "logit_bias"} & set(sp.kwargs)
    r = req()
    r.stopping.stop.extend(["\n\n", "END"])
    r.stopping.stop_token_ids.extend([2, 7])
    r.sampling.logit_bias[5] = -100.0
    r.sampling.logit_bias[3] = 2.5
    sp = project_sampling(r)
    assert sp.kwargs["stop"] == ["\n\n", "END"] and sp.kwargs["stop_token_ids"] == [2, 7]
    assert sp.kwargs["logit_bias"] == {3: 2.5, 5: -100.0}


def test_response_options_defaults():
    sp = project_sampling(req())
    assert sp.output_token_ids is True and sp.return_sampling_mask is False
    sp = project_sampling(req(response={"output_token_ids": False, "return_sampling_mask": True}))
    assert sp.output_token_ids is False and sp.return_sampling_mask is True


@pytest.mark.parametrize("section,field,value,needle", [
    ("sampling", "temperature", -0.1, "temperature"),
    ("sampling", "temperature", float("nan"), "temperature"),
    ("sampling", "top_p", 0.0, "top_p"),
    ("sampling", "top_p", 1.5, "top_p"),
    ("sampling", "top_k", -2, "top_k"),
    ("sampling", "min_p", 1.5, "min_p"),
    ("sampling", "presence_penalty", 2.5, "presence_penalty"),
    ("sampling", "repetition_penalty", 0.0, "repetition_penalty"),
    ("sampling", "logprobs", -2, "logprobs"),
    ("sampling", "prompt_logprobs", -5, "prompt_logprobs"),
    ("stopping", "max_tokens", 0, "max_tokens"),
])
def test_invalid_values_rejected(section, field, value, needle):
    with pytest.raises(InvalidArgument, match=needle):
        project_sampling(req(**{section: {field: value}}))


def test_min_tokens_above_max_tokens_rejected():
    with pytest.raises(InvalidArgument, match="min_tokens"):
        project_sampling(req(stopping={"max_tokens": 3, "min_tokens": 4}))


def test_empty_stop_string_and_non_finite_bias_rejected():
    r = req()
    r.stopping.stop.append("")
    with pytest.raises(InvalidArgument, match="empty string"):
        project_sampling(r)
    r = req()
    r.sampling.logit_bias[1] = float("inf")
    with pytest.raises(InvalidArgument, match="logit_bias"):
        project_sampling(r)


def test_prompt_must_be_token_ids():
    assert prompt_token_ids(req()) == [1, 2, 3]
    with pytest.raises(InvalidArgument, match="text prompt is not accepted"):
        prompt_token_ids(gpb.GenerateRequest(text="hello"))
    with pytest.raises(InvalidArgument, match="token_ids is required"):
        prompt_token_ids(gpb.GenerateRequest())
    with pytest.raises(InvalidArgument, match="empty"):
        prompt_token_ids(gpb.GenerateRequest(token_ids=gpb.TokenIds()))


def test_presence_survives_the_wire():
    r = req(sampling={"top_k": 0, "min_p": 0.0, "temperature": 0.0})
    back = gpb.GenerateRequest.FromString(r.SerializeToString())
    sp = project_sampling(back)
    assert sp.kwargs["top_k"] == 0 and sp.kwargs["min_p"] == 0.0 and sp.kwargs["temperature"] == 0.0
    assert "top_p" not in sp.kwargs
