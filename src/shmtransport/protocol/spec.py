"""What the frontend and the worker agree on, without torch: the model's token ids and patch
geometry, the gRPC options and the trailing-metadata keys of the worker server."""
from __future__ import annotations

VOCAB = 1024
D_MODEL = 64
PATCH_DIM = 3 * 2 * 14 * 14  # channels * temporal_patch_size * patch_size**2 (Qwen2-VL)
MERGE = 2  # spatial merge size: 2x2 patches -> one embedding
N_MELS = 80  # WhisperFeatureExtractor's default feature_size
AUDIO_FRAMES_PER_TOKEN = 8

# token ids (a tiny tokenizer: text ids are 3 .. 999)
BOS, EOS = 1, 2
VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD = 1001, 1002, 1003, 1004
AUDIO_START, AUDIO_END, AUDIO_PAD = 1005, 1006, 1007
FRAME_SEP = 1008  # one per temporal patch group of a video (Qwen3-VL's timestamp tokens play this role)
TEXT_IDS = range(3, 1000)

KNOWN_ADAPTERS = ("sql-lora", "chat-lora")

TIMING_KEY = "x-shmt-timing"
INGEST_KEY = "x-shmt-ingest"  # which of the worker's ingests opens the request (worker/server.py)


def grpc_options(max_message: int) -> list[tuple[str, int]]:
    """Channel and server options: messages up to ``max_message`` bytes both ways, no port sharing."""
    return [("grpc.max_receive_message_length", max_message), ("grpc.max_send_message_length", max_message),
            ("grpc.so_reuseport", 0)]
