"""A tiny random-weight Qwen2-VL that vLLM serves on a CPU in seconds (images and video).

Built at run time, seeded, with no hub access: a transformers config + ``save_pretrained``, a
byte-level BPE tokenizer trained with ``tokenizers`` on a built-in corpus and carrying Qwen2-VL's
special tokens, Qwen2-VL's chat template, and image/video processor configs.

Sizes that vLLM's CPU backend accepts: text hidden 128 with 2 query heads and 1 KV head (head_dim
64; the CPU attention refuses 16), ``mrope_section`` [8, 12, 12] (sums to head_dim / 2); vision
embed 64, depth 2, patch 14, temporal patch 2, merge 2. About 650k parameters, ~1.3 MB in bf16.

Other families (Qwen2.5-VL, LLaVA, Gemma 3, Qwen2-Audio) are in ``tiny_families``.
"""
from __future__ import annotations

import json
import os
import pathlib
from typing import Mapping, Sequence

from ..errors import InternalError

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                  "<|image_pad|>", "<|video_pad|>")
PATCH, TEMPORAL_PATCH, MERGE = 14, 2, 2
# max_pixels admits one 64 MiB-class float32 image (1792 x 1344: 12,288 patches, 3,072 tokens);
# vLLM profiles that largest input at start in under a second on this model
MIN_PIXELS, MAX_PIXELS = 56 * 56, 1792 * 1344
# Pixels travel raw (0..255): vLLM 0.32 normalises Qwen2-VL pixels itself on the device.
IMAGE_MEAN = (0.48145466, 0.4578275, 0.40821073)
IMAGE_STD = (0.26862954, 0.26130258, 0.27577711)
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{% elif part['type'] == 'video' %}{{ '<|vision_start|><|video_pad|><|vision_end|>' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
    "{{ '<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
_CORPUS = (
    "describe this image in detail. what is shown in the video? the quick brown fox jumps over the "
    "lazy dog. a red circle, a blue square and a white line on a gradient. count the frames. "
    "shared memory moves tensors between processes without copying them. the worker decodes tokens. "
) * 8
FORMAT = 2  # bump when the files written below change, so cached model directories are rebuilt


def train_tokenizer(directory: pathlib.Path, special_tokens: Sequence[str], *, eos: str, pad: str, chat_template: str,
                    named: Mapping[str, str] | None = None, plain: Sequence[str] = ()) -> dict[str, int]:
    """A byte-level BPE tokenizer trained on the built-in corpus, with ``special_tokens``, saved to
    ``directory``; ``named``: attributes a processor reads from its tokenizer (e.g. ``boi_token``);
    ``plain``: ordinary tokens that must be in the vocabulary as they are written (a processor that
    looks up ``"\\n"`` by its text, where byte-level BPE would spell it ``"Ċ"``). Returns each
    special token's id."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=list(special_tokens),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([_CORPUS], trainer)
    tok.add_tokens([AddedToken(t, normalized=False) for t in plain])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos, pad_token=pad,
                                   additional_special_tokens=[t for t in special_tokens if t != pad],
                                   extra_special_tokens=dict(named or {}))
    fast.chat_template = chat_template
    fast.save_pretrained(directory)
    ids: dict[str, int] = {}
    for t in special_tokens:
        token_id = tok.token_to_id(t)
        if token_id is None:  # trained as special tokens: always in the vocabulary
            raise InternalError(f"the trained tokenizer has no id for {t!r}")
        ids[t] = token_id
    return ids


def _processor_configs(directory: pathlib.Path) -> None:
    common = {
        "do_resize": True, "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
        "image_mean": list(IMAGE_MEAN), "image_std": list(IMAGE_STD), "do_convert_rgb": True,
        "patch_size": PATCH, "temporal_patch_size": TEMPORAL_PATCH, "merge_size": MERGE,
        "min_pixels": MIN_PIXELS, "max_pixels": MAX_PIXELS,
        "size": {"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS},
    }
    (directory / "preprocessor_config.json").write_text(json.dumps(
        {**common, "image_processor_type": "Qwen2VLImageProcessor", "processor_class": "Qwen2VLProcessor"}, indent=1))
    (directory / "video_preprocessor_config.json").write_text(json.dumps(
        {**common, "video_processor_type": "Qwen2VLVideoProcessor", "processor_class": "Qwen2VLProcessor"}, indent=1))
    (directory / "processor_config.json").write_text(json.dumps({"processor_class": "Qwen2VLProcessor"}))


def build(directory: str | os.PathLike[str], *, seed: int = 0) -> pathlib.Path:
    """Write the model to ``directory`` (created; reused when it already holds this build)."""
    import torch
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    directory = pathlib.Path(directory)
    stamp = directory / "shmtransport-tiny-model.json"
    build_id = {"format": FORMAT, "seed": seed}
    if stamp.exists() and json.loads(stamp.read_text()) == build_id:
        return directory
    directory.mkdir(parents=True, exist_ok=True)
    ids = train_tokenizer(directory, SPECIAL_TOKENS, eos="<|im_end|>", pad="<|endoftext|>",
                          chat_template=CHAT_TEMPLATE)
    _processor_configs(directory)
    vocab = 512  # >= the trained vocabulary + specials, a multiple of 64
    config = Qwen2VLConfig(
        text_config=dict(
            vocab_size=vocab, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=4096,
            rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0, "mrope_section": [8, 12, 12]},
            bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"],
        ),
        vision_config=dict(depth=2, embed_dim=64, hidden_size=128, num_heads=2, mlp_ratio=2, patch_size=PATCH,
                           temporal_patch_size=TEMPORAL_PATCH, spatial_merge_size=MERGE, in_channels=3),
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"], tie_word_embeddings=False,
    )
    config.dtype = torch.bfloat16
    torch.manual_seed(seed)
    model = Qwen2VLForConditionalGeneration(config).to(torch.bfloat16)
    model.save_pretrained(directory, safe_serialization=True)
    model.generation_config.save_pretrained(directory)
    stamp.write_text(json.dumps(build_id))
    return directory


def special_token_ids(directory: str | os.PathLike[str]) -> dict[str, int]:
    """The ids of Qwen2-VL's special tokens in a built model's tokenizer."""
    config = json.loads((pathlib.Path(directory) / "config.json").read_text())
    return {"image_pad": config["image_token_id"], "video_pad": config["video_token_id"],
            "vision_start": config["vision_start_token_id"], "vision_end": config["vision_end_token_id"],
            "eos": config["text_config"]["eos_token_id"] if "text_config" in config else config["eos_token_id"]}
