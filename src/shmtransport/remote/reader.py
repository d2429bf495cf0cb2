"""The remote side: pull tensors named by ``RemoteTensorHandle``s with one-sided NIXL READs.

``RemoteReader`` owns a NIXL agent (UCX) and a receive pool registered once (``pool_slots`` ×
``slot_nbytes``); a tensor larger than a slot gets a buffer registered for it alone (and
deregistered when released). Per batch and owning daemon: one ``RemoteAcquire`` RPC (leases +
regions), one NIXL READ request with every descriptor, one ``RemoteRelease``. The leases are
released only after the READ completed, and on every failure path; the content digest is verified
after the read (``IdentityMismatch``). If this process dies mid-read, the daemon reclaims its leases
when the Attach stream drops. ``secret`` / ``tls`` authenticate the reader to the daemons
(``remote_extension(secret=, tls=)``); a daemon that refuses them gives PermissionDenied (secret) or
Unavailable (TLS handshake).
"""
from __future__ import annotations

import collections
import logging
import mmap
import os
import secrets
import threading
import time
import warnings
from types import TracebackType
from typing import TYPE_CHECKING, Any, Sequence

import grpc
import numpy as np
import numpy.typing as npt

from .._backend import kernels
from ..client.views import View
from ..errors import (
    ClosedError,
    DeadlineExceeded,
    IdentityMismatch,
    InvalidArgument,
    PermissionDenied,
    Reason,
    ShmTransportError,
    Unavailable,
    error_from_rpc,
)
from ..handle import Handle
from ..v1 import daemon_pb2 as pb
from ..v1 import features_pb2 as fpb
from ..v1 import remote_pb2 as rpb
from ..v1 import remote_pb2_grpc as rpb_grpc
from . import descriptor as _desc
from ._nixl import new_agent
from .auth import SECRET_METADATA_KEY, RemoteTLS, check_secret
from .daemon_ext import REMOTE_SESSION_METADATA_KEY

if TYPE_CHECKING:
    from google.protobuf.message import Message

_log = logging.getLogger("shmtransport.remote")

CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", 64 << 20),
    ("grpc.max_send_message_length", 64 << 20),
]


def _rpc_error(err: grpc.RpcError) -> ShmTransportError:
    if err.code() == grpc.StatusCode.UNAUTHENTICATED:  # only the remote tier sends it: no row in the errors table
        return PermissionDenied(f"remote daemon refused our credentials: {err.details()}")
    return error_from_rpc(err)


def _page_buffer(nbytes: int) -> tuple[mmap.mmap, npt.NDArray[np.uint8]]:
    """Anonymous, page-aligned, pre-faulted memory (never a fresh /dev/shm segment)."""
    mm = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0))
    return mm, np.frombuffer(mm, dtype=np.uint8)


class RemoteBuffer(View):
    """A tensor read from a remote daemon into this process's memory, viewed as a consumer's
    ``Lease`` is (``array``, ``tensor()``, ``verify``, ``closed``); ``release`` gives the receive
    memory back once no view of it is alive. ``handle`` is the source's."""

    _client: "RemoteReader"

    def __init__(self, reader: "RemoteReader", tensor: pb.TensorHandle, memory: memoryview,
                 slot: int | None, large: "_LargeBuffer | None" = None) -> None:
        """``memory``: where the bytes land, ``tensor.shm.nbytes`` of them: a slot of the reader's
        pool (``slot``), or a registered buffer of its own (``large``). A memoryview of the mmap
        itself, not of an array over it: numpy would make the callers' views point past ours."""
        super().__init__(reader, Handle.from_proto(tensor), memory)
        self._addr = int(np.frombuffer(memory, dtype=np.uint8).ctypes.data)
        self._tensor_nbytes = _desc.tensor_nbytes(tensor)
        self._slot = slot
        self._large = large

    @property
    def nbytes(self) -> int:
        """Bytes of the source object."""
        return self.handle.nbytes

    @property
    def pooled(self) -> bool:
        """Whether the bytes are in one of the reader's pooled slots (given back at ``release``)."""
        return self._slot is not None

    @property
    def addr(self) -> int:
        """Address of the received bytes in this process; valid until ``release``."""
        self._live_memory()
        return self._addr

    def verify(self) -> None:
        """Check the received bytes against the handle's digest; IdentityMismatch if they differ."""
        if self._released:
            raise ClosedError(f"{self!r} is released", Reason.VIEW_RELEASED)
        if not self.handle.digest:
            raise InvalidArgument("remote handle carries no digest: the producer did not hash")
        if kernels.tree_digest(self._live_memory()[: self._tensor_nbytes]) != self.handle.digest:
            raise IdentityMismatch(f"content digest mismatch after the remote read of {self!r}")

    def release(self) -> None:
        """Give the receive memory back; while the caller still holds a view of it (``array``,
        ``tensor()`` or anything derived), it is not reused: it returns once they are gone."""
        if not self._released:
            self._client._release_views([self])

    def __repr__(self) -> str:
        where = f"slot {self._slot}" if self._slot is not None else "dynamic"
        state = "released" if self._released else "live"
        return (f"RemoteBuffer({self.handle.dtype}{list(self.handle.shape)}, nbytes={self.nbytes}, {where}, "
                f"{state})")


