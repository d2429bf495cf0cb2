"""shmtransportd: the gRPC control service and the embeddable ``Daemon`` (start/stop).

The daemon serves one or more *tenants*: each allowed uid is one, each allowed group one more.
A tenant has its own arena (passed to its clients as an fd, never opened by name), its own
registry (so its handles name nothing in another tenant's), its own quotas, session limit and wait
slots. The daemon's own uid (the first allowed uid) is the zero-configuration default tenant.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import gc
import grp
import logging
import math
import os
import queue
import resource
import socketserver
import sys
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, NoReturn, Sequence, TypeVar

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from .. import objtable, shm_names
from ..allocator import Allocator
from ..error_boundary import ErrorBoundary
from ..errors import (
    DeadlineExceeded,
    InvalidArgument,
    PermissionDenied,
    Reason,
    ResourceExhausted,
    StateError,
)
from ..v1 import daemon_pb2 as pb
from ..v1 import daemon_pb2_grpc as pb_grpc
from ..wire import MAX_BATCH, SESSION_METADATA_KEY
from .config import DaemonConfig
from .objects import ObjectBook
from .records import TenantLimits
from .registry import Registry
from .segments import (
    Segment,
    ShmReserve,
    default_shm_reserve_nbytes,
    sweep_dead_instances,
)
from .sessions import Admission, SessionServer
from .socket_dir import SocketClaim, claim

_log = logging.getLogger("shmtransport.daemon")

# The largest legitimate request (a batch of MAX_BATCH handles with tokens and a piggybacked
# release) is about 1 MiB; anything larger is refused by gRPC before it is parsed.
MAX_REQUEST_NBYTES = 4 << 20
_SERVER_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_REQUEST_NBYTES),
    ("grpc.max_send_message_length", 64 << 20),
    ("grpc.so_reuseport", 0),
]
_DAEMON_METHOD_PREFIX = "/shmtransport.v1.Daemon/"
_SWEEP_INTERVAL_S = 0.05
_T = TypeVar("_T")


@dataclasses.dataclass
class Tenant:
    """One tenant: who belongs to it, its arena and registry, and its shares of the daemon's
    threads (calls in progress, and waiting ones)."""

    key: str  # "uid:<n>" or "group:<name>"
    uid: int | None
    gid: int | None
    segment: Segment
    registry: Registry
    wait_slots: queue.SimpleQueue[None]
    calls: "CallShare"
    objects: ObjectBook  # the tenant's object table

    def __repr__(self) -> str:
        return f"Tenant({self.key}, {self.segment.name})"


# A reply needs this long to reach a caller on the node. The daemon's clock for a deadline starts
# when the call arrives, a little after the caller's, so "still active" can be true for a caller
# that has already given up.
_DELIVERY_MARGIN_S = 0.05


def bounded_wait(wait_s: float, context: grpc.ServicerContext) -> float:
    """A wait that ends before the caller's deadline, so it gets our typed error, not a timeout."""
    remaining: float | None = context.time_remaining()  # None without a deadline (grpc-stubs: float)
    return wait_s if remaining is None else min(wait_s, max(0.0, remaining - _DELIVERY_MARGIN_S))


def _caller_gone(context: grpc.ServicerContext, remaining_at_start: float | None) -> bool:
    """The caller cancelled, or its deadline is too close for a reply to reach it (the margin is
    at most half of what the call arrived with, so short timeouts still work)."""
    if not context.is_active():
        return True
    remaining: float | None = context.time_remaining()  # None without a deadline (grpc-stubs: float)
    return remaining is not None and remaining < min(_DELIVERY_MARGIN_S, (remaining_at_start or 0.0) / 2)


def _unknown_session() -> PermissionDenied:
    return PermissionDenied("missing or unknown session token: connect through the session handshake",
                            Reason.UNKNOWN_SESSION)


# While another tenant has made a call within the last ACTIVE_WINDOW_S, a tenant's handlers may
# use CONTENDED_CPU_SHARE of one core (their CPU time, measured), past a burst of CPU_BURST_S; past
# that its next calls wait, or are refused (TENANT_BUSY) when the wait would outlast their
# deadline. One Python process serves every tenant: a tenant that keeps its handlers busy makes
# every other tenant's call wait for the interpreter lock, up to 20x its idle p99 on 2 cores
# (benchmarks/tenant_fairness.py). A tenant alone is never limited.
ACTIVE_WINDOW_S = 1.0
CONTENDED_CPU_SHARE = 0.2
CPU_BURST_S = 0.01
_MAX_DEBT_S = 0.5  # bounds a wait at (0.5 - burst) / share, about 2.5 s


