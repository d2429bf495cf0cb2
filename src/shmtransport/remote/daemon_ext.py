"""The daemon side of the remote tier: ``remote_extension(...)`` for ``Daemon(extensions=[...])``.

At start it maps the arena once (read-only), registers it ONCE with a NIXL agent (UCX backend) as
one region, adds the ``shmtransport.v1.Remote`` service to the daemon's gRPC server (so it is served
on the Unix socket) and binds a TCP address for remote peers. A remote peer:

1. ``Attach`` (server stream): gets a session token and the agent metadata; the extension opens a
   registry session for the peer and closes it when the stream ends, so every lease the peer still
   holds is reclaimed when it disconnects or dies (mid-read included).
2. ``RemoteAcquire(tensors)``: leases (the same registry leases local consumers get: generation
   checked, commit by handoff honoured) and the NIXL regions (address, length) to READ.
3. ``RemoteRelease(lease_ids)`` once its READ has completed (or failed).

The daemon never touches payload bytes: the peer's NIXL READ pulls them from the registered arena.
Only arena handles are served: a dedicated-segment handle (its own segment, not registered) is
refused before any lease. Peers authenticate with a shared secret and/or mutual TLS (``auth``);
without either the endpoint is open to whoever reaches it, and the daemon says so at start.
"""
from __future__ import annotations

import logging
import mmap
import os
import secrets
import threading
from typing import TYPE_CHECKING, Any, Callable, Iterator

import grpc
import numpy as np

from ..errors import InvalidArgument, PermissionDenied, Unavailable
from ..v1 import remote_pb2 as rpb
from ..v1 import remote_pb2_grpc as rpb_grpc
from ._nixl import new_agent
from .auth import RemoteTLS, check_secret, secret_matches

if TYPE_CHECKING:
    from ..daemon.registry import Registry
    from ..daemon.server import Daemon

_log = logging.getLogger("shmtransport.remote")

REMOTE_SESSION_METADATA_KEY = "shmt-remote-session"
TRANSPORT = "nixl"
_STREAM_POLL_S = 0.2

# What ``remote_extension`` returns, for ``Daemon(extensions=[...])``: (daemon, its gRPC server) ->
# the extension's stop.
RemoteInstall = Callable[["Daemon", grpc.Server], Callable[[], None]]


