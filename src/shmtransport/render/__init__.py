"""Frontend / renderer side of the end-to-end pipeline.

- ``media``: sample media generated at run time and the real processors (Qwen2-VL image processor,
  Whisper feature extractor; optional extra ``renderer`` = transformers + pillow, imported lazily);
  ``synthetic_features`` gives tensors of the same shapes without them.
- ``prompt``: prompt expansion with structural tokens around the embedding positions (sparse is_embed).
- ``frontend``: ``Frontend`` builds ``GenerateRequest``s (shared-memory handles or inline tensors)
  and sends them to the worker over gRPC, with typed errors.

The core package never imports transformers; only ``media.Renderer`` does.
"""
