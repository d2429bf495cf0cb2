"""``frontend.vllm_renderer``: vLLM's own multimodal processing as our renderer, checked against
vLLM itself.

Without an engine: the hand-written ``Qwen2VLRenderer`` (kept because it needs neither vLLM nor
its processor stack in the frontend) must produce exactly what vLLM's processor produces for the
same media (tensors, placeholders, field layouts, ``keep_on_cpu``), on random sizes; vLLM's
refusals arrive typed. A text prompt renders exactly as its token ids do, for Qwen2-VL and every
family of ``engine.tiny_families``. With the engine (tests/test_engine_vllm.py): requests rendered this way
give the offline engine's tokens for the same source media.
"""
from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip("vllm")  # conftest: a failure under SHMTRANSPORT_REQUIRE_EXTRAS

from shmtransport.engine import tiny_model  # noqa: E402
from shmtransport.engine.process import ENGINE_FLAGS  # noqa: E402
from shmtransport.engine.qwen2_vl import Qwen2VLRenderer  # noqa: E402
from shmtransport.engine.tiny_families import FAMILIES  # noqa: E402
from shmtransport.errors import InvalidArgument  # noqa: E402
from shmtransport.frontend.media import synthetic_image, synthetic_video  # noqa: E402
from shmtransport.frontend.vllm_renderer import VllmRenderer  # noqa: E402

LIMITS = dict(zip(ENGINE_FLAGS[::2], ENGINE_FLAGS[1::2]))["--limit-mm-per-prompt"]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return str(tiny_model.build(tmp_path_factory.mktemp("model")))


@pytest.fixture(scope="module")
def renderers(model):
    return VllmRenderer(model, limit_mm_per_prompt=json.loads(LIMITS)), Qwen2VLRenderer(model)


def _prompt(model: str, modalities: list[str]) -> list[int]:
    ids = tiny_model.special_token_ids(model)
    tokens = [1, 2]
    for modality in modalities:
        tokens += [ids["vision_start"], ids[f"{modality}_pad"], ids["vision_end"]]
    return tokens + [7]


SIDE = st.integers(28, 224)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(images=st.lists(st.tuples(SIDE, SIDE, st.integers(0, 1000)), min_size=1, max_size=3),
       video=st.none() | st.tuples(st.sampled_from([2, 4]), st.integers(28, 112), st.integers(28, 112),
                                   st.integers(0, 1000)))
def test_the_hand_written_renderer_gives_exactly_what_vllms_processor_gives(renderers, model, images, video):
    vllm_renderer, ours = renderers
    pil = [synthetic_image(w, h, seed) for w, h, seed in images]
    frames = synthetic_video(*video) if video else None
    modalities = ["image"] * len(pil) + (["video"] if frames else [])
    media = {"image": pil}
    mine = [ours.image(img) for img in pil]
    if frames:
        media["video"] = [np.stack([np.asarray(f.convert("RGB")) for f in frames])]
        mine.append(ours.video(frames))
    theirs = vllm_renderer.render(_prompt(model, modalities), media)
    expected = ours.prompt("x", mine)  # ours lays the pads out the same way around its own text
    assert len(theirs.features) == len(mine)
    for item, rendered, feature in zip(theirs.features, mine, expected.features):
        assert item.modality == rendered.modality
        assert item.placeholder.length == rendered.num_embeds == feature.placeholder.length
        assert item.kwargs.keys() == rendered.kwargs.keys()
        for key, value in rendered.kwargs.items():
            np.testing.assert_array_equal(item.kwargs[key].numpy(), value, err_msg=key)
            assert item.field(key).kind == rendered.fields[key].kind
            assert item.field(key).keep_on_cpu == rendered.fields[key].keep_on_cpu, key
    # placeholders: each item's pad run, expanded in place of its one pad
    pads = {tiny_model.special_token_ids(model)[f"{m}_pad"] for m in modalities}
    for item in theirs.features:
        span = theirs.token_ids[item.placeholder.offset:item.placeholder.offset + item.placeholder.length]
        assert len(set(span)) == 1 and span[0] in pads


def test_vllms_refusals_are_typed(renderers, model):
    vllm_renderer, _ = renderers
    with pytest.raises(InvalidArgument, match="vLLM's processor"):  # two images, one placeholder
        vllm_renderer.render(_prompt(model, ["image"]), {"image": [synthetic_image(56, 56, 1)] * 2})
    with pytest.raises(InvalidArgument, match="vLLM's processor"):  # more than the limit per prompt
        vllm_renderer.render(_prompt(model, ["video"] * 2), {"video": [np.zeros((2, 56, 56, 3), np.uint8)] * 2})


# Qwen2-VL (``tiny_model``) and every family of ``tiny_families``: modality -> one item's placeholder text
PLACEHOLDERS = {"qwen2_vl": {"image": "<|vision_start|><|image_pad|><|vision_end|>",
                             "video": "<|vision_start|><|video_pad|><|vision_end|>"},
                **{name: family.placeholders for name, family in FAMILIES.items()}}


def _item(modality: str):
    """One item as vLLM takes it: an HxWx3 image, (TxHxWx3 frames, metadata), (waveform, rate)."""
    if modality == "image":
        return np.asarray(synthetic_image(112, 84, 3).convert("RGB"))
    if modality == "video":
        frames = np.stack([np.asarray(f.convert("RGB")) for f in synthetic_video(4, 84, 84, 4)])
        return frames, {"fps": 2.0, "duration": 2.0, "total_num_frames": 4, "frames_indices": [0, 1, 2, 3],
                        "video_backend": "opencv"}
    t = np.arange(16_000) / 16_000
    return np.sin(2 * np.pi * 300 * t).astype(np.float32), 16_000


@pytest.mark.parametrize("family", sorted(PLACEHOLDERS))
def test_a_text_prompt_renders_as_its_token_ids(family, model, tmp_path_factory):
    import torch
    from transformers import AutoTokenizer

    directory = model if family == "qwen2_vl" else str(FAMILIES[family].build(tmp_path_factory.mktemp(family)))
    renderer = VllmRenderer(directory, limit_mm_per_prompt=json.loads(LIMITS))
    placeholders = PLACEHOLDERS[family]
    text = "describe " + " and ".join(placeholders.values()) + " in detail."
    media = {m: [_item(m)] for m in placeholders}
    from_text = renderer.render(text, media)
    # the ids the model's own tokenizer gives, special tokens as a completions request adds them
    from_ids = renderer.render(AutoTokenizer.from_pretrained(directory)(text)["input_ids"], media)
    assert from_text.token_ids == from_ids.token_ids
    assert [f.modality for f in from_text.features] == list(placeholders)
    for a, b in zip(from_text.features, from_ids.features, strict=True):
        assert a.placeholder == b.placeholder
        assert a.kwargs.keys() == b.kwargs.keys()
        for key, value in a.kwargs.items():
            assert torch.equal(value, b.kwargs[key]), key
            assert a.field(key) == b.field(key), key
