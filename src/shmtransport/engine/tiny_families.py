"""Tiny random-weight models of several multimodal families that vLLM serves on a CPU in seconds.

Each family lays its items out differently on the wire, which is what the end-to-end tests are
about (``tiny_model`` holds Qwen2-VL, the suite's main model):

- ``qwen2_5_vl``: Qwen2.5-VL (windowed vision attention); images and video as flat patch rows
  with ``image_grid_thw`` / ``video_grid_thw`` kept on the CPU, ``second_per_grid_ts`` for video.
- ``llava``: LLaVA-1.5 (a CLIP vision tower, a projector and a Llama text model); images as one
  batched ``pixel_values`` tensor per item, a run of ``<image>`` tokens per image.
- ``gemma3``: Gemma 3 (a SigLIP tower with average pooling and a Gemma 3 text model with sliding
  window attention); images as flat ``pixel_values`` (one crop per image) plus ``num_patches`` kept
  on the CPU, placeholders ``<start_of_image>`` ... ``<end_of_image>`` with only the soft tokens embedded.
- ``qwen2_audio``: Qwen2-Audio (a Whisper-style audio encoder and a Qwen2 text model); audio as
  batched log-mel ``input_features`` with their ``feature_attention_mask``.

Sizes are what vLLM's CPU backend accepts: text head_dim 64 (2 query heads, 1 KV head), 2 layers,
towers of 2 layers. Built seeded with no hub access (``tiny_model.train_tokenizer``). Where
transformers saves weights under other names than the hub's checkpoints of the family use, they
are renamed to the hub's (vLLM's loader expects those).
"""
from __future__ import annotations

import dataclasses
import json
import os
import pathlib
from typing import Any, Callable, Sequence

from . import tiny_model

__all__ = ["FAMILIES", "Family"]

IMAGE_MEAN = (0.5, 0.5, 0.5)
IMAGE_STD = (0.5, 0.5, 0.5)
FORMAT = 1  # bump when the files written change, so cached model directories are rebuilt
VOCAB = 512  # >= the trained vocabulary + specials, a multiple of 64
TEXT = dict(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, head_dim=64, max_position_embeddings=4096)


@dataclasses.dataclass(frozen=True)
class Family:
    """How to build one family's tiny model and how its prompts name an item."""

    name: str
    modalities: tuple[str, ...]
    special_tokens: tuple[str, ...]  # the first is the end of a turn (eos), the second padding
    placeholders: dict[str, str]  # modality -> the text vLLM's processor expands for one item
    turn: tuple[str, str]  # what starts and ends a chat turn
    write: Callable[[pathlib.Path, dict[str, int]], Any]  # processor files + config -> the model to save
    named: dict[str, str] = dataclasses.field(default_factory=dict)  # tokenizer attributes its processor reads
    plain: tuple[str, ...] = ()  # ordinary tokens its processor looks up by their text
    # checkpoint key prefixes as the hub's checkpoints of the family name them, where transformers
    # saves them otherwise (vLLM's weight loader expects the hub's)
    renamed: dict[str, str] = dataclasses.field(default_factory=dict)

    def build(self, directory: str | os.PathLike[str], *, seed: int = 0) -> pathlib.Path:
        """Write the model to ``directory`` (created; reused when it already holds this build)."""
        import torch

        directory = pathlib.Path(directory)
        stamp = directory / "shmtransport-tiny-model.json"
        build_id = {"family": self.name, "format": FORMAT, "seed": seed}
        if stamp.exists() and json.loads(stamp.read_text()) == build_id:
            return directory
        directory.mkdir(parents=True, exist_ok=True)
        ids = tiny_model.train_tokenizer(directory, self.special_tokens, eos=self.special_tokens[0],
                                         pad=self.special_tokens[1], named=self.named, plain=self.plain,
                                         chat_template=_chat_template(*self.turn, self.placeholders))
        torch.manual_seed(seed)
        model = self.write(directory, ids)
        model.config.dtype = torch.bfloat16
        model = model.to(torch.bfloat16)
        model.save_pretrained(directory, safe_serialization=True)
        model.generation_config.save_pretrained(directory)
        if self.renamed:
            _rename_weights(directory / "model.safetensors", self.renamed)
        stamp.write_text(json.dumps(build_id))
        return directory

    def prompt_ids(self, directory: str | os.PathLike[str], modalities: Sequence[str]) -> list[int]:
        """Token ids of a short prompt with one placeholder per item of ``modalities``, as vLLM's
        processor takes them (it expands each placeholder)."""
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(directory)
        text = "describe " + " and ".join(self.placeholders[m] for m in modalities) + " in detail."
        return [int(t) for t in tokenizer(text, add_special_tokens=False)["input_ids"]]