class CallShare:
    """A tenant's share of the daemon: its calls in progress at once (past it a call is refused at
    once, TENANT_BUSY, which clients retry within their timeout, so one tenant's flood of calls
    leaves every other tenant its own share of threads), and its handlers' CPU time while another
    tenant is active (``CONTENDED_CPU_SHARE``). Thread-safe."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._running = 0
        self._lock = threading.Lock()
        self.last_call = -math.inf  # time.monotonic() of its latest call
        self._debt_s = 0.0  # CPU seconds used past its share, as of _debt_at
        self._debt_at = 0.0
        self._typical_s = 0.0  # a moving average of its calls' CPU time
        self.line = threading.Lock()  # held by the one call of the tenant that waits for its share
        self.waits = self.refusals = 0  # calls that waited for the CPU share, or were refused for it

    def enter(self, tenant_key: str) -> None:
        """Count a call in; ResourceExhausted (TENANT_BUSY) when the tenant's share is in use."""
        with self._lock:
            if self._running >= self.limit:
                raise ResourceExhausted(f"tenant {tenant_key} has {self.limit} calls in progress, its share of the "
                                        "daemon's threads", Reason.TENANT_BUSY)
            self._running += 1

    def leave(self) -> None:
        """Count a call out; once for every ``enter`` that succeeded."""
        with self._lock:
            self._running -= 1

    def _debt(self, now: float) -> float:
        return max(0.0, self._debt_s - (now - self._debt_at) * CONTENDED_CPU_SHARE)

    def admit(self, now: float) -> tuple[float, float]:
        """(0, the CPU time reserved) when a call of the tenant may start now, within its CPU
        share; else (how long to wait before asking again, 0). The reservation (its calls'
        typical CPU time) makes concurrent callers wait their turn instead of all starting."""
        with self._lock:
            debt = self._debt(now)
            if debt > CPU_BURST_S:
                return (debt - CPU_BURST_S) / CONTENDED_CPU_SHARE, 0.0
            self._debt_s, self._debt_at = min(_MAX_DEBT_S, debt + self._typical_s), now
            return 0.0, self._typical_s

    def count(self, refused: bool) -> None:
        """A call waited for the CPU share (``refused``: was refused for it)."""
        with self._lock:
            if refused:
                self.refusals += 1
            else:
                self.waits += 1

    def charge(self, cpu_s: float, reserved_s: float, now: float, contended: bool) -> None:
        """A call of the tenant used ``cpu_s`` of CPU (``reserved_s`` of it was reserved by
        ``admit``); counted against its share while ``contended``."""
        with self._lock:
            self.last_call = now
            self._typical_s += (cpu_s - self._typical_s) / 8
            debt = self._debt(now) - reserved_s + (cpu_s if contended else 0.0)
            self._debt_s, self._debt_at = min(_MAX_DEBT_S, max(0.0, debt)), now


# Calls that end something (a commit, a release, a session) are never refused for the share: they
# give back what the tenant holds, and a client must be able to finish what it started.
_SHARED_METHODS = frozenset(_DAEMON_METHOD_PREFIX + m for m in ("Info", "Loan", "Grant", "Acquire", "Stat", "List",
                                                                      "Publish", "Lookup"))


# A call that takes longer than this is logged (method, tenant, how much of its deadline was left
# when its handler started): a stall then names where it waited, in the pool or in the handler.
SLOW_CALL_S = 1.0


