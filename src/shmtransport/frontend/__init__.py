"""Frontend side of the pipeline: render media into tensors, put them in shared memory, send the
request to the worker.

- ``request``: ``FeatureItem`` list -> typed ``GenerateRequest``, tensors put in shared memory once
  with the identity fused (or inline, by ``InlinePolicy``).
- ``media``: sample media generated at run time and the real processors (Qwen2-VL image processor,
  Whisper feature extractor; optional extra ``renderer`` = transformers + pillow, imported lazily);
  ``synthetic_features`` gives tensors of the same shapes without them.
- ``prompt``: prompt expansion with structural tokens around the embedding positions (sparse is_embed).
- ``client``: ``GeneratorClient`` / ``AsyncGeneratorClient``, the public client of a worker's
  ``Generator`` service (token ids + ``FeatureItem``s in, a stream of tokens out, typed errors).
- ``generate``: ``Frontend`` builds ``GenerateRequest``s (shared-memory handles or inline tensors)
  and sends them to the worker over gRPC, with typed errors.

The core package never imports transformers; only ``media.Renderer`` does.
"""
