"""The daemon's Prometheus endpoint reports the same numbers as Stat, on TCP or on a Unix socket."""
from __future__ import annotations

import http.client
import os
import socket
import stat
import urllib.request

import numpy as np
import pytest

from shmtransport import objtable, testing
from shmtransport.cli import build_parser
from shmtransport.client import Consumer, Producer
from shmtransport.daemon.metrics import metrics_address, start_metrics_server
from shmtransport.errors import InvalidArgument, PermissionDenied


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _samples(text: str) -> dict[str, float]:
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            samples[name] = float(value)
    return samples


TENANT = f'{{tenant="uid:{os.geteuid()}"}}'  # every metric is labelled with its tenant


def _client_leases(samples: dict[str, float], pid: int) -> float:
    """The one shmtransport_client_leases sample of process ``pid``."""
    [value] = [v for name, v in samples.items()
               if name.startswith("shmtransport_client_leases{") and f'pid="{pid}"' in name]
    return value


def _scrape(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        return _samples(response.read().decode())


class _UnixHTTPConnection(http.client.HTTPConnection):
    def __init__(self, path: str):
        super().__init__("localhost", timeout=5)
        self._path = path

    def connect(self):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(self.timeout)
        self.sock.connect(self._path)


def _scrape_unix(path: str) -> dict[str, float]:
    conn = _UnixHTTPConnection(path)
    try:
        conn.request("GET", "/metrics")
        response = conn.getresponse()
        assert response.status == 200
        return _samples(response.read().decode())
    finally:
        conn.close()


@pytest.fixture
def sock_dir():
    path = testing.short_tmpdir()
    yield path
    testing.remove_tree(path)


@pytest.mark.parametrize("shared_table", [True, False], ids=["default", "no_table"])
def test_metrics_endpoint_reports_arena_objects_leases_and_reclaim_counters(make_daemon, shared_table):
    port = _free_port()
    daemon = make_daemon(metrics_port=port, share_object_table=shared_table, handoff_window_ms=1000)
    with Producer(daemon.socket_path, timeout_s=10) as producer, Consumer(daemon.socket_path, timeout_s=10) as consumer:
        handle = producer.put(np.arange(4096, dtype=np.uint8))
        in_table = shared_table and objtable.available()  # placed by the producer itself (else by the daemon)
        producer.stat()  # its Commit has landed (through the daemon it is sent without waiting)
        assert _scrape(port)["shmtransport_handoff_objects" + TENANT] == 1  # nobody acquired it yet
        lease = consumer.acquire(handle)
        held = _scrape(port)
        assert held["shmtransport_arena_nbytes" + TENANT] == daemon.arena_info.nbytes
        assert held["shmtransport_live_objects" + TENANT] == 1
        assert held["shmtransport_live_leases" + TENANT] == 1
        assert held["shmtransport_used_nbytes" + TENANT] >= 4096
        assert held["shmtransport_allocations_total" + TENANT] >= 1
        assert held["shmtransport_table_objects" + TENANT] == 1  # every object lives in the table
        assert held["shmtransport_handoff_objects" + TENANT] == 0  # the acquire took the hand-off over
        assert (held["shmtransport_granted_nbytes" + TENANT] >= 4096) == in_table
        # Per process, the leases the daemon holds: a lease in the table is the consumer's own bit.
        assert _client_leases(held, os.getpid()) == (not in_table)
        lease.release()
        producer.release(handle, wait=True)
        consumer.flush()
        done = _scrape(port)
        producer.put(np.arange(4096, dtype=np.uint8))  # handed off to a consumer that never comes
    assert done["shmtransport_live_objects" + TENANT] == 0
    assert done["shmtransport_live_leases" + TENANT] == 0
    assert done["shmtransport_used_nbytes" + TENANT] == 0
    reclaimed = testing.wait_until(
        lambda: (m := _scrape(port))["shmtransport_reclaimed_handoff_objects_total" + TENANT] == 1 and m,
        timeout_s=10, what="the hand-off window passed",
    )
    assert reclaimed["shmtransport_reclaimed_handoff_nbytes_total" + TENANT] == 4096
    assert reclaimed["shmtransport_live_objects" + TENANT] == 0


def test_metrics_address_tcp_binds_that_address(make_daemon):
    port = _free_port()
    daemon = make_daemon(metrics_address=f"127.0.0.1:{port}")
    assert _scrape(port)["shmtransport_arena_nbytes" + TENANT] == daemon.arena_info.nbytes


def test_a_tenant_whose_state_cannot_be_read_is_left_out_of_the_metrics_and_the_others_are_not(
        make_daemon, monkeypatch, caplog):
    port = _free_port()
    daemon = make_daemon(metrics_port=port, allowed_uids=(os.geteuid(), 65534))

    def unreadable():  # stands in for a bug in one tenant's books
        raise RuntimeError("unreadable")

    monkeypatch.setattr(daemon.tenants[1].registry, "stat", unreadable)
    samples = _scrape(port)
    assert samples["shmtransport_arena_nbytes" + TENANT] == daemon.arena_info.nbytes
    assert not [name for name in samples if 'tenant="uid:65534"' in name]
    assert "cannot read the state of tenant uid:65534" in caplog.text


def test_metrics_over_a_unix_socket_are_owner_only_and_removed_at_stop(make_daemon, sock_dir):
    path = os.path.join(sock_dir, "metrics.sock")
    daemon = make_daemon(metrics_address=f"unix:{path}")
    st = os.lstat(path)
    assert stat.S_ISSOCK(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600
    assert os.listdir(sock_dir) == ["metrics.sock"]  # the private staging directory is gone
    with Producer(daemon.socket_path, timeout_s=10) as producer:
        handle = producer.put(np.arange(4096, dtype=np.uint8))
        held = _scrape_unix(path)
        assert held["shmtransport_arena_nbytes" + TENANT] == daemon.arena_info.nbytes
        assert held["shmtransport_live_objects" + TENANT] == 1
        producer.release(handle, wait=True)
    assert _scrape_unix(path)["shmtransport_live_objects" + TENANT] == 0
    daemon.stop()
    assert not os.path.exists(path)


def test_metrics_unix_socket_refuses_a_live_one_and_replaces_a_stale_one(daemon, sock_dir):
    # start_metrics_server on a running daemon: what Daemon.start runs for metrics_address.
    path = os.path.join(sock_dir, "metrics.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as live:
        live.bind(path)
        live.listen(1)
        with pytest.raises(PermissionDenied, match="in use"):
            start_metrics_server(daemon.tenant_stats, f"unix:{path}")
        assert os.path.exists(path)  # someone else's socket: left alone
    # Closed: a stale socket file nobody listens on, taken over.
    server = start_metrics_server(daemon.tenant_stats, f"unix:{path}")
    try:
        assert _scrape_unix(path)["shmtransport_arena_nbytes" + TENANT] == daemon.arena_info.nbytes
    finally:
        server.shutdown()
        server.server_close()
    assert not os.path.exists(path)
    regular = os.path.join(sock_dir, "file")
    open(regular, "w").close()
    with pytest.raises(PermissionDenied, match="not a socket"):
        start_metrics_server(daemon.tenant_stats, f"unix:{regular}")


def test_metrics_address_is_validated_and_exclusive_with_metrics_port(daemon):
    for address in ("9100", "unix:relative.sock", "127.0.0.1:http"):
        with pytest.raises(InvalidArgument, match="metrics address"):
            start_metrics_server(daemon.tenant_stats, address)
    assert metrics_address(9100, None) == "127.0.0.1:9100"
    assert metrics_address(None, "unix:/run/m.sock") == "unix:/run/m.sock"
    with pytest.raises(InvalidArgument, match="not both"):
        metrics_address(9100, "127.0.0.1:9100")


def test_cli_daemon_accepts_metrics_address():
    args = build_parser().parse_args(["daemon", "--metrics-address", "unix:/run/shmt/metrics.sock"])
    assert args.metrics_address == "unix:/run/shmt/metrics.sock" and args.metrics_port is None