class RemoteExtension:
    """State of the remote tier inside one daemon; built by ``remote_extension``."""

    def __init__(self, daemon: Daemon, listen_host: str, listen_port: int, advertise_host: str | None,
                 secret: str | None = None, tls: RemoteTLS | None = None) -> None:
        self.daemon = daemon
        self._secret = secret
        self._tls = tls
        self.listen_host = listen_host
        self.listen_port = listen_port
        self.advertise_host = advertise_host or listen_host
        self.endpoint = ""
        self.agent: Any = None  # the NIXL agent, while installed
        self.agent_name = f"shmtd-{daemon.instance_id}"
        self.agent_metadata = b""
        self._mmap: mmap.mmap | None = None
        self._reg: Any = None  # NIXL registration of the arena
        self.base_addr = 0
        self.nbytes = 0
        self._lock = threading.Lock()
        self._tokens: dict[str, str] = {}  # session token -> registry session id
        self._stopping = threading.Event()
        self.sessions_total = 0

    # -- lifecycle -------------------------------------------------------------------------------
    def install(self, server: grpc.Server) -> Callable[[], None]:
        """Register the arena with NIXL once and serve the Remote service on ``server``; the undo (``stop``)."""
        daemon = self.daemon
        arena = daemon.tenants[0].segment  # sealed, nameless: mapped from the daemon's own fd
        self.nbytes = arena.nbytes
        self._mmap = arena.map(writable=False)
        self.base_addr = int(np.frombuffer(self._mmap, dtype=np.uint8).ctypes.data)
        try:
            self.agent = new_agent(self.agent_name)
            # One region for the whole arena, registered once: never per tensor.
            self._reg = self.agent.register_memory([(self.base_addr, self.nbytes, 0, "")], "DRAM")
            self.agent_metadata = self.agent.get_agent_metadata()
            address = f"{self.listen_host}:{self.listen_port}"
            if self._tls is not None:
                port = server.add_secure_port(address, self._tls.server_credentials())
            else:
                port = server.add_insecure_port(address)
            if port == 0:
                raise OSError(f"cannot listen on {self.listen_host}:{self.listen_port}")
            self.endpoint = f"{self.advertise_host}:{port}"
            rpb_grpc.add_RemoteServicer_to_server(_RemoteServicer(self), server)
        except BaseException:
            self.stop()
            raise
        _log.info("remote tier: agent %s, arena registered once (%d MiB), Remote service on %s (%s)",
                  self.agent_name, self.nbytes >> 20, self.endpoint, self.auth_mode)
        if self._secret is None and self._tls is None:
            _log.warning("remote endpoint %s is UNAUTHENTICATED: any host that reaches it can attach and read "
                         "the arena; pass secret= and/or tls= to remote_extension() (shmtransport daemon: "
                         "--remote-secret-file, --remote-tls-*)", self.endpoint)
        elif self._tls is None:
            _log.warning("remote endpoint %s checks a shared secret without TLS: the secret crosses the "
                         "network in clear text; add tls= to remote_extension() (--remote-tls-*)", self.endpoint)
        return self.stop

    def stop(self) -> None:
        """Close every remote session (reclaiming leases), deregister, unmap. Idempotent."""
        self._stopping.set()
        with self._lock:
            tokens, self._tokens = dict(self._tokens), {}
        for session_id in tokens.values():
            self._close_session(session_id)
        if self.agent is not None and self._reg is not None:
            try:
                self.agent.deregister_memory(self._reg)
            except Exception:
                _log.exception("NIXL deregister_memory failed")
            self._reg = None
        self.agent = None
        if self._mmap is not None:
            try:
                self._mmap.close()
            except BufferError:
                _log.warning("arena mapping of the remote tier still viewed; left to the GC")
            self._mmap = None

    # -- authentication --------------------------------------------------------------------------
    @property
    def auth_mode(self) -> str:
        """How peers authenticate, for logs: shared secret, mutual TLS, both, or unauthenticated."""
        modes = [m for m, on in (("shared secret", self._secret), ("mutual TLS", self._tls)) if on is not None]
        return " + ".join(modes) or "unauthenticated"

    @property
    def registry(self) -> Registry:
        """The daemon's (default tenant's) registry: remote peers' sessions and leases live there."""
        registry = self.daemon.registry
        if registry is None:
            raise Unavailable("the daemon has no registry (not started)")
        return registry

    def authenticate(self, context: grpc.ServicerContext) -> None:
        """Abort with UNAUTHENTICATED unless the call carries the shared secret (when one is set).
        The TLS handshake (client certificate) happened before any call reached us."""
        if self._secret is not None and not secret_matches(context.invocation_metadata(), self._secret):
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong remote secret")

    # -- sessions --------------------------------------------------------------------------------
    def open_session(self, peer: str) -> tuple[str, str]:
        """Open a daemon session for a remote peer; its (session id, token). Thread-safe."""
        session_id = f"remote-{secrets.token_hex(6)}"
        token = secrets.token_hex(16)
        # pid 0: a remote peer. It copies the bytes out (no view), so its expired leases are reclaimed.
        self.registry.open_session(session_id, 0, os.getuid(), quarantine_expired=False, holder_bit=False)
        with self._lock:
            self._tokens[token] = session_id
            self.sessions_total += 1
        _log.info("remote peer %r attached as session %s", peer, session_id)
        return session_id, token

    def end_session(self, token: str) -> None:
        """Close the session of ``token``, releasing its leases; unknown tokens are ignored."""
        with self._lock:
            session_id = self._tokens.pop(token, None)
        if session_id is not None:
            self._close_session(session_id)

    def _close_session(self, session_id: str) -> None:
        try:
            self.registry.close_session(session_id)  # releases its leases
        except Exception:
            _log.exception("closing remote session %s failed", session_id)

    def session_for(self, context: grpc.ServicerContext) -> str:
        """The session id of the call's token; PermissionDenied if it has none or an unknown one."""
        for key, value in context.invocation_metadata():
            if key == REMOTE_SESSION_METADATA_KEY:
                with self._lock:
                    session_id = self._tokens.get(value) if isinstance(value, str) else None
                if session_id is not None:
                    return session_id
                break
        raise PermissionDenied("missing or unknown remote session token: Attach first")

    @property
    def live_sessions(self) -> int:
        """Number of remote sessions open now."""
        with self._lock:
            return len(self._tokens)

    def region(self, offset: int, nbytes: int) -> rpb.NixlRegion:
        """The NIXL region of ``nbytes`` at ``offset`` in the arena; InvalidArgument past its end."""
        if offset + nbytes > self.nbytes:
            raise InvalidArgument(f"range [{offset}, {offset + nbytes}) outside the arena")
        return rpb.NixlRegion(addr=self.base_addr + offset, nbytes=nbytes, dev_id=0)

    def __repr__(self) -> str:
        return f"RemoteExtension({self.agent_name}, endpoint={self.endpoint!r}, sessions={self.live_sessions})"