def _gated(handler: grpc.RpcMethodHandler[Any, Any], tenant: Tenant, tenants: Sequence[Tenant], method: str,
           shared: bool) -> grpc.RpcMethodHandler[Any, Any]:
    """The handler of a session's call, timed and charged to the tenant's CPU share; if ``shared``,
    within its share of threads and, while another of ``tenants`` is active, of CPU."""
    behavior = handler.unary_unary
    if behavior is None:  # every Daemon method is unary-unary
        return handler
    name = method.removeprefix(_DAEMON_METHOD_PREFIX)
    share = tenant.calls

    def contended(now: float) -> bool:
        return any(other.calls.last_call > now - ACTIVE_WINDOW_S for other in tenants if other is not tenant)

    def call(request: Any, context: grpc.ServicerContext) -> Any:
        if not shared:
            return timed(request, context, 0.0)
        share.enter(tenant.key)
        try:
            return timed(request, context, within_cpu_share(context))
        finally:
            share.leave()

    def within_cpu_share(context: grpc.ServicerContext) -> float:
        """Returns once the tenant may run a call (the CPU time reserved for it): while another
        tenant is active and this one used its share, after a wait in line (one of its calls
        sleeps, the others block on the line's lock), or TENANT_BUSY when the wait would outlast
        the caller's deadline."""
        now = time.monotonic()
        if not contended(now):
            return 0.0
        wait, reserved = share.admit(now)
        if wait == 0:
            return reserved
        share.count(refused=False)
        if not share.line.acquire(timeout=max(bounded_wait(_MAX_DEBT_S / CONTENDED_CPU_SHARE, context), 1e-6)):
            raise busy(wait)
        try:
            while wait > 0:
                if bounded_wait(wait, context) < wait:
                    raise busy(wait)
                time.sleep(wait)
                wait, reserved = share.admit(time.monotonic())
            return reserved
        finally:
            share.line.release()

    def busy(wait: float) -> ResourceExhausted:
        share.count(refused=True)
        return ResourceExhausted(f"tenant {tenant.key} used its share of the daemon's CPU while another tenant is "
                                 f"active: {wait:.3f} s until its next call", Reason.TENANT_BUSY)

    def timed(request: Any, context: grpc.ServicerContext, reserved: float) -> Any:
        started, left, cpu_before = time.monotonic(), context.time_remaining(), time.thread_time()
        try:
            return behavior(request, context)
        finally:
            now = time.monotonic()
            share.charge(time.thread_time() - cpu_before, reserved, now, contended(now))
            if now - started > SLOW_CALL_S:
                _log.warning("slow call: %s of tenant %s took %.2f s in its handler (%s of its deadline left "
                             "when it started)", name, tenant.key, now - started,
                             "no deadline" if left is None else f"{left:.2f} s")

    return grpc.unary_unary_rpc_method_handler(call, request_deserializer=handler.request_deserializer,
                                               response_serializer=handler.response_serializer)


class _SessionGate(grpc.ServerInterceptor):
    """Refuses Daemon calls without a live session token before their body is even parsed, so an
    unauthenticated peer costs no more than the bytes gRPC already bounds (MAX_REQUEST_NBYTES);
    the others run within their tenant's share of threads, timed (``SLOW_CALL_S``)."""

    def __init__(self, daemon: "Daemon") -> None:
        self._daemon = daemon
        # no deserializer: raw bytes
        self._refusal: grpc.RpcMethodHandler[bytes, NoReturn] = grpc.unary_unary_rpc_method_handler(self._refuse)
        # (method, tenant key) -> (the servicer's handler, the tenant, the two gated): the same
        # handler object for every call, so the error boundary outside reuses its wrapper too
        self._gated: dict[tuple[str, str], tuple[grpc.RpcMethodHandler[Any, Any], Tenant,
                                                 grpc.RpcMethodHandler[Any, Any]]] = {}

    @staticmethod
    def _refuse(_raw_request: bytes, context: grpc.ServicerContext) -> NoReturn:
        raise _unknown_session()  # answered by the ErrorBoundary outside this gate

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler[Any, Any] | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any] | None:
        if handler_call_details.method.startswith(_DAEMON_METHOD_PREFIX):
            token = next((v for k, v in handler_call_details.invocation_metadata if k == SESSION_METADATA_KEY), None)
            sessions = self._daemon.sessions
            found = sessions.session_for_token(token) if isinstance(token, str) and sessions is not None else None
            if found is None:
                return self._refusal
            handler = continuation(handler_call_details)
            if handler is None:
                return None
            method, tenant = handler_call_details.method, found[1]
            cached = self._gated.get((method, tenant.key))
            if cached is not None and cached[0] is handler and cached[1] is tenant:
                return cached[2]
            gated = _gated(handler, tenant, self._daemon.tenants, method, method in _SHARED_METHODS)
            self._gated[(method, tenant.key)] = (handler, tenant, gated)
            return gated
        return continuation(handler_call_details)


