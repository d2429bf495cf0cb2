"""Wire protocol for preprocessed multimodal features: pure (no sockets, no daemon, no client).

Modules, one job each:

- ``limits``: every bound the protocol enforces (``Limits``), and the modality / field vocabularies.
- ``msgpack_kwargs``: vLLM's MessagePack encoding of one ``MultiModalKwargsItem`` (decode with a
  structural preflight and limits, encode); never pickle.
- ``envelope``: the Dynamo ``vllm_tito.features`` JSON envelope -> validated ``FeatureItem`` list.
- ``validate``: shared rule checks and ``validate_request`` for a typed ``MultimodalRequest``.
- ``routing``: routing markers (``hash_mm_identifier``) and Dynamo's ``extra_args`` routing metadata.
- ``sampling``, ``folding``, ``kv_routing``: Generate controls, response folding, KV-routing identity.
- ``spec``: what the frontend and the worker agree on (the model's token ids, patch geometry, the
  worker's metadata keys and channel options).
- ``capabilities``: the ``ServerInfo`` we advertise (shm namespace, identity schemes, limits).

Building a request (``frontend.request``) and opening one (``worker.request``) use the client, so
they live one layer up, on their own side.
"""
from .items import FeatureItem, FieldConfig
from .limits import MODALITIES, Limits

__all__ = ["Limits", "MODALITIES", "FeatureItem", "FieldConfig"]
