"""Wire protocol for preprocessed multimodal features (issue 4).

Modules, one job each:

- ``limits``: every bound the protocol enforces (``Limits``), and the modality / field vocabularies.
- ``msgpack_kwargs``: vLLM's MessagePack encoding of one ``MultiModalKwargsItem`` (decode with a
  structural preflight and limits, encode); never pickle.
- ``envelope``: the Dynamo ``vllm_tito.features`` JSON envelope -> validated ``FeatureItem`` list.
- ``validate``: shared rule checks and ``validate_request`` for a typed ``MultimodalRequest``.
- ``routing``: routing markers (``hash_mm_identifier``) and Dynamo's ``extra_args`` routing metadata.
- ``frontend``: ``FeatureItem`` list -> typed request, tensors put in shared memory once with the
  identity fused.
- ``worker``: typed request -> engine-ready inputs (zero-copy torch views), identity verification.
"""
from .items import FeatureItem, FieldConfig
from .limits import MODALITIES, Limits

__all__ = ["Limits", "MODALITIES", "FeatureItem", "FieldConfig"]
