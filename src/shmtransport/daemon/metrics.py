"""Prometheus metrics over HTTP, read from the same numbers as Stat.

Served on ``metrics_address``: ``"HOST:PORT"`` (TCP) or ``"unix:/path"`` (a Unix socket, mode 0600:
only the daemon's user can scrape it, e.g. through a local agent). ``metrics_port`` is shorthand
for ``"127.0.0.1:PORT"``.
"""
from __future__ import annotations

import collections
import errno
import logging
import os
import socket
import socketserver
import stat
import tempfile
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler
from typing import Callable

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import MetricsHandler

from ..errors import InvalidArgument, PermissionDenied
from ..v1 import daemon_pb2 as pb

# Each tenant's key and how to read its state now (the daemon's Stat for it).
TenantStats = Callable[[], list[tuple[str, Callable[[], pb.StatResponse]]]]

_log = logging.getLogger("shmtransport.daemon")
_GAUGES = {
    "used_nbytes": "Arena bytes held by live objects",
    "free_nbytes": "Arena bytes neither used nor granted",
    "granted_nbytes": "Arena bytes granted to producers for the object table (their objects count in used too)",
    "largest_free_nbytes": "Largest free extent in bytes",
    "free_extents": "Number of free extents (fragmentation)",
    "live_objects": "Live allocations",
    "live_leases": "Live consumer leases",
    "table_objects": "Live objects in the object table (every live object: the same as live_objects)",
    "handoff_objects": "Committed objects in the object table waiting for a first acquire",
    "quarantined_leases": "Leases past their TTL whose client lives: bytes kept, never reused under a view",
    "quarantined_nbytes": "Bytes under quarantined leases",
    "dedicated_nbytes": "Bytes in dedicated segments (outside the arena)",
    "quota_nbytes": "Bytes the tenant may hold (arena and dedicated)",
    "allocations_per_s": "Allocations per second over the last 5 s",
    "waiting_calls": "Calls waiting in the daemon: loans and grants for space, acquires for a commit",
}
_COUNTERS = {
    "allocations_total": "Allocations made",
    "allocation_failures": "Allocations refused (arena full or quota)",
    "reclaimed_ttl_nbytes": "Bytes freed by hold expiry and remote peers' lease TTL",
    "reclaimed_ttl_leases": "Remote peers' leases expired by TTL",
    "quarantined_leases_total": "Leases quarantined after outliving their TTL",
    "reclaimed_death_nbytes": "Bytes freed because their holder's session died",
    "reclaimed_death_leases": "Consumer leases dropped because their holder's session died",
    "reclaimed_death_loans": "Loans never committed, dropped because their producer's session died",
    "reclaimed_handoff_objects": "Committed objects reclaimed because nobody acquired them within the hand-off window",
    "reclaimed_handoff_nbytes": "Bytes of the objects reclaimed at the end of their hand-off window",
    "sessions_total": "Client sessions opened",
    "sessions_closed": "Client sessions ended by the client (Close), observers' apart; the others ended by a death",
    "observer_sessions_closed": "Sessions ended by Close that only asked for Stat or List and held nothing",
    "released_at_close_leases": "Consumer leases still held by clients that closed their session, released then",
    "released_at_close_loans": "Loans never committed by clients that closed their session, released then",
    "released_at_close_nbytes": "Bytes freed when clients closed their session",
    "cpu_share_waits": "Calls that waited for the tenant's share of the daemon's CPU while another tenant was active",
    "cpu_share_refusals": "Calls refused because waiting for the tenant's CPU share would outlast their deadline",
}
UNIX_PREFIX = "unix:"
_PROBE_TIMEOUT_S = 1.0


class _DaemonCollector:
    def __init__(self, tenant_stats: TenantStats) -> None:
        self._tenant_stats = tenant_stats

    def collect(self) -> Iterator[Metric]:
        """Every metric once per tenant, labelled with it. A tenant whose state cannot be read
        (a bug, or what one of its clients wrote) is left out, never the others with it."""
        stats = []
        for key, read in self._tenant_stats():
            try:
                stats.append(read())
            except Exception:  # noqa: BLE001 - one tenant's failure stays that tenant's
                _log.exception("metrics: cannot read the state of tenant %s", key)
        arena = GaugeMetricFamily("shmtransport_arena_nbytes", "Arena size in bytes", labels=["tenant"])
        gauges = {f: GaugeMetricFamily(f"shmtransport_{f}", doc, labels=["tenant"]) for f, doc in _GAUGES.items()}
        counters = {f: CounterMetricFamily(f"shmtransport_{f.removesuffix('_total')}", doc, labels=["tenant"])
                    for f, doc in _COUNTERS.items()}
        per_client = GaugeMetricFamily("shmtransport_client_leases",
                                       "Live leases the daemon holds, by client process", labels=["tenant", "pid"])
        families: list[tuple[str, GaugeMetricFamily | CounterMetricFamily]] = [*gauges.items(), *counters.items()]
        for tenant_stat in stats:
            arena.add_metric([tenant_stat.tenant], tenant_stat.arena.nbytes)
            for field, family in families:
                family.add_metric([tenant_stat.tenant], getattr(tenant_stat, field))
            # One sample per process: its sessions (a Producer and a Consumer, say) share the labels.
            leases_by_pid: collections.Counter[int] = collections.Counter()
            for client in tenant_stat.clients:
                leases_by_pid[client.pid] += client.leases
            for pid, leases in leases_by_pid.items():
                per_client.add_metric([tenant_stat.tenant, str(pid)], leases)
        yield arena
        yield from gauges.values()
        yield from counters.values()
        yield per_client


