"""shmtransportd: the gRPC control service and the embeddable ``Daemon`` (start/stop)."""
from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import grp
import logging
import os
import queue
import threading
from typing import Callable, Sequence

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from ..errors import PermissionDenied, ShmTransportError, StateError, status_for
from ..v1 import daemon_pb2 as pb
from ..v1 import daemon_pb2_grpc as pb_grpc
from .allocator import Allocator
from .config import DaemonConfig
from .registry import Limits, Registry
from .segments import Segment, new_instance_id, shm_namespace_id, sweep_dead_instances, validate_prefix
from .sessions import SessionServer

_log = logging.getLogger("shmtransport.daemon")

SESSION_METADATA_KEY = "shmt-session"
GRPC_OPTIONS = [
    ("grpc.max_receive_message_length", 64 << 20),
    ("grpc.max_send_message_length", 64 << 20),
    ("grpc.so_reuseport", 0),
]
_SWEEP_INTERVAL_S = 0.05


def _typed_errors(method: Callable) -> Callable:
    """Turn our exceptions into their status; anything else is INTERNAL (logged), never a crash."""

    @functools.wraps(method)
    def wrapper(self, request, context):
        try:
            return method(self, request, context)
        except ShmTransportError as exc:
            code, details = status_for(exc)
            context.abort(code, details)
        except Exception:  # a bug of ours: report it to this caller and keep serving the others
            _log.exception("internal error in %s", method.__name__)
            context.abort(grpc.StatusCode.INTERNAL, "internal: unexpected daemon error (see daemon log)")

    return wrapper


def _bounded_wait(wait_s: float, context) -> float:
    """A wait that ends before the caller's deadline, so it gets our typed error, not a timeout."""
    remaining = context.time_remaining()
    return wait_s if remaining is None else min(wait_s, max(0.0, remaining - 0.05))