def _chat_template(turn_start: str, turn_end: str, placeholders: dict[str, str]) -> str:
    parts = "".join(f"{{% {'if' if i == 0 else 'elif'} part['type'] == '{m}' %}}{{{{ {text!r} }}}}"
                    for i, (m, text) in enumerate(placeholders.items()))
    return (f"{{% for message in messages %}}{{{{ '{turn_start}' + message['role'] + '\\n' }}}}"
            "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
            f"{{% for part in message['content'] %}}{parts}"
            "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
            f"{{{{ '{turn_end}\\n' }}}}{{% endfor %}}"
            f"{{% if add_generation_prompt %}}{{{{ '{turn_start}assistant\\n' }}}}{{% endif %}}")


def _rename_weights(path: pathlib.Path, prefixes: dict[str, str]) -> None:
    from safetensors.torch import load_file, save_file

    def renamed(key: str) -> str:
        return next((new + key[len(old):] for old, new in prefixes.items() if key.startswith(old)), key)

    save_file({renamed(k): v for k, v in load_file(path).items()}, path, metadata={"format": "pt"})


def _json(path: pathlib.Path, value: dict[str, Any]) -> None:
    path.write_text(json.dumps(value, indent=1))


def _qwen2_5_vl(directory: pathlib.Path, ids: dict[str, int]) -> Any:
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    common = {"do_resize": True, "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
              "image_mean": list(tiny_model.IMAGE_MEAN), "image_std": list(tiny_model.IMAGE_STD),
              "do_convert_rgb": True, "patch_size": 14, "temporal_patch_size": 2, "merge_size": 2,
              "min_pixels": 56 * 56, "max_pixels": 448 * 448,
              "size": {"shortest_edge": 56 * 56, "longest_edge": 448 * 448}}
    _json(directory / "preprocessor_config.json",
          {**common, "image_processor_type": "Qwen2VLImageProcessor", "processor_class": "Qwen2_5_VLProcessor"})
    _json(directory / "video_preprocessor_config.json",
          {**common, "video_processor_type": "Qwen2VLVideoProcessor", "processor_class": "Qwen2_5_VLProcessor"})
    _json(directory / "processor_config.json", {"processor_class": "Qwen2_5_VLProcessor"})
    config = Qwen2_5_VLConfig(
        text_config=dict(TEXT, rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0,
                                                "mrope_section": [8, 12, 12]},
                         bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"],
                         pad_token_id=ids["<|endoftext|>"]),
        vision_config=dict(depth=2, hidden_size=64, intermediate_size=128, num_heads=2, out_hidden_size=128,
                           patch_size=14, temporal_patch_size=2, spatial_merge_size=2, window_size=56,
                           fullatt_block_indexes=[1], in_channels=3),
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"], tie_word_embeddings=False)
    return Qwen2_5_VLForConditionalGeneration(config)


def _llava(directory: pathlib.Path, ids: dict[str, int]) -> Any:
    from transformers import LlavaConfig, LlavaForConditionalGeneration

    _json(directory / "preprocessor_config.json", {
        "image_processor_type": "CLIPImageProcessor", "processor_class": "LlavaProcessor",
        "do_resize": True, "size": {"shortest_edge": 112}, "do_center_crop": True,
        "crop_size": {"height": 112, "width": 112}, "do_rescale": True, "rescale_factor": 1 / 255,
        "do_normalize": True, "image_mean": list(IMAGE_MEAN), "image_std": list(IMAGE_STD),
        "do_convert_rgb": True, "resample": 3})
    _json(directory / "processor_config.json", {
        "processor_class": "LlavaProcessor", "patch_size": 14, "vision_feature_select_strategy": "default",
        "image_token": "<image>", "num_additional_image_tokens": 1})
    config = LlavaConfig(
        vision_config=dict(model_type="clip_vision_model", hidden_size=64, intermediate_size=128,
                           num_hidden_layers=2, num_attention_heads=2, image_size=112, patch_size=14,
                           projection_dim=64),
        text_config=dict(TEXT, model_type="llama", bos_token_id=ids["<s>"], eos_token_id=ids["</s>"],
                         pad_token_id=ids["<pad>"]),
        image_token_index=ids["<image>"], vision_feature_select_strategy="default", vision_feature_layer=-2,
        projector_hidden_act="gelu", image_seq_length=64, tie_word_embeddings=False)
    return LlavaForConditionalGeneration(config)