def metrics_address(metrics_port: int | None, address: str | None) -> str | None:
    """The address to serve on: ``address``, else ``127.0.0.1:metrics_port``, else None (off)."""
    if address is not None and metrics_port is not None:
        raise InvalidArgument("set metrics_port or metrics_address, not both")
    if metrics_port is not None:
        return f"127.0.0.1:{metrics_port}"
    return address


class _UnixHandler(MetricsHandler):
    def address_string(self) -> str:  # a Unix peer has no host (client_address is "")
        return "unix"


class _UnixMetricsServer(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    """HTTP metrics on a Unix socket created 0600; ``server_close`` removes it (if still ours)."""

    daemon_threads = True

    def __init__(self, path: str, handler: type[BaseHTTPRequestHandler]) -> None:
        _refuse_live_socket(path)
        super().__init__(path, handler, bind_and_activate=False)
        # Bound inside a private directory, made 0600, then linked into place (link never replaces
        # what appeared there meanwhile): the socket is never reachable with a wider mode.
        directory = os.path.dirname(path)
        try:
            private = tempfile.mkdtemp(prefix=".shmt-metrics-", dir=directory)
        except OSError as exc:  # its text names the staging directory, never the path the user gave
            self.socket.close()
            raise OSError(exc.errno, f"cannot serve metrics on {UNIX_PREFIX}{path}: cannot create a socket in "
                                     f"{directory}: {exc.strerror}") from None
        staged = os.path.join(private, "s")
        try:
            self.socket.bind(staged)
            os.chmod(staged, 0o600)
            self.server_activate()
            os.link(staged, path)
        except FileExistsError:
            self.socket.close()
            raise PermissionDenied(f"metrics socket {path!r} appeared while binding: in use") from None
        except BaseException:
            self.socket.close()
            raise
        finally:
            try:
                os.unlink(staged)
            except FileNotFoundError:
                pass
            os.rmdir(private)
        self.path = path
        self._ino = os.stat(path).st_ino

    def server_close(self) -> None:
        super().server_close()
        try:
            if os.stat(self.path).st_ino == self._ino:
                os.unlink(self.path)
        except FileNotFoundError:
            pass


def _refuse_live_socket(path: str) -> None:
    """PermissionDenied if ``path`` is a socket something answers on, or not a socket at all; a stale
    socket (nobody listening) is removed."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise PermissionDenied(f"metrics address {path!r} exists and is not a socket: not replacing it")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(_PROBE_TIMEOUT_S)
    try:
        probe.connect(path)
    except OSError as exc:
        if exc.errno != errno.ECONNREFUSED:
            raise PermissionDenied(f"metrics socket {path!r} cannot be probed: {exc}") from exc
    else:
        raise PermissionDenied(f"metrics socket {path!r} is in use by another process")
    finally:
        probe.close()
    os.unlink(path)


def start_metrics_server(tenant_stats: TenantStats, address: str) -> socketserver.BaseServer:
    """Serve the metrics of the tenants ``tenant_stats`` lists on ``address`` (``HOST:PORT`` or
    ``unix:/path``) from a thread; the server answers ``shutdown()`` and ``server_close()``."""
    registry = CollectorRegistry()
    registry.register(_DaemonCollector(tenant_stats))
    if address.startswith(UNIX_PREFIX):
        path = address[len(UNIX_PREFIX):]
        if not os.path.isabs(path):
            raise InvalidArgument(f"metrics address {address!r}: the Unix socket path must be absolute")
        unix_server = _UnixMetricsServer(path, _UnixHandler.factory(registry))
        threading.Thread(target=unix_server.serve_forever, name="shmt-metrics", daemon=True).start()
        return unix_server
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise InvalidArgument(f"metrics address {address!r} is neither HOST:PORT nor unix:/path")
    try:
        server, _thread = start_http_server(int(port), addr=host.strip("[]"), registry=registry)
    except OSError as exc:  # e.g. EADDRINUSE, whose text names no address
        raise OSError(exc.errno, f"cannot serve metrics on {address}: {exc.strerror}") from exc
    return server
