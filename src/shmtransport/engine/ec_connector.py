"""``ShmtransportECConnector``: vLLM's encoder cache on the node, through the daemon's identity
index. Loaded by stock vLLM out of tree::

    --ec-transfer-config '{"ec_connector": "ShmtransportECConnector",
                           "ec_connector_module_path": "shmtransport.engine.ec_connector",
                           "ec_role": "ec_producer" | "ec_consumer" | "ec_both",
                           "ec_connector_extra_config": {"socket": "/run/shmtransport/daemon.sock"}}'

What each side does (``docs/vllm.md``, "Encoder disaggregation"):

- **Worker, producer** (``save_caches``): the encoder output is copied once into a loan of the
  arena (on a GPU: one device-to-host copy into it), committed and published under its
  ``mm_hash``; the index holds it from then on, whoever dies. At TP > 1 only rank 0 writes. A save
  that fails (the daemon restarting, no room) is logged and skipped: a consumer encodes the item.
- **Scheduler** (EngineCore): ``has_cache_item`` looks the item up and, on a hit, holds it (an
  acquire in the object table), so nothing evicts it between the scheduler's decision and the
  worker's load; an item found before is held by acquiring its remembered handle, in shared memory
  with no round trip (the daemon hears of such hits once a second, for its LRU order).
  ``update_state_after_alloc`` ties the hold to the request, ``build_connector_meta`` sends the
  workers each item's handle (about 100 bytes, never the bytes, never a pickle of ours) and lets go
  of holds no request took, ``request_finished`` releases the request's.
- **Worker, consumer** (``start_load_caches``): every rank acquires the handle and puts a tensor
  over the arena in vLLM's ``encoder_cache`` (on CPU no copy from 1 MiB on, one below it; on a GPU
  one host-to-device copy). The lease lasts as long as that tensor: vLLM dropping the entry
  releases it.

The identity is scoped: entries are found only by engines of the same model, revision, dtype and
processor options (plus the ``scope`` extra config, for anything else that changes the encoder's
output), so another model's output never answers a look-up. Client ``uuid`` s of any length are
hashed when they do not fit the index (256 bytes), never used as names.

A load that fails in a worker (the daemon restarted under it) puts zeros of the item's shape in the
cache so the step runs, and reports the item; the scheduler then fails the requests that used it
(``take_unavailable_requests``: the client gets vLLM's error and may retry, which encodes again).
"""
from __future__ import annotations

import collections
import dataclasses
import hashlib
import json
import logging
import time
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from vllm.distributed.ec_transfer.ec_connector.base import (
    ECConnectorBase,
    ECConnectorMetadata,
    ECConnectorRole,
    ECConnectorWorkerMetadata,
)
from vllm.distributed.ec_transfer.ec_connector.utils import PlaceholderMetadataResolver, collect_ec_item_metadata

from ..client import Consumer, Handle, Lease, Producer
from ..errors import ShmTransportError
from ..tensors import dtype_from_name, to_torch
from ..wire import default_socket_path

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.multimodal.inputs import MultiModalFeatureSpec
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import ECConnectorOutput
    from vllm.v1.request import Request

_log = logging.getLogger("shmtransport.ec_connector")
MAX_IDENTITY_NBYTES = 256  # the daemon's bound (daemon.index)
REMEMBERED_ITEMS = 65_536  # handles of items found before, per scheduler (about 200 bytes each)
LOCAL_HIT_REPORT_S = 1.0


def identity_of(mm_hash: str) -> bytes:
    """The index identity of an item: its ``mm_hash`` (a client's ``uuid`` when it set one), or a
    digest of it when it is longer than the index takes."""
    raw = mm_hash.encode("utf-8", "surrogatepass")
    return raw if len(raw) <= MAX_IDENTITY_NBYTES else b"sha256:" + hashlib.sha256(raw).hexdigest().encode()