if TYPE_CHECKING:
    from typing import TypeAlias

    _WithRelease: TypeAlias = pb.LoanRequest | pb.CommitRequest | pb.AcquireRequest  # with a piggybacked release


def _check_release_counts(request: _WithRelease) -> None:
    """Counts of a piggybacked release, checked on the repeated fields before anything expands them."""
    if request.HasField("release"):
        count = len(request.release.handles) + len(request.release.lease_ids)
        if count > MAX_BATCH:
            raise InvalidArgument(f"piggybacked release: {count} entries exceed the batch limit {MAX_BATCH}")


class _Servicer(pb_grpc.DaemonServicer):
    def __init__(self, daemon: "Daemon") -> None:
        self._daemon = daemon

    @staticmethod
    def _waiting(tenant: Tenant, wait_s: float, context: grpc.ServicerContext, call: Callable[[float], _T]) -> _T:
        """``call(w)`` with a wait of up to ``wait_s`` (bounded by the caller's deadline) when one
        of the tenant's wait slots is free, else with no wait. Waiting calls park a worker thread:
        each tenant may park only its share of half the pool, so the other half always serves
        everyone, and no tenant's waiters can take another's."""
        if wait_s <= 0:
            return call(0.0)
        try:
            tenant.wait_slots.get_nowait()
        except queue.Empty:
            return call(0.0)
        try:
            return call(bounded_wait(wait_s, context))
        finally:
            tenant.wait_slots.put(None)

    def _session(self, context: grpc.ServicerContext) -> tuple[str, Tenant]:
        sessions = self._daemon.sessions
        for key, value in context.invocation_metadata():
            if key == SESSION_METADATA_KEY:
                found = sessions.session_for_token(value) if sessions is not None and isinstance(value, str) else None
                if found is not None:
                    return found
                break
        raise _unknown_session()

    def Info(self, request: pb.InfoRequest, context: grpc.ServicerContext) -> pb.ArenaInfo:
        _, tenant = self._session(context)
        return self._daemon.arena_info_of(tenant)

    @staticmethod
    def _piggybacked_release(tenant: Tenant, session_id: str, request: _WithRelease) -> None:
        if request.HasField("release"):
            r = request.release
            tenant.registry.release(session_id, r.handles, r.lease_ids, piggybacked=True)

    def Loan(self, request: pb.LoanRequest, context: grpc.ServicerContext) -> pb.LoanResponse:
        remaining_at_start = context.time_remaining()
        session_id, tenant = self._session(context)
        _check_release_counts(request)
        self._piggybacked_release(tenant, session_id, request)
        registry = tenant.registry
        if request.dedicated:
            response = registry.loan_dedicated(session_id, request.nbytes)
        else:
            wait_s = min(request.wait_ms, self._daemon.config.max_alloc_wait_ms) / 1000
            response = self._waiting(tenant, wait_s, context, lambda w: registry.loan(session_id, request.nbytes, w))
        if _caller_gone(context, remaining_at_start):
            # The caller gave up (deadline, cancel) while we allocated: nobody will ever see these
            # handles, so they must not stay allocated to its session.
            registry.release(session_id, response.handles, ())
            raise DeadlineExceeded("the caller's deadline passed while the daemon placed this loan: undone")
        return response

    def Grant(self, request: pb.GrantRequest, context: grpc.ServicerContext) -> pb.GrantResponse:
        remaining_at_start = context.time_remaining()
        session_id, tenant = self._session(context)
        registry = tenant.registry
        wait_s = min(request.wait_ms, self._daemon.config.max_alloc_wait_ms) / 1000
        response = self._waiting(tenant, wait_s, context, lambda w: registry.grant(
            session_id, request.nbytes, request.nslots, w, request.give_back, request.retry))
        if response.grant_id and _caller_gone(context, remaining_at_start):
            registry.grant(session_id, 0, 0, 0.0, [response.grant_id])  # nobody will place objects in it
            raise DeadlineExceeded("the caller's deadline passed while the daemon made this grant: undone")
        return response

    def Commit(self, request: pb.CommitRequest, context: grpc.ServicerContext) -> pb.CommitResponse:
        session_id, tenant = self._session(context)
        _check_release_counts(request)
        self._piggybacked_release(tenant, session_id, request)
        tenant.registry.commit(session_id, request.handles, request.hold_ms, request.release_reference)
        return pb.CommitResponse()

    def Acquire(self, request: pb.AcquireRequest, context: grpc.ServicerContext) -> pb.AcquireResponse:
        session_id, tenant = self._session(context)
        _check_release_counts(request)
        self._piggybacked_release(tenant, session_id, request)
        lease_ids = self._waiting(
            tenant,
            self._daemon.config.commit_wait_s,
            context,
            lambda w: tenant.registry.acquire(session_id, request.handles, request.ttl_ms, w, request.commit_tokens),
        )
        return pb.AcquireResponse(lease_ids=lease_ids)

    def Release(self, request: pb.ReleaseRequest, context: grpc.ServicerContext) -> pb.ReleaseResponse:
        session_id, tenant = self._session(context)
        tenant.registry.release(session_id, request.handles, request.lease_ids, piggybacked=request.skip_gone)
        return pb.ReleaseResponse()

    def Stat(self, request: pb.StatRequest, context: grpc.ServicerContext) -> pb.StatResponse:
        session_id, tenant = self._session(context)
        tenant.registry.note_looked(session_id)
        return self._daemon.stat(tenant)

    def List(self, request: pb.ListRequest, context: grpc.ServicerContext) -> pb.ListResponse:
        session_id, tenant = self._session(context)
        tenant.registry.note_looked(session_id)
        return tenant.registry.list_objects(request.limit)

    def Publish(self, request: pb.PublishRequest, context: grpc.ServicerContext) -> pb.PublishResponse:
        session_id, tenant = self._session(context)
        return tenant.registry.publish(session_id, request.scope, request.identity, request.tensor)

    def Lookup(self, request: pb.LookupRequest, context: grpc.ServicerContext) -> pb.LookupResponse:
        session_id, tenant = self._session(context)
        return tenant.registry.lookup(session_id, request.scope, request.identities)

    def Close(self, request: pb.CloseRequest, context: grpc.ServicerContext) -> pb.CloseResponse:
        session_id, tenant = self._session(context)
        tenant.registry.close_session(session_id, closed_by_client=True)  # the socket's EOF then finds none
        return pb.CloseResponse()


