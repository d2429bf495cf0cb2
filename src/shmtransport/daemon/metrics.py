"""Prometheus metrics over HTTP (``--metrics-port``), read from the same numbers as Stat."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

_GAUGES = {
    "used_nbytes": "Arena bytes held by live objects",
    "free_nbytes": "Arena bytes free",
    "largest_free_nbytes": "Largest free extent in bytes",
    "free_extents": "Number of free extents (fragmentation)",
    "live_objects": "Live allocations",
    "live_leases": "Live consumer leases",
    "allocations_per_s": "Allocations per second over the last 5 s",
}
_COUNTERS = {
    "allocations_total": "Allocations made",
    "allocation_failures": "Allocations refused (arena full or quota)",
    "reclaimed_ttl_nbytes": "Bytes freed by lease/hold TTL expiry",
    "reclaimed_ttl_leases": "Leases expired by TTL",
    "reclaimed_death_nbytes": "Bytes freed because their holder's session died",
    "reclaimed_death_leases": "Leases dropped because their holder's session died",
    "sessions_total": "Client sessions opened",
}


class _DaemonCollector:
    def __init__(self, daemon):
        self._daemon = daemon

    def collect(self):
        stat = self._daemon.stat()
        yield GaugeMetricFamily("shmtransport_arena_nbytes", "Arena size in bytes", value=stat.arena.nbytes)
        for field, doc in _GAUGES.items():
            yield GaugeMetricFamily(f"shmtransport_{field}", doc, value=getattr(stat, field))
        for field, doc in _COUNTERS.items():
            name = f"shmtransport_{field.removesuffix('_total')}"
            yield CounterMetricFamily(name, doc, value=getattr(stat, field))
        per_client = GaugeMetricFamily("shmtransport_client_leases", "Live leases by client", labels=["pid"])
        for client in stat.clients:
            per_client.add_metric([str(client.pid)], client.leases)
        yield per_client


def start_metrics_server(daemon, port: int):
    registry = CollectorRegistry()
    registry.register(_DaemonCollector(daemon))
    server, _thread = start_http_server(port, addr="127.0.0.1", registry=registry)
    return server