def scope_of(vllm_config: "VllmConfig", salt: str = "") -> str:
    """What an encoder output depends on beside its item: model, revision, dtype, processor
    options and the deployment's ``salt``; a short readable prefix plus a digest of them."""
    model = vllm_config.model_config
    facts = json.dumps([model.model, model.revision, str(model.dtype), model.mm_processor_kwargs or {}, salt],
                       sort_keys=True, default=str)
    name = model.model.rstrip("/").rsplit("/", 1)[-1][:64]
    return f"{name}:{hashlib.sha256(facts.encode()).hexdigest()[:24]}"


@dataclasses.dataclass
class ShmtransportECMetadata(ECConnectorMetadata):  # type: ignore[misc]  # (vLLM has no type stubs)
    """Scheduler → workers, one step: the items to load, each ``(mm_hash, handle wire bytes)``."""

    loads: list[tuple[str, bytes]] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class ShmtransportECWorkerMetadata(ECConnectorWorkerMetadata):  # type: ignore[misc]
    """Workers → scheduler, one step: items a worker could not load."""

    failed: set[str] = dataclasses.field(default_factory=set)

    def aggregate(self, other: ECConnectorWorkerMetadata) -> ECConnectorWorkerMetadata:
        """The union of the ranks' failures."""
        assert isinstance(other, ShmtransportECWorkerMetadata)
        return ShmtransportECWorkerMetadata(self.failed | other.failed)


@dataclasses.dataclass
class _Hold:
    """The scheduler's hold on one published item: a lease, and the requests that use it."""

    lease: Lease
    requests: set[str] = dataclasses.field(default_factory=set)


