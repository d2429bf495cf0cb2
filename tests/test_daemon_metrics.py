"""The daemon's Prometheus endpoint reports the same numbers as Stat."""
from __future__ import annotations

import socket
import urllib.request

import numpy as np

from shmtransport.client import Consumer, Producer


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _scrape(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            samples[name] = float(value)
    return samples


def test_metrics_endpoint_reports_arena_objects_leases_and_reclaim_counters(make_daemon):
    port = _free_port()
    daemon = make_daemon(metrics_port=port)
    with Producer(daemon.socket_path, timeout_s=10) as producer, Consumer(daemon.socket_path, timeout_s=10) as consumer:
        handle = producer.put(np.arange(4096, dtype=np.uint8))
        lease = consumer.acquire(handle)
        held = _scrape(port)
        assert held["shmtransport_arena_nbytes"] == daemon.arena_info.nbytes
        assert held["shmtransport_live_objects"] == 1
        assert held["shmtransport_live_leases"] == 1
        assert held["shmtransport_used_nbytes"] >= 4096
        assert held["shmtransport_allocations_total"] >= 1
        assert any(name.startswith("shmtransport_client_leases{") and v == 1 for name, v in held.items())
        lease.release()
        producer.release(handle, wait=True)
        consumer.flush()
        done = _scrape(port)
    assert done["shmtransport_live_objects"] == 0
    assert done["shmtransport_live_leases"] == 0
    assert done["shmtransport_used_nbytes"] == 0
