"""Render requests with vLLM's own multimodal processing, for any model vLLM serves.

``VllmRenderer`` runs what vLLM's API process runs for a prompt with images, video or audio (its
``InputProcessor`` and the model's registered multimodal processor, the way Dynamo's Python
frontend uses them): the placeholders are expanded, and every item gets exactly the fields, field
layouts (flat slices, ``keep_on_cpu``) and tensors vLLM itself would hand the engine. Each item
becomes a ``FeatureItem`` that ``GeneratorClient`` (or ``build_request``) puts into shared memory
with one copy per tensor, its identity's digest fused in.

vLLM's processor allocates its outputs itself, so they cannot be written into loans directly: the
copy into shared memory is the one host copy of each tensor. Item identities are ours (computed
over the tensors, verified by the worker); vLLM's own ``mm_hash`` (over the source media) is not
carried, since nobody downstream could check it against the bytes.

vLLM is imported when a renderer is built; it needs the model directory (configs, tokenizer,
processor configs), never its weights.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Sequence

from ..embedmask import EmbedMask, PlaceholderRange
from ..errors import InvalidArgument
from ..protocol.items import FeatureItem, FieldConfig

__all__ = ["RenderedRequest", "VllmRenderer"]


@dataclasses.dataclass
class RenderedRequest:
    """A prompt as vLLM's processor rendered it: the token ids with every placeholder expanded, and
    one ``FeatureItem`` per image, video or audio clip in prompt order (a ``RenderedPrompt``)."""

    token_ids: list[int]
    features: list[FeatureItem]


class VllmRenderer:
    """vLLM's multimodal processing of one model, in this process (no engine, no weights)."""

    def __init__(self, model: str, *, mm_processor_kwargs: Mapping[str, Any] | None = None,
                 **model_config: Any) -> None:
        """``model``: a model directory or id as ``vllm serve`` takes it; ``model_config``: further
        ``vllm.config.ModelConfig`` arguments (e.g. ``trust_remote_code=True``), which should match
        the engine's so that both process media alike."""
        from vllm.config import CacheConfig, LoadConfig, ModelConfig, VllmConfig
        from vllm.v1.engine.input_processor import InputProcessor

        # No processor cache: a cached item would come back without its data (vLLM then expects
        # the engine's own cache to hold it), and every item must carry its tensors here.
        config = ModelConfig(model=model, mm_processor_cache_gb=0, mm_processor_kwargs=dict(mm_processor_kwargs or {}),
                             **model_config)
        if not config.is_multimodal_model:
            raise InvalidArgument(f"{model} is not a multimodal model")
        self._processor = InputProcessor(VllmConfig(model_config=config, load_config=LoadConfig(load_format="dummy"),
                                                    cache_config=CacheConfig()))

    @property
    def tokenizer(self) -> Any:
        """The model's tokenizer, as vLLM loaded it."""
        return self._processor.get_tokenizer()

    def render(self, prompt: str | Sequence[int], media: Mapping[str, Sequence[Any]]) -> RenderedRequest:
        """``prompt``: text or token ids holding one placeholder per item (for Qwen2-VL,
        ``<|vision_start|><|image_pad|><|vision_end|>``), as vLLM's own API takes them; ``media``:
        modality -> items in prompt order as vLLM takes them: PIL images or HxWx3 arrays; videos
        as TxHxWx3 arrays, or ``(frames, metadata)`` for models that time their frames (Qwen2.5-VL:
        ``fps``, ``duration``, ``total_num_frames``, ``frames_indices``); audio as ``(waveform,
        sample_rate)``. InvalidArgument when vLLM's processor refuses them."""
        from vllm import SamplingParams
        from vllm.exceptions import VLLMClientError

        request: dict[str, Any] = {"multi_modal_data": {k: list(v) for k, v in media.items()}}
        if isinstance(prompt, str):
            request["prompt"] = prompt
        else:
            request["prompt_token_ids"] = [int(t) for t in prompt]
        try:
            # vLLM's completions path: a text prompt is tokenized as its server would (the model's
            # defaults, e.g. special tokens), token ids are length-checked, then media processed
            (engine_input,) = self._processor.renderer.render_cmpl([request])
            rendered = self._processor.process_inputs("render", engine_input, SamplingParams(max_tokens=1),
                                                      ("generate",))
        # vLLM checks a request with exceptions of its own, ValueErrors and (placeholders that do
        # not match the items) assertions: all of them are this request's fault.
        except (VLLMClientError, ValueError, TypeError, AssertionError) as exc:
            raise InvalidArgument(f"vLLM's processor refused the request: {exc}") from exc
        return RenderedRequest([int(t) for t in rendered.prompt_token_ids],
                               [_feature(f) for f in rendered.mm_features or ()])


def _feature(spec: Any) -> FeatureItem:
    """One of vLLM's ``MultiModalFeatureSpec`` as our item: its tensors (CPU torch tensors, taken
    as they are), each field's layout, and its placeholder."""
    position = spec.mm_position
    is_embed = None if position.is_embed is None else EmbedMask.from_bools(position.is_embed.numpy())
    return FeatureItem(
        spec.modality,
        {key: elem.data for key, elem in spec.data.items()},
        PlaceholderRange(int(position.offset), int(position.length), is_embed),
        fields={key: _field(elem.field) for key, elem in spec.data.items()},
    )


def _plain(s: slice) -> slice:
    """A slice with int bounds (vLLM's processors may leave 0-d tensors in them)."""
    return slice(*(None if v is None else int(v) for v in (s.start, s.stop, s.step)))


def _field(field: Any) -> FieldConfig:
    """vLLM's ``MultiModalFieldConfig`` field class as our ``FieldConfig``."""
    kind = type(field).__name__
    if kind == "MultiModalFlatField":
        slices = tuple(tuple(map(_plain, entry)) if isinstance(entry, (tuple, list)) else _plain(entry)
                       for entry in field.slices)
        return FieldConfig("flat", field.keep_on_cpu, slices, int(field.dim))
    if kind == "MultiModalSharedField":
        return FieldConfig("shared", field.keep_on_cpu, batch_size=int(field.batch_size))
    if kind == "MultiModalBatchedField":
        return FieldConfig("batched", field.keep_on_cpu)
    raise InvalidArgument(f"vLLM field {kind} has no layout on our wire (batched, flat and shared do)")