class ShmtransportECConnector(ECConnectorBase):  # type: ignore[misc]
    """vLLM's EC connector over the shmtransport daemon (see the module's docstring)."""

    def __init__(self, vllm_config: "VllmConfig", role: ECConnectorRole) -> None:
        super().__init__(vllm_config=vllm_config, role=role)
        config = vllm_config.ec_transfer_config
        assert config is not None  # (the base class refused otherwise)
        self._socket = str(config.get_from_extra_config("socket", "") or default_socket_path())
        self._timeout_s = float(config.get_from_extra_config("timeout_s", 10.0))
        self.scope = scope_of(vllm_config, str(config.get_from_extra_config("scope", "")))
        self._producer: Producer | None = None
        self._consumer: Consumer | None = None
        # scheduler side
        self._holds: dict[str, _Hold] = {}
        # Items found in the index before, by identifier: acquiring the remembered handle in the
        # object table (microseconds) holds the very bytes published, with no round trip; a handle
        # that no longer acquires was evicted, and the next look-up asks the daemon again.
        self._found: collections.OrderedDict[str, Handle] = collections.OrderedDict()
        self._used_locally: set[str] = set()  # hits the daemon has not seen yet (its LRU order)
        self._next_report = 0.0
        self._loads: dict[str, bytes] = {}  # this step's, for build_connector_meta
        self._unavailable: set[str] = set()
        self._resolver = PlaceholderMetadataResolver(vllm_config.model_config)
        # worker side
        self._failed: set[str] = set()
        self._device = self._load_device() if role is ECConnectorRole.WORKER else "cpu"
        # Connect now: a daemon that is not there fails the engine's start in one line, not a request.
        if role is ECConnectorRole.SCHEDULER or self.is_consumer:
            self._consumer_client()
        if role is ECConnectorRole.WORKER and self.is_producer and self._writes():
            self._producer_client()

    # -- clients ---------------------------------------------------------------------------------
    def _producer_client(self) -> Producer:
        if self._producer is None:
            self._producer = Producer(self._socket, timeout_s=self._timeout_s)
        return self._producer

    def _consumer_client(self) -> Consumer:
        if self._consumer is None:
            self._consumer = Consumer(self._socket, timeout_s=self._timeout_s)
        return self._consumer

    def shutdown(self) -> None:
        """Release every hold and end the sessions (published outputs stay in the index)."""
        for identifier in list(self._holds):
            self._release_hold(identifier)
        for client in (self._producer, self._consumer):
            if client is not None:
                client.close()
        self._producer = self._consumer = None

    # -- scheduler side --------------------------------------------------------------------------
    def has_cache_item(self, identifier: str) -> bool:
        """Whether the index has the item; a hit is held until a request takes it (or the step ends)."""
        if identifier in self._holds:
            return True
        lease = self._acquire_found(identifier) or self._acquire_looked_up(identifier)
        if lease is None:
            return False
        self._holds[identifier] = _Hold(lease)
        return True

    def _acquire_found(self, identifier: str) -> Lease | None:
        """A hold on the item found before, if its handle still acquires (no round trip)."""
        handle = self._found.get(identifier)
        if handle is None:
            return None
        try:
            lease = self._consumer_client().acquire(handle)
        except ShmTransportError:  # evicted (or the daemon restarted): ask the daemon again
            del self._found[identifier]
            return None
        self._found.move_to_end(identifier)
        self._used_locally.add(identifier)
        return lease

    def _acquire_looked_up(self, identifier: str) -> Lease | None:
        """The daemon's answer for the item (one round trip), held and remembered on a hit."""
        try:
            consumer = self._consumer_client()
            [handle] = consumer.lookup([identity_of(identifier)], scope=self.scope)
            if handle is None:
                return None
            lease = consumer.acquire(handle)
        except ShmTransportError as exc:  # evicted since the look-up (stale), or the daemon is away
            _log.debug("encoder cache miss for %s: %s", identifier, exc)
            return None
        self._found[identifier] = handle
        if len(self._found) > REMEMBERED_ITEMS:
            self._found.popitem(last=False)
        return lease

    def _report_local_hits(self) -> None:
        """Tell the daemon which entries were used here since the last report (at most once a
        second): its eviction goes by use, and these hits cost it no look-up."""
        now = time.monotonic()
        if not self._used_locally or now < self._next_report:
            return
        self._next_report = now + LOCAL_HIT_REPORT_S
        used, self._used_locally = self._used_locally, set()
        try:
            self._consumer_client().lookup([identity_of(i) for i in used], scope=self.scope)
        except ShmTransportError as exc:
            _log.debug("report of %d local hits: %s", len(used), exc)

    def ensure_cache_available(self, request: "Request", num_computed_tokens: int) -> bool:
        """A consumer's item sent without its media (an ``image_embeds`` part with a ``uuid``) can
        only come from the index: when it is not there the request is failed (vLLM would schedule
        an encode of nothing, and its worker would die of it, taking every request along)."""
        if not self.is_consumer:
            return True
        for feature in request.mm_features:
            if self._without_media(feature) and not self.has_cache_item(feature.identifier):
                _log.warning("request %s: the encoder output of %s is not in the cache and its media was not "
                             "sent: failed", request.request_id, feature.identifier)
                self._unavailable.add(request.request_id)
                return False
        return True

    def _without_media(self, feature: "MultiModalFeatureSpec") -> bool:
        """Whether an item carries only the metadata that sizes its placeholder."""
        if feature.data is None:  # (vLLM left it in its processor cache: it has its media)
            return False
        metadata: set[str] = self._resolver.fields_for(feature.modality)
        return set(feature.data.get_data()) <= metadata

    def update_state_after_alloc(self, request: "Request", index: int) -> None:
        """A request was given the item: a held one is loaded in this step and kept for the request."""
        identifier = request.mm_features[index].identifier
        if not self.is_consumer or not self.has_cache_item(identifier):
            return
        hold = self._holds[identifier]
        hold.requests.add(request.request_id)
        self._loads[identifier] = hold.lease.handle.to_bytes()

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> ECConnectorMetadata:
        """This step's loads; holds no request took are let go."""
        meta = ShmtransportECMetadata(list(self._loads.items()))
        self._loads.clear()
        for identifier in [i for i, hold in self._holds.items() if not hold.requests]:
            self._release_hold(identifier)
        self._report_local_hits()
        return meta

    def update_connector_output(self, connector_output: "ECConnectorOutput") -> None:
        """Items a worker failed to load make their requests unavailable."""
        meta = connector_output.ec_connector_worker_meta
        if isinstance(meta, ShmtransportECWorkerMetadata):
            for identifier in meta.failed:
                hold = self._holds.get(identifier)
                if hold is not None:
                    self._unavailable |= hold.requests

    def take_unavailable_requests(self) -> set[str]:
        """Requests whose encoder output could not be loaded (failed by the scheduler, retryable)."""
        taken, self._unavailable = self._unavailable, set()
        return taken

    def request_finished(self, request: "Request") -> tuple[bool, dict[str, Any] | None]:
        """Release the request's holds; a producer reports each item's placeholder metadata (as
        vLLM's connectors do, so a proxy can send the language model metadata instead of media)."""
        for feature in request.mm_features:
            hold = self._holds.get(feature.identifier)
            if hold is not None:
                hold.requests.discard(request.request_id)
                if not hold.requests:
                    self._release_hold(feature.identifier)
        if not self.is_producer:
            return False, None
        return False, collect_ec_item_metadata(request.mm_features, self._resolver) or None

    def _release_hold(self, identifier: str) -> None:
        hold = self._holds.pop(identifier)
        try:
            hold.lease.release()
        except ShmTransportError as exc:  # the daemon restarted: nothing is held any more
            _log.debug("release of the hold on %s: %s", identifier, exc)

    # -- worker side -----------------------------------------------------------------------------
    @staticmethod
    def _load_device() -> str:
        from vllm.platforms import current_platform

        device = str(current_platform.device_type)
        if current_platform.is_cuda_alike():
            device = f"{device}:{current_platform.current_device()}"
        return device

    @staticmethod
    def _writes() -> bool:
        """Whether this rank writes (rank 0 of its tensor-parallel group: one copy per item)."""
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank, model_parallel_is_initialized

        return not model_parallel_is_initialized() or get_tensor_model_parallel_rank() == 0

    def save_caches(self, encoder_cache: dict[str, torch.Tensor], mm_hash: str, **kwargs: Any) -> None:
        """Copy the item's encoder output into the arena once and publish it under its mm_hash."""
        if not self.is_producer or not self._writes():
            return
        output = encoder_cache[mm_hash].detach()
        try:
            producer = self._producer_client()
            loan = producer.loan(shape=tuple(output.shape), dtype=output.dtype)
            try:
                loan.tensor().copy_(output)  # numel * itemsize bytes of the view, never its whole storage
                producer.publish(loan.commit(), identity_of(mm_hash), scope=self.scope)
            finally:
                loan.release()  # a loan never committed goes back; else the index holds the object now
        except ShmTransportError as exc:  # (the daemon restarting, a full arena): the engine serves on
            _log.warning("encoder output of %s not saved (%s): a consumer encodes it again", mm_hash, exc)

    def start_load_caches(self, encoder_cache: dict[str, torch.Tensor], **kwargs: Any) -> None:
        """Put each item of this step's metadata in ``encoder_cache``: a tensor over the arena."""
        metadata = self._get_connector_metadata()
        assert isinstance(metadata, ShmtransportECMetadata)
        for mm_hash, wire in metadata.loads:
            if mm_hash in encoder_cache:
                continue
            encoder_cache[mm_hash] = self._load(mm_hash, wire)

    def _load(self, mm_hash: str, wire: bytes) -> torch.Tensor:
        try:
            lease = self._consumer_client().acquire_bytes(wire)
            tensor = lease.tensor()
            lease.release()  # deferred by the client while the tensor lives: vLLM dropping it releases
        except ShmTransportError as exc:
            _log.warning("encoder output of %s could not be loaded (%s): its requests fail", mm_hash, exc)
            self._failed.add(mm_hash)
            handle = Handle.from_bytes(wire)
            tensor = to_torch(np.zeros(handle.shape, dtype_from_name(handle.dtype)), handle.dtype)
        return tensor if self._device == "cpu" else tensor.to(self._device, non_blocking=True)

    def build_connector_worker_meta(self) -> ECConnectorWorkerMetadata | None:
        """The items this step failed to load, for the scheduler."""
        if not self._failed:
            return None
        failed, self._failed = self._failed, set()
        return ShmtransportECWorkerMetadata(failed)