def tune_interpreter_for_daemon() -> None:
    """For a process whose job is the daemon (the CLI's, not one that embeds a ``Daemon``). A
    full garbage collection holds the interpreter lock, so every tenant's calls, for as long as
    it scans: ~60 ms once a tenant holds 100,000 leases, several times a second under a churn of
    leases. And a thread that wants the lock waits the switch interval (5 ms by default) each time,
    several times per call."""
    gc.freeze()  # what start-up made lives as long as the process: no collection scans it again
    gc.set_threshold(700, 10, 1000)  # a full collection after 1,000 middle ones, not 10
    sys.setswitchinterval(0.0005)


class Daemon:
    """The node-local daemon; embeddable (``with Daemon(config): ...``) or run by the CLI."""

    def __init__(
        self,
        config: DaemonConfig | None = None,
        extensions: Sequence[Callable[["Daemon", grpc.Server], Callable[[], None] | None]] = (),
        **overrides: Any,
    ) -> None:
        """``extensions``: called with (daemon, grpc server) before the server starts, to add
        services (e.g. the remote tier); each may return a callable that stop() runs first."""
        self.config = dataclasses.replace(config or DaemonConfig(), **overrides)
        self._extensions = tuple(extensions)
        self._extension_stops: list[Callable[[], None]] = []
        shm_names.validate_prefix(self.config.name_prefix)
        self.instance_id = shm_names.new_instance_id()
        self._state = "new"
        self._stop_event = threading.Event()
        self.tenants: list[Tenant] = []
        self._claim: SocketClaim | None = None  # the socket directory, lock and socket paths, from start() on
        self._socket_gid: int | None = None
        self._server: grpc.Server | None = None
        self.sessions: SessionServer[Tenant] | None = None
        self._sweeper: threading.Thread | None = None
        self._metrics_server: socketserver.BaseServer | None = None

    # -- lifecycle -------------------------------------------------------------------------------
    def start(self) -> "Daemon":
        """Claim the socket, create the segments and serve; returns self. A failed start leaves nothing behind."""
        if self._state != "new":
            raise StateError(f"daemon already {self._state}")
        self.config.validate()
        cfg = self.config
        # What can be checked without creating anything is checked first; from the claim on, a
        # failure is undone by _teardown, so a failed start leaves no segment, socket or lock file.
        if cfg.socket_group:
            try:
                self._socket_gid = grp.getgrnam(cfg.socket_group).gr_gid
            except KeyError:
                raise InvalidArgument(f"socket group {cfg.socket_group!r} does not exist") from None
        # Before anything binds: a private directory, the lock, no leftovers at either socket path.
        self._claim = claim(cfg.socket_path, other_uids=cfg.socket_mode == 0o666, group_gid=self._socket_gid)
        try:
            sweep_dead_instances(cfg.name_prefix, frozenset(cfg.allowed_uids) if os.geteuid() == 0 else frozenset())
            self._start_services()
        except BaseException:
            if self._server is not None:  # started before a later step failed: its fds go too
                self._server.stop(0).wait(1)
            self._teardown()
            raise
        self._state = "running"
        _log.info(
            "shmtransportd %s listening on %s; %s",
            self.instance_id,
            cfg.socket_path,
            ", ".join(f"tenant {t.key}: arena {t.segment.name} of {t.segment.nbytes >> 20} MiB" for t in self.tenants),
        )
        return self

    def _create_tenants(self) -> None:
        """One arena and registry per allowed uid and group, all reserved before anything is served."""
        cfg = self.config
        specs: list[tuple[str, int | None, int | None]] = [(f"uid:{uid}", uid, None)
                                                           for uid in dict.fromkeys(cfg.allowed_uids)]
        for name in cfg.allowed_groups:
            try:
                specs.append((f"group:{name}", None, grp.getgrnam(name).gr_gid))
            except KeyError:
                raise InvalidArgument(f"allowed group {name!r} does not exist") from None
        if not specs:
            raise InvalidArgument("no tenant: allow at least one uid or group")
        arena_nbytes = cfg.resolved_arena_nbytes(len(specs))
        reserve = ShmReserve(default_shm_reserve_nbytes() if cfg.shm_reserve_nbytes is None else cfg.shm_reserve_nbytes)
        limits = TenantLimits(
            quota_nbytes=cfg.quota_nbytes,
            quota_leases=cfg.quota_leases,
            default_lease_ttl_ms=cfg.default_lease_ttl_ms,
            max_lease_ttl_ms=cfg.max_lease_ttl_ms,
            default_hold_ms=cfg.default_hold_ms,
            max_hold_ms=cfg.max_hold_ms,
            handoff_window_ms=cfg.handoff_window_ms,
            cache_nbytes=cfg.cache_nbytes,
        )
        nslots = cfg.resolved_object_slots(arena_nbytes)
        wait_share = max(1, cfg.grpc_workers // 2 // len(specs))
        call_share = max(1, cfg.grpc_workers // len(specs))
        for index, (key, uid, gid) in enumerate(specs):
            base = shm_names.tenant_base(cfg.name_prefix, self.instance_id, index)
            segment = Segment.create_sealed(shm_names.arena_name(base), arena_nbytes)
            created = [segment]
            try:
                for name in (shm_names.table_name(base), shm_names.holds_name(base)):
                    created.append(Segment.create_sealed(name, objtable.table_nbytes(nslots)))
                # Shared only where this process has the C kernels: clients change it with atomics.
                objects = ObjectBook(created[1], created[2], nslots, cfg.handoff_window_ms, cfg.max_hold_ms,
                                     shared=cfg.share_object_table)
            except BaseException:
                for made in created:
                    made.unlink()
                raise
            slots: queue.SimpleQueue[None] = queue.SimpleQueue()
            for _ in range(wait_share):
                slots.put(None)
            registry = Registry(self.instance_id, segment.name, Allocator(arena_nbytes, cfg.page_align_min_nbytes),
                                limits, objects, reserve, _dedicated_owner(uid, gid), tenant=key)
            self.tenants.append(Tenant(key, uid, gid, segment, registry, slots, CallShare(call_share), objects))

    def _tenant_of(self, uid: int, groups: Sequence[int]) -> Tenant | None:
        for tenant in self.tenants:
            if tenant.uid == uid:
                return tenant
        for tenant in self.tenants:
            if tenant.gid is not None and tenant.gid in groups:
                return tenant
        return None

    def _admit(self, pid: int, uid: int, groups: Sequence[int], writable: bool) -> Admission[Tenant]:
        tenant = self._tenant_of(uid, groups)
        if tenant is None:
            raise PermissionDenied(f"uid {uid} is not allowed")
        if tenant.registry.live_sessions >= self.config.max_sessions_per_tenant:
            raise ResourceExhausted(
                f"tenant {tenant.key} already has {self.config.max_sessions_per_tenant} sessions "
                "(max_sessions_per_tenant); close idle clients", Reason.QUOTA_EXCEEDED,
            )
        info = self.arena_info_of(tenant)
        hello = pb.SessionHello(instance_id=self.instance_id, segment_name=info.segment_name,
                                arena_nbytes=info.nbytes, shm_namespace=info.shm_namespace, tenant=tenant.key)
        fds = [tenant.segment.open_fd(writable)]
        if tenant.objects.shared:
            # Consumers write only the holds (their holder bits); the arena and the slots, which
            # say what everyone reads, stay read-only to them.
            objects = tenant.objects
            hello.object_table.CopyFrom(pb.ObjectTableInfo(
                segment_name=objects.slots_segment.name, holds_segment_name=objects.holds_segment.name,
                nslots=objects.nslots, handoff_window_ms=objects.handoff_window_ms,
                max_hold_ms=self.config.max_hold_ms))
            fds += [objects.slots_segment.open_fd(writable), objects.holds_segment.open_fd(True)]
        return Admission(tenant, hello, tuple(fds))

    def arena_info_of(self, tenant: Tenant) -> pb.ArenaInfo:
        """What a client of ``tenant`` is told about its arena in the handshake."""
        return pb.ArenaInfo(instance_id=self.instance_id, segment_name=tenant.segment.name,
                            nbytes=tenant.segment.nbytes, shm_namespace=self._shm_namespace)

    @property
    def registry(self) -> Registry | None:
        """The default tenant's registry (the daemon's own uid, or the first allowed one)."""
        return self.tenants[0].registry if self.tenants else None

    @property
    def arena_info(self) -> pb.ArenaInfo:
        """The default tenant's arena."""
        return self.arena_info_of(self.tenants[0])

    def _start_services(self) -> None:
        cfg = self.config
        _raise_fd_limit()
        self._shm_namespace = cfg.shm_namespace or shm_names.shm_namespace_id()
        self._create_tenants()
        self.sessions = SessionServer(
            cfg.session_socket_path,
            lambda uid, groups: self._tenant_of(uid, groups) is not None,
            self._admit,
            on_open=lambda session_id, pid, uid, tenant: tenant.registry.open_session(session_id, pid, uid),
            on_close=lambda session_id, tenant: tenant.registry.close_session(session_id),
            socket_mode=cfg.socket_mode,
        )
        self._server = grpc.server(
            concurrent.futures.ThreadPoolExecutor(max_workers=cfg.grpc_workers, thread_name_prefix="shmt-rpc"),
            options=_SERVER_OPTIONS,
            interceptors=[ErrorBoundary(), _SessionGate(self)],  # the boundary outermost: it answers the gate too
        )
        pb_grpc.add_DaemonServicer_to_server(_Servicer(self), self._server)
        health_servicer = health.HealthServicer()
        health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        health_servicer.set("shmtransport.v1.Daemon", health_pb2.HealthCheckResponse.SERVING)
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, self._server)
        for extension in self._extensions:
            stop = extension(self, self._server)
            if stop is not None:
                self._extension_stops.append(stop)
        self._server.add_insecure_port(f"unix:{cfg.socket_path}")  # start() cleared the path
        self._server.start()
        os.chmod(cfg.socket_path, cfg.socket_mode)
        if self._socket_gid is not None:
            for path in (cfg.socket_path, cfg.session_socket_path):
                os.chown(path, -1, self._socket_gid)
        self.sessions.start()
        self._sweeper = threading.Thread(target=self._sweep_loop, name="shmt-sweeper", daemon=True)
        self._sweeper.start()
        if cfg.metrics_port is not None or cfg.metrics_address is not None:
            from .metrics import metrics_address, start_metrics_server

            address = metrics_address(cfg.metrics_port, cfg.metrics_address)
            if address is not None:  # always, with either set
                self._metrics_server = start_metrics_server(self.tenant_stats, address)

    def tenant_stats(self) -> list[tuple[str, Callable[[], pb.StatResponse]]]:
        """Each tenant's key and how to read its ``Stat`` now (what the metrics endpoint serves)."""
        return [(tenant.key, functools.partial(self.stat, tenant)) for tenant in self.tenants]

    def stop(self, grace_s: float | None = None) -> None:
        """Stop accepting, let calls in flight finish (bounded), unlink everything. Idempotent."""
        if self._state in ("stopped", "new"):
            self._state = "stopped"
            return
        self._state = "stopping"
        grace = self.config.stop_grace_s if grace_s is None else grace_s
        if self._server is not None:
            self._server.stop(grace).wait(grace + 1)
        self._teardown()
        self._state = "stopped"
        _log.info("shmtransportd %s stopped; segments unlinked", self.instance_id)

    def _teardown(self) -> None:
        self._stop_event.set()
        for stop in reversed(self._extension_stops):
            try:
                stop()
            except Exception:  # one failing extension must not keep the segments from going
                _log.exception("extension stop failed")
        self._extension_stops.clear()
        if self._sweeper is not None:
            self._sweeper.join(timeout=2)
        if self._metrics_server is not None:
            self._metrics_server.shutdown()
            self._metrics_server.server_close()
        if self.sessions is not None:
            try:
                self.sessions.stop()
            except Exception:  # e.g. never started (a failed start): the segments must still go
                _log.exception("session server stop failed")
        for tenant in self.tenants:
            tenant.registry.unlink_dedicated()
            tenant.segment.unlink()
            tenant.objects.close()
            tenant.objects.slots_segment.unlink()
            tenant.objects.holds_segment.unlink()
        if self._claim is not None:  # always: the claim comes first in start()
            self._claim.release()  # both sockets and the lock file; never another daemon's

    def __enter__(self) -> "Daemon":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def closed(self) -> bool:
        """Whether the daemon was stopped."""
        return self._state == "stopped"

    @property
    def socket_path(self) -> str:
        """The gRPC socket clients connect to."""
        return self.config.socket_path

    @property
    def segment_names(self) -> list[str]:
        """Every segment of this daemon: the tenants' arenas first (the default tenant's leading),
        then their object tables, then their dedicated segments."""
        names = [tenant.segment.name for tenant in self.tenants]
        names += [s.name for t in self.tenants for s in (t.objects.slots_segment, t.objects.holds_segment)]
        return names + [name for tenant in self.tenants for name in tenant.registry.dedicated_names()]

    def __repr__(self) -> str:
        return f"Daemon(instance={self.instance_id}, socket={self.config.socket_path!r}, {self._state})"

    # -- work ------------------------------------------------------------------------------------
    def stat(self, tenant: Tenant | None = None) -> pb.StatResponse:
        """One tenant's state (default: the default tenant's)."""
        tenant = tenant or self.tenants[0]
        response = tenant.registry.stat()
        response.arena.CopyFrom(self.arena_info_of(tenant))
        response.cpu_share_waits, response.cpu_share_refusals = tenant.calls.waits, tenant.calls.refusals
        return response

    def _sweep_loop(self) -> None:
        while not self._stop_event.wait(_SWEEP_INTERVAL_S):
            for tenant in self.tenants:
                try:
                    tenant.registry.expire()
                except Exception:  # keep sweeping: one bad entry must not stop TTL reclaim
                    _log.exception("TTL sweep of tenant %s failed", tenant.key)


def _dedicated_owner(uid: int | None, gid: int | None) -> tuple[int, int] | None:
    """Who a tenant's dedicated segments are handed to, so its processes can open them by name;
    None when this daemon cannot hand files to that tenant (only root can chown to another uid)."""
    euid = os.geteuid()
    if uid is not None:
        if uid == euid:
            return (-1, -1)
        return (uid, -1) if euid == 0 else None
    if gid is None:  # a tenant is a uid or a group: never both None
        return None
    return (-1, gid) if euid == 0 or gid in os.getgroups() else None


def _raise_fd_limit() -> None:
    """Every session holds an fd: take the hard limit, so per-tenant session limits bind first."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