class _RemoteServicer(rpb_grpc.RemoteServicer):
    def __init__(self, ext: RemoteExtension) -> None:
        self._ext = ext

    def Describe(self, request: rpb.DescribeRequest, context: grpc.ServicerContext) -> rpb.RemoteInfo:
        ext = self._ext
        if not context.peer().startswith("unix:"):  # a local producer's exporter asks over the socket
            ext.authenticate(context)
        return rpb.RemoteInfo(
            instance_id=ext.daemon.instance_id,
            shm_namespace=ext.daemon.arena_info.shm_namespace,
            endpoint=ext.endpoint,
            agent_name=ext.agent_name,
            transport=TRANSPORT,
        )

    def Attach(self, request: rpb.AttachRequest, context: grpc.ServicerContext) -> Iterator[rpb.AttachEvent]:
        ext = self._ext
        ext.authenticate(context)
        if ext._stopping.is_set():
            raise Unavailable("daemon stopping")
        _, token = ext.open_session(request.peer_name)
        ended = threading.Event()
        context.add_callback(ended.set)  # the peer went away (or the server is stopping)
        try:
            yield rpb.AttachEvent(
                session_token=token,
                agent_name=ext.agent_name,
                agent_metadata=ext.agent_metadata,
                instance_id=ext.daemon.instance_id,
                shm_namespace=ext.daemon.arena_info.shm_namespace,
            )
            while not ended.wait(_STREAM_POLL_S):
                if ext._stopping.is_set() or not context.is_active():
                    break
        finally:
            ext.end_session(token)

    def RemoteAcquire(self, request: rpb.RemoteAcquireRequest, context: grpc.ServicerContext
                      ) -> rpb.RemoteAcquireResponse:
        from ..daemon.server import bounded_wait

        ext = self._ext
        ext.authenticate(context)
        wait_s = bounded_wait(ext.daemon.config.commit_wait_s, context)
        session_id = ext.session_for(context)
        if not request.tensors:
            raise InvalidArgument("tensors must not be empty")
        handles = [t.shm for t in request.tensors]
        arena = ext.daemon.arena_info.segment_name
        for h in handles:
            # Only the arena is registered with NIXL: a region for another segment (a dedicated
            # loan's own segment) would name whatever arena bytes sit at its offset.
            if h.name != arena:
                raise InvalidArgument(f"handle of segment {h.name!r} cannot be read remotely: the remote tier "
                                      f"serves the arena only (dedicated-segment loans are node-local)")
        tokens = [t.commit_token for t in request.tensors]
        lease_ids = ext.registry.acquire(
            session_id, handles, request.ttl_ms, wait_s, tokens if any(tokens) else ()
        )
        regions = [ext.region(h.offset, h.nbytes) for h in handles]
        return rpb.RemoteAcquireResponse(lease_ids=lease_ids, regions=regions)

    def RemoteRelease(self, request: rpb.RemoteReleaseRequest, context: grpc.ServicerContext
                      ) -> rpb.RemoteReleaseResponse:
        self._ext.authenticate(context)
        session_id = self._ext.session_for(context)
        self._ext.registry.release(session_id, (), request.lease_ids)
        return rpb.RemoteReleaseResponse()


def remote_extension(
    listen_host: str = "127.0.0.1",
    listen_port: int = 0,
    advertise_host: str | None = None,
    on_install: Callable[[RemoteExtension], None] | None = None,
    *,
    secret: str | None = None,
    tls: RemoteTLS | None = None,
) -> RemoteInstall:
    """A ``Daemon`` extension serving the remote tier.

    ``listen_host``/``listen_port``: the TCP address remote peers dial (default loopback, any free
    port); ``advertise_host``: the host written into descriptors (default ``listen_host``);
    ``on_install`` receives the ``RemoteExtension`` (endpoint, agent).
    ``secret``: a shared secret every peer call must carry (``RemoteReader(secret=...)``);
    ``tls``: a ``RemoteTLS`` (this daemon's certificate and key, the CA of the peers' client
    certificates): TLS on the TCP port, client certificates required. Neither: unauthenticated
    (a warning at start).
    """
    # Bad options fail here, not inside Daemon.start.
    check_secret(secret)
    if tls is not None and not isinstance(tls, RemoteTLS):
        raise InvalidArgument("tls must be a shmtransport.remote.RemoteTLS")

    def install(daemon: Daemon, server: grpc.Server) -> Callable[[], None]:
        ext = RemoteExtension(daemon, listen_host, listen_port, advertise_host, secret, tls)
        stop = ext.install(server)
        if on_install is not None:
            on_install(ext)
        return stop

    return install