class _Servicer(pb_grpc.DaemonServicer):
    def __init__(self, daemon: "Daemon"):
        self._daemon = daemon
        self._registry = daemon.registry
        # Waiting calls park a worker thread; at most half the pool may wait, so the other half
        # always serves everyone else (no head-of-line blocking). Past that, waits fail fast.
        # A pool of tokens rather than a BoundedSemaphore: every Loan and Acquire takes one, and
        # the queue's C get/put cost a fraction of the semaphore's Python-level Condition.
        self._wait_slots: queue.SimpleQueue[None] = queue.SimpleQueue()
        for _ in range(max(1, daemon.config.grpc_workers // 2)):
            self._wait_slots.put(None)

    def _waiting(self, wait_s: float, context, call: Callable[[float], object]):
        """``call(w)`` with a wait of up to ``wait_s`` (bounded by the caller's deadline) when a wait
        slot is free, else with no wait."""
        if wait_s <= 0:
            return call(0.0)
        try:
            self._wait_slots.get_nowait()
        except queue.Empty:
            return call(0.0)
        try:
            return call(_bounded_wait(wait_s, context))
        finally:
            self._wait_slots.put(None)

    def _session_id(self, context) -> str:
        for key, value in context.invocation_metadata():
            if key == SESSION_METADATA_KEY:
                session_id = self._daemon.sessions.session_for_token(value)
                if session_id is not None:
                    return session_id
                break
        raise PermissionDenied("missing or unknown session token: connect through the session handshake")

    @_typed_errors
    def Info(self, request, context):
        self._session_id(context)
        return self._daemon.arena_info

    def _piggybacked_release(self, session_id: str, request) -> None:
        if request.HasField("release"):
            r = request.release
            self._registry.release(session_id, r.handles, r.lease_ids, piggybacked=True)

    @_typed_errors
    def Loan(self, request, context):
        session_id = self._session_id(context)
        self._piggybacked_release(session_id, request)
        if request.dedicated:
            return self._registry.loan_dedicated(session_id, request.nbytes)
        wait_s = min(request.wait_ms, self._daemon.config.max_alloc_wait_ms) / 1000
        return self._waiting(wait_s, context, lambda w: self._registry.loan(session_id, request.nbytes, w))

    @_typed_errors
    def Commit(self, request, context):
        session_id = self._session_id(context)
        self._piggybacked_release(session_id, request)
        self._registry.commit(session_id, request.handles, request.hold_ms)
        return pb.CommitResponse()

    @_typed_errors
    def Acquire(self, request, context):
        session_id = self._session_id(context)
        self._piggybacked_release(session_id, request)
        lease_ids = self._waiting(
            self._daemon.config.commit_wait_s,
            context,
            lambda w: self._registry.acquire(session_id, request.handles, request.ttl_ms, w, request.commit_tokens),
        )
        return pb.AcquireResponse(lease_ids=lease_ids)

    @_typed_errors
    def Release(self, request, context):
        self._registry.release(
            self._session_id(context), request.handles, request.lease_ids, piggybacked=request.skip_gone
        )
        return pb.ReleaseResponse()

    @_typed_errors
    def Stat(self, request, context):
        self._session_id(context)
        return self._daemon.stat()


class Daemon:
    """The node-local daemon; embeddable (``with Daemon(config): ...``) or run by the CLI."""

    def __init__(
        self,
        config: DaemonConfig | None = None,
        extensions: Sequence[Callable[["Daemon", grpc.Server], Callable[[], None] | None]] = (),
        **overrides,
    ):
        """``extensions``: called with (daemon, grpc server) before the server starts, to add
        services (e.g. the remote tier); each may return a callable that stop() runs first."""
        self.config = dataclasses.replace(config or DaemonConfig(), **overrides)
        self._extensions = tuple(extensions)
        self._extension_stops: list[Callable[[], None]] = []
        validate_prefix(self.config.name_prefix)
        self.instance_id = new_instance_id()
        self._state = "new"
        self._stop_event = threading.Event()
        self._segment: Segment | None = None
        self._server: grpc.Server | None = None
        self.sessions: SessionServer | None = None
        self.registry: Registry | None = None
        self._sweeper: threading.Thread | None = None
        self._metrics_server = None

    # -- lifecycle -------------------------------------------------------------------------------
    def start(self) -> "Daemon":
        if self._state != "new":
            raise StateError(f"daemon already {self._state}")
        cfg = self.config
        sweep_dead_instances(cfg.name_prefix)
        arena_nbytes = cfg.resolved_arena_nbytes()
        segment_name = f"{cfg.name_prefix}-{self.instance_id}-arena"
        self._segment = Segment.create(segment_name, arena_nbytes)
        try:
            self._start_services(arena_nbytes)
        except BaseException:
            self._teardown()
            raise
        self._state = "running"
        _log.info(
            "shmtransportd %s listening on %s; arena %s: %d MiB reserved in /dev/shm",
            self.instance_id,
            cfg.socket_path,
            segment_name,
            arena_nbytes >> 20,
        )
        return self

    def _start_services(self, arena_nbytes: int) -> None:
        cfg = self.config
        self.arena_info = pb.ArenaInfo(
            instance_id=self.instance_id,
            segment_name=self._segment.name,
            nbytes=arena_nbytes,
            shm_namespace=cfg.shm_namespace or shm_namespace_id(),
        )
        limits = Limits(
            quota_nbytes=cfg.quota_nbytes or arena_nbytes,
            quota_leases=cfg.quota_leases,
            default_lease_ttl_ms=cfg.default_lease_ttl_ms,
            max_lease_ttl_ms=cfg.max_lease_ttl_ms,
            default_hold_ms=cfg.default_hold_ms,
        )
        allocator = Allocator(arena_nbytes, cfg.page_align_min_nbytes)
        self.registry = Registry(self.instance_id, self._segment.name, allocator, limits)
        hello = {
            "instance_id": self.instance_id,
            "segment_name": self._segment.name,
            "arena_nbytes": arena_nbytes,
            "shm_namespace": self.arena_info.shm_namespace,
        }
        self.sessions = SessionServer(
            cfg.session_socket_path,
            frozenset(cfg.allowed_uids),
            hello,
            on_open=self.registry.open_session,
            on_close=self.registry.close_session,
            socket_mode=cfg.socket_mode,
        )
        self._server = grpc.server(
            concurrent.futures.ThreadPoolExecutor(max_workers=cfg.grpc_workers, thread_name_prefix="shmt-rpc"),
            options=GRPC_OPTIONS,
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
        if os.path.exists(cfg.socket_path):
            os.unlink(cfg.socket_path)
        self._server.add_insecure_port(f"unix:{cfg.socket_path}")
        self._server.start()
        os.chmod(cfg.socket_path, cfg.socket_mode)
        if cfg.socket_group:
            gid = grp.getgrnam(cfg.socket_group).gr_gid
            for path in (cfg.socket_path, cfg.session_socket_path):
                os.chown(path, -1, gid)
        self.sessions.start()
        self._sweeper = threading.Thread(target=self._sweep_loop, name="shmt-sweeper", daemon=True)
        self._sweeper.start()
        if cfg.metrics_port is not None:
            from .metrics import start_metrics_server

            self._metrics_server = start_metrics_server(self, cfg.metrics_port)

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
            self.sessions.stop()
        if self.registry is not None:
            self.registry.unlink_dedicated()
        if self._segment is not None:
            self._segment.unlink()
        for path in (self.config.socket_path,):
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass

    def __enter__(self) -> "Daemon":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def closed(self) -> bool:
        return self._state == "stopped"

    @property
    def socket_path(self) -> str:
        return self.config.socket_path

    @property
    def segment_names(self) -> list[str]:
        names = [self._segment.name] if self._segment is not None else []
        return names + (self.registry.dedicated_names() if self.registry is not None else [])

    def __repr__(self) -> str:
        return f"Daemon(instance={self.instance_id}, socket={self.config.socket_path!r}, {self._state})"

    # -- work ------------------------------------------------------------------------------------
    def stat(self) -> pb.StatResponse:
        response = self.registry.stat()
        response.arena.CopyFrom(self.arena_info)
        return response

    def _sweep_loop(self) -> None:
        while not self._stop_event.wait(_SWEEP_INTERVAL_S):
            try:
                self.registry.expire()
            except Exception:  # keep sweeping: one bad entry must not stop TTL reclaim
                _log.exception("TTL sweep failed")