class _LargeBuffer:
    """Receive memory above the pool's slot size: registered for itself, kept for reuse while the
    reader's ``large_cache_nbytes`` allows (so a steady stream of big tensors registers once)."""

    def __init__(self, agent: Any, nbytes: int) -> None:
        """``agent``: the reader's NIXL agent."""
        self.capacity = -(-nbytes // (1 << 20)) * (1 << 20)  # whole MiB: near sizes share buffers
        self.mm, memory = _page_buffer(self.capacity)
        self.memory: npt.NDArray[np.uint8] | None = memory  # None once freed
        try:
            self.reg: Any = agent.register_memory([(int(memory.ctypes.data), self.capacity, 0, "")], "DRAM")
        except Exception as exc:
            self.mm.close()
            raise Unavailable(f"NIXL register_memory of a {nbytes}-byte receive buffer failed: {exc}") from exc

    def free(self, agent: Any) -> None:
        if self.reg is not None and agent is not None:
            try:
                agent.deregister_memory(self.reg)
            except Exception:
                _log.exception("NIXL deregister_memory failed")
        self.reg = None
        self.memory = None
        try:
            self.mm.close()
        except BufferError:
            pass  # a caller still holds an array of it; the GC unmaps it later


class _Peer:
    """One remote daemon: gRPC channel (TCP), the Attach stream (our session), its NIXL agent."""

    def __init__(self, reader: "RemoteReader", endpoint: str) -> None:
        self.endpoint = endpoint
        if reader._tls is not None:
            self._channel = grpc.secure_channel(endpoint, reader._tls.channel_credentials(),
                                                options=CHANNEL_OPTIONS + reader._tls.channel_options())
        else:
            self._channel = grpc.insecure_channel(endpoint, options=CHANNEL_OPTIONS)
        self.stub = rpb_grpc.RemoteStub(self._channel)
        self._call: Any = None  # the Attach stream (a grpc call iterator, also a Future)
        self.remote_name: str | None = None
        self._agent = reader.agent
        auth = ((SECRET_METADATA_KEY, reader._secret),) if reader._secret is not None else ()
        try:
            self._call = self.stub.Attach(rpb.AttachRequest(peer_name=reader.name), metadata=auth)
            event = next(self._call)
        except grpc.RpcError as err:
            self.close()
            if err.code() == grpc.StatusCode.UNAUTHENTICATED:
                raise PermissionDenied(f"remote daemon at {endpoint} refused our credentials: "
                                       f"{err.details()}") from None
            raise Unavailable(f"cannot attach to remote daemon at {endpoint}: {err.details() or err.code()}") from err
        except StopIteration as exc:
            self.close()
            raise Unavailable(f"remote daemon at {endpoint} ended the Attach stream") from exc
        self.agent_name = event.agent_name
        self.instance_id = event.instance_id
        self._metadata = ((REMOTE_SESSION_METADATA_KEY, event.session_token),) + auth
        try:
            name = self._agent.add_remote_agent(event.agent_metadata)
        except Exception as exc:
            self.close()
            raise Unavailable(f"NIXL add_remote_agent for {endpoint} failed: {exc}") from exc
        self.remote_name = name.decode() if isinstance(name, bytes) else name

    @property
    def alive(self) -> bool:
        return self._call is not None and not self._call.done()

    def rpc(self, method: str, request: Message, timeout_s: float) -> Any:
        try:
            return getattr(self.stub, method)(request, timeout=timeout_s, metadata=self._metadata)
        except grpc.RpcError as err:
            raise _rpc_error(err) from None

    def release_future(self, request: rpb.RemoteReleaseRequest, timeout_s: float
                       ) -> grpc.Future[rpb.RemoteReleaseResponse]:
        future: grpc.Future[rpb.RemoteReleaseResponse] = self.stub.RemoteRelease.future(
            request, timeout=timeout_s, metadata=self._metadata)
        return future

    def close(self) -> None:
        if self._call is not None:
            self._call.cancel()  # the daemon closes our session: every lease we held is reclaimed
            self._call = None
        if self.remote_name is not None:
            try:
                self._agent.remove_remote_agent(self.remote_name)
            except Exception:
                _log.debug("remove_remote_agent(%s) failed", self.remote_name, exc_info=True)
            self.remote_name = None
        self._channel.close()


def _log_release_failure(future: grpc.Future[rpb.RemoteReleaseResponse]) -> None:
    exc = future.exception()
    if exc is None:
        return
    err = _rpc_error(exc) if isinstance(exc, grpc.RpcError) else exc
    if isinstance(err, Unavailable):
        return  # the daemon is gone, and with it our session and its leases
    _log.warning("remote lease release failed: %s", err)


class RemoteReader:
    """Reads remote tensors with NIXL; one per process (it owns a NIXL agent and a receive pool).

    ``pool_slots`` × ``slot_nbytes`` are registered once at construction; larger tensors (or a full
    pool) get a buffer registered for that read only. ``verify``: check the content digest after
    each read (default: whenever the handle carries one). ``secret``: the shared secret of the
    daemons (``remote_extension(secret=)``), sent on every call; ``tls``: a ``RemoteTLS`` with this
    reader's client certificate and key and the CA of the daemons' certificates. Both apply to every
    daemon this reader dials.
    """

    def __init__(self, name: str | None = None, pool_slots: int = 16, slot_nbytes: int = 8 << 20,
                 timeout_s: float = 30.0, verify: bool = True, large_cache_nbytes: int = 512 << 20,
                 *, secret: str | None = None, tls: RemoteTLS | None = None) -> None:
        if tls is not None and not isinstance(tls, RemoteTLS):
            raise InvalidArgument("tls must be a shmtransport.remote.RemoteTLS")
        self._secret = check_secret(secret)
        self._tls = tls
        self.name = name or f"shmt-reader-{os.getpid()}-{secrets.token_hex(4)}"
        self.timeout_s = timeout_s
        self.verify = verify
        self.slot_nbytes = slot_nbytes
        self._lock = threading.Lock()
        self._peers: dict[str, _Peer] = {}
        self._closed = False
        self.agent: Any = new_agent(self.name)  # None once closed
        self._pool_mm, self._pool = _page_buffer(pool_slots * slot_nbytes)
        self._pool_reg: Any = None
        if pool_slots:
            self._pool_reg = self.agent.register_memory([(int(self._pool.ctypes.data), self._pool.nbytes, 0, "")],
                                                        "DRAM")
        self._free_slots = list(range(pool_slots))[::-1]
        self.large_cache_nbytes = large_cache_nbytes
        self._large_cache: list[_LargeBuffer] = []  # released, still registered, oldest first
        self._deferred: list[RemoteBuffer] = []  # released while the caller still held views
        self._collected: collections.deque[View] = collections.deque()  # dropped unreleased
        self._pending: list[grpc.Future[rpb.RemoteReleaseResponse]] = []  # lease releases in flight
        self.stats = {"reads": 0, "pooled": 0, "dynamic": 0, "registrations": 0, "bytes": 0}

    @property
    def closed(self) -> bool:
        """Whether ``close()`` has run."""
        return self._closed

    # -- destinations ----------------------------------------------------------------------------
    def _collected_unreleased(self, view: View) -> None:
        """A buffer dropped unreleased (``View.__del__``): released by the next read or the close,
        never in the finalizer (it may run inside the reader's lock)."""
        self._collected.append(view)

    def _release_views(self, views: Sequence[View]) -> None:
        """``RemoteBuffer.release``: their memory goes back, or waits for the caller's last view."""
        for view in views:
            assert isinstance(view, RemoteBuffer)  # the only views a reader hands out
            view._detach_views()
            self._give_back(view)

    def _sweep_deferred(self, force: bool = False) -> None:
        while self._collected:
            self._collected.popleft().release()
        with self._lock:
            deferred, self._deferred = self._deferred, []
        for buf in deferred:
            if force and buf._views_alive():
                warnings.warn(f"closing the reader while a view of {buf!r} is still alive", ResourceWarning, 2)
            self._give_back(buf, force=force)

    def _destination(self, tensor: pb.TensorHandle) -> RemoteBuffer:
        if self._deferred or self._collected:
            self._sweep_deferred()
        nbytes = int(tensor.shm.nbytes)
        if nbytes <= self.slot_nbytes:
            with self._lock:
                slot = self._free_slots.pop() if self._free_slots else None
            if slot is not None:
                start = slot * self.slot_nbytes
                self.stats["pooled"] += 1
                return RemoteBuffer(self, tensor, memoryview(self._pool_mm)[start : start + nbytes], slot)
        large = None
        with self._lock:
            fits = [b for b in self._large_cache if nbytes <= b.capacity <= 2 * max(nbytes, self.slot_nbytes)]
            if fits:
                large = min(fits, key=lambda b: b.capacity)
                self._large_cache.remove(large)
        if large is None:
            large = _LargeBuffer(self.agent, nbytes)
            self.stats["registrations"] += 1
        self.stats["dynamic"] += 1
        if large.memory is None:  # only buffers not freed are cached
            raise ShmTransportError("internal: a freed receive buffer was reused")
        return RemoteBuffer(self, tensor, memoryview(large.mm)[:nbytes], None, large)

    def _give_back(self, buf: RemoteBuffer, force: bool = False) -> None:
        if buf._views_alive() and not force:
            with self._lock:
                self._deferred.append(buf)
            return
        buf._forget_memory()
        if buf._slot is not None:
            with self._lock:
                self._free_slots.append(buf._slot)
            return
        large, buf._large = buf._large, None
        if large is None:
            return
        evicted: list[_LargeBuffer] = []
        with self._lock:
            if not self._closed and large.capacity <= self.large_cache_nbytes:
                self._large_cache.append(large)
                while sum(b.capacity for b in self._large_cache) > self.large_cache_nbytes:
                    evicted.append(self._large_cache.pop(0))
            else:
                evicted.append(large)
        for b in evicted:
            b.free(self.agent)

    # -- peers -----------------------------------------------------------------------------------
    def _peer(self, endpoint: str) -> _Peer:
        with self._lock:
            if self._closed:
                raise ShmTransportError("RemoteReader is closed")
            peer = self._peers.get(endpoint)
            if peer is not None and not peer.alive:
                peer.close()  # the daemon went away (or restarted): attach afresh
                del self._peers[endpoint]
                peer = None
            if peer is None:
                peer = _Peer(self, endpoint)
                self._peers[endpoint] = peer
            return peer

    # -- reads -----------------------------------------------------------------------------------
    def read(self, remote: fpb.RemoteTensorHandle | bytes, verify: bool | None = None) -> RemoteBuffer:
        """Read one remote tensor (``verify``: None follows the reader's setting)."""
        return self.read_many([remote], verify=verify)[0]

    def read_many(self, remotes: Sequence[fpb.RemoteTensorHandle | bytes], verify: bool | None = None
                  ) -> list[RemoteBuffer]:
        """Read every remote handle (``RemoteTensorHandle`` or its bytes); in order."""
        descs = [_desc.decode(r) for r in remotes]
        by_endpoint: dict[str, list[int]] = {}
        for i, d in enumerate(descs):
            by_endpoint.setdefault(d.endpoint, []).append(i)
        out: list[RemoteBuffer | None] = [None] * len(descs)
        try:
            for endpoint, indices in by_endpoint.items():
                bufs = self._read_from(endpoint, [descs[i] for i in indices], verify)
                for i, buf in zip(indices, bufs):
                    out[i] = buf
        except BaseException:
            for done in out:
                if done is not None:
                    done.release()
            raise
        return [buf for buf in out if buf is not None]  # every index is filled

    def _read_from(self, endpoint: str, descs: list[rpb.NixlDescriptor], verify: bool | None) -> list[RemoteBuffer]:
        peer = self._peer(endpoint)
        for d in descs:
            if d.agent_name != peer.agent_name or d.tensor.shm.instance_id != peer.instance_id:
                raise Unavailable(
                    f"descriptor names agent {d.agent_name!r} / instance {d.tensor.shm.instance_id!r}, but "
                    f"{endpoint} serves {peer.agent_name!r} / {peer.instance_id!r} (daemon restarted?)",
                )
        tensors = [d.tensor for d in descs]
        bufs: list[RemoteBuffer] = []
        try:
            for t in tensors:
                bufs.append(self._destination(t))
            response = peer.rpc("RemoteAcquire", rpb.RemoteAcquireRequest(tensors=tensors), self.timeout_s)
            try:
                self._pull(peer, bufs, response.regions)
            finally:
                # Only now (READ complete, or failed and cancelled) may the daemon reuse the bytes.
                self._release_leases(peer, response.lease_ids)
            if verify if verify is not None else self.verify:
                for buf in bufs:
                    if buf.handle.digest:
                        buf.verify()
        except BaseException:
            for buf in bufs:
                buf.release()
            raise
        self.stats["reads"] += len(bufs)
        self.stats["bytes"] += sum(b.nbytes for b in bufs)
        return bufs

    def _release_leases(self, peer: _Peer, lease_ids: Sequence[int]) -> None:
        """Sent without waiting for the reply (the READ is complete, nothing depends on it); a
        failure is logged. ``flush()`` (and ``close()``) wait for every release in flight."""
        if not lease_ids:
            return
        future = peer.release_future(rpb.RemoteReleaseRequest(lease_ids=lease_ids), self.timeout_s)
        with self._lock:
            self._pending = [f for f in self._pending if not f.done()]
            self._pending.append(future)
        future.add_done_callback(_log_release_failure)

    def flush(self, timeout_s: float | None = None) -> None:
        """Wait until every lease release sent so far has been answered (or failed)."""
        with self._lock:
            pending, self._pending = self._pending, []
        for future in pending:
            try:
                future.result(timeout=timeout_s if timeout_s is not None else self.timeout_s)
            except Exception:
                pass  # logged by _log_release_failure; the daemon reclaims on session end anyway

    def _pull(self, peer: _Peer, bufs: list[RemoteBuffer], regions: Sequence[rpb.NixlRegion]) -> None:
        if len(regions) != len(bufs):
            raise Unavailable(f"remote daemon returned {len(regions)} regions for {len(bufs)} tensors")
        for buf, region in zip(bufs, regions):
            if region.nbytes != buf.nbytes:
                raise InvalidArgument(f"remote region of {region.nbytes} bytes for a {buf.nbytes}-byte tensor")
        agent = self.agent
        try:
            local = agent.get_xfer_descs([(b.addr, b.nbytes, 0) for b in bufs], "DRAM")
            remote = agent.get_xfer_descs([(r.addr, r.nbytes, r.dev_id) for r in regions], "DRAM")
            xfer = agent.initialize_xfer("READ", local, remote, peer.remote_name)
        except Exception as exc:
            raise Unavailable(f"NIXL could not prepare the READ from {peer.endpoint}: {exc}") from exc
        try:
            state = agent.transfer(xfer)
            deadline = time.monotonic() + self.timeout_s
            while state == "PROC":
                if time.monotonic() > deadline:
                    raise DeadlineExceeded(f"NIXL READ from {peer.endpoint} still running after {self.timeout_s} s")
                state = agent.check_xfer_state(xfer)
            if state != "DONE":
                raise Unavailable(f"NIXL READ from {peer.endpoint} failed (state {state})")
        except ShmTransportError:
            raise
        except Exception as exc:
            raise Unavailable(f"NIXL READ from {peer.endpoint} failed: {exc}") from exc
        finally:
            try:
                agent.release_xfer_handle(xfer)  # cancels a READ still in flight
            except Exception:
                _log.warning("NIXL release_xfer_handle failed", exc_info=True)

    # -- lifecycle -------------------------------------------------------------------------------
    def close(self) -> None:
        """Detach from every daemon (their sessions close), deregister the pool. Idempotent."""
        if not self._closed:
            self.flush()
        with self._lock:
            if self._closed:
                return
            self._closed = True
            peers, self._peers = list(self._peers.values()), {}
        for peer in peers:
            peer.close()
        self._sweep_deferred(force=True)
        with self._lock:
            cached, self._large_cache = self._large_cache, []
        for b in cached:
            b.free(self.agent)
        if self._pool_reg is not None:
            try:
                self.agent.deregister_memory(self._pool_reg)
            except Exception:
                _log.exception("NIXL deregister_memory of the receive pool failed")
            self._pool_reg = None
        self.agent = None

    def __enter__(self) -> "RemoteReader":
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"peers={list(self._peers)}"
        return f"RemoteReader({self.name!r}, slots={len(self._free_slots)} free x {self.slot_nbytes}, {state})"