GEMMA3_TOKENS_PER_IMAGE = 16


def _gemma3(directory: pathlib.Path, ids: dict[str, int]) -> Any:
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    _json(directory / "preprocessor_config.json", {
        "image_processor_type": "Gemma3ImageProcessor", "processor_class": "Gemma3Processor",
        "do_resize": True, "size": {"height": 112, "width": 112}, "do_rescale": True, "rescale_factor": 1 / 255,
        "do_normalize": True, "image_mean": list(IMAGE_MEAN), "image_std": list(IMAGE_STD),
        "do_convert_rgb": True, "resample": 2, "do_pan_and_scan": False})
    _json(directory / "processor_config.json", {"processor_class": "Gemma3Processor",
                                                "image_seq_length": GEMMA3_TOKENS_PER_IMAGE})
    config = Gemma3Config(
        text_config=dict(TEXT, sliding_window=256, query_pre_attn_scalar=64,
                         bos_token_id=ids["<bos>"], eos_token_id=ids["<end_of_turn>"], pad_token_id=ids["<pad>"]),
        vision_config=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                           image_size=112, patch_size=14),
        mm_tokens_per_image=GEMMA3_TOKENS_PER_IMAGE, boi_token_index=ids["<start_of_image>"],
        eoi_token_index=ids["<end_of_image>"], image_token_index=ids["<image_soft_token>"],
        bos_token_id=ids["<bos>"], eos_token_id=ids["<end_of_turn>"], pad_token_id=ids["<pad>"],
        tie_word_embeddings=True)
    return Gemma3ForConditionalGeneration(config)


def _qwen2_audio(directory: pathlib.Path, ids: dict[str, int]) -> Any:
    from transformers import Qwen2AudioConfig, Qwen2AudioForConditionalGeneration

    _json(directory / "preprocessor_config.json", {
        "feature_extractor_type": "WhisperFeatureExtractor", "processor_class": "Qwen2AudioProcessor",
        "feature_size": 128, "sampling_rate": 16000, "hop_length": 160, "chunk_length": 30, "n_fft": 400,
        "padding_value": 0.0, "return_attention_mask": True})
    _json(directory / "processor_config.json", {"processor_class": "Qwen2AudioProcessor"})
    config = Qwen2AudioConfig(
        audio_config=dict(model_type="qwen2_audio_encoder", d_model=64, encoder_layers=2, encoder_attention_heads=2,
                          encoder_ffn_dim=128, num_mel_bins=128, max_source_positions=1500),
        text_config=dict(TEXT, model_type="qwen2", bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"],
                         pad_token_id=ids["<|endoftext|>"]),
        audio_token_index=ids["<|AUDIO|>"], tie_word_embeddings=False)
    return Qwen2AudioForConditionalGeneration(config)


FAMILIES = {f.name: f for f in (
    Family("qwen2_5_vl", ("image", "video"),
           ("<|im_end|>", "<|endoftext|>", "<|im_start|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>",
            "<|video_pad|>"),
           {"image": "<|vision_start|><|image_pad|><|vision_end|>",
            "video": "<|vision_start|><|video_pad|><|vision_end|>"}, ("<|im_start|>", "<|im_end|>"), _qwen2_5_vl),
    Family("llava", ("image",), ("</s>", "<pad>", "<s>", "<image>"), {"image": "<image>"}, ("<s>", "</s>"), _llava,
           renamed={"vision_tower.": "vision_tower.vision_model."}),
    Family("gemma3", ("image",),
           ("<end_of_turn>", "<pad>", "<bos>", "<start_of_turn>", "<start_of_image>", "<end_of_image>",
            "<image_soft_token>"),
           {"image": "<start_of_image>"}, ("<start_of_turn>", "<end_of_turn>"), _gemma3,
           {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"},
           plain=("\n", "\n\n", "\n\n\n", "\n\n\n\n"), renamed={"vision_tower.": "vision_tower.vision_model."}),
    Family("qwen2_audio", ("audio",),
           ("<|im_end|>", "<|endoftext|>", "<|im_start|>", "<|audio_bos|>", "<|AUDIO|>", "<|audio_eos|>"),
           {"audio": "<|audio_bos|><|AUDIO|><|audio_eos|>"}, ("<|im_start|>", "<|im_end|>"), _qwen2_audio,
           renamed={"language_model.model.model.": "language_model.model."}),
)}
