"""The console script from the outside: ``--version``, ``ls``, ``stat --json``, ``health``, and one
clear line (exit 2) for every mistake on the command line. Each call is a real process."""
from __future__ import annotations

import gc
import importlib.util
import json
import os
import select
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from shmtransport import BACKEND, __version__
from shmtransport.client import Consumer, Producer
from shmtransport.testing import BlockingChild, remove_tree, segments_of, short_tmpdir, wait_until

TIMEOUT_S = 60
MiB = 1 << 20


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "shmtransport", *args], capture_output=True, text=True,
                          timeout=TIMEOUT_S)


@pytest.fixture
def tmpdir_short():
    path = short_tmpdir()
    yield path
    remove_tree(path)


def test_version_names_the_package_version_and_the_kernels():
    result = run_cli("--version")
    assert result.returncode == 0
    assert result.stdout.strip() == f"shmtransport {__version__} (kernels: {BACKEND})"


def _listening_port() -> tuple[socket.socket, int]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(1)
    return sock, sock.getsockname()[1]


REMOTE_MISTAKES = {
    "remote flag without --remote": (["--remote-advertise", "node-a"], "need --remote HOST:PORT"),
    "remote not host:port": (["--remote", "7400"], "not HOST:PORT"),
    "remote tls incomplete": (["--remote", "127.0.0.1:0", "--remote-tls-cert", "c.pem"], "needs all of"),
    "remote secret too short": (["--remote", "127.0.0.1:0", "--remote-secret-file", "SECRET"], "at least 16"),
}


@pytest.mark.parametrize("mistake", ["arena 0", "size typo", "negative size", "socket path too long",
                                     "metrics port in use", "unknown flag", "bad number", *REMOTE_MISTAKES])
def test_a_command_line_mistake_is_one_line_and_exit_2(mistake, tmpdir_short, new_prefix):
    prefix = new_prefix()
    sock = os.path.join(tmpdir_short, "d.sock")
    base = ["daemon", "--socket", sock, "--name-prefix", prefix]
    busy = None
    args = {
        "arena 0": base + ["--arena-size", "0"],
        "size typo": base + ["--arena-size", "8GB2"],
        "negative size": base + ["--arena-size=-4M"],
        "socket path too long": ["daemon", "--socket", os.path.join(tmpdir_short, "s" * 120 + ".sock"),
                                 "--arena-size", "4M", "--name-prefix", prefix],
        "unknown flag": ["ls", "--colour"],
        "bad number": ["ls", "--limit", "-1"],
    }.get(mistake)
    if mistake == "metrics port in use":
        busy, port = _listening_port()
        args = base + ["--arena-size", "4M", "--metrics-port", str(port)]
    if mistake in REMOTE_MISTAKES:
        secret_file = os.path.join(tmpdir_short, "secret")
        with open(secret_file, "w") as f:
            f.write("short\n")
        flags = [secret_file if flag == "SECRET" else flag for flag in REMOTE_MISTAKES[mistake][0]]
        args = base + ["--arena-size", "4M", *flags]
    try:
        result = run_cli(*args)
    finally:
        if busy is not None:
            busy.close()
    assert result.returncode == 2, result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    expected = {"arena 0": "4 KiB page", "size typo": "not a size", "negative size": "negative",
                "socket path too long": "at most 107", "metrics port in use": "cannot start",
                "unknown flag": "--colour", "bad number": "negative",
                **{name: words for name, (_, words) in REMOTE_MISTAKES.items()}}[mistake]
    assert expected in lines[0]
    assert segments_of(prefix) == []  # a failed start leaves nothing behind


def _cli_json(*args: str) -> dict:
    result = run_cli(*args, "--json")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


@pytest.mark.parametrize("object_slots", [None, 0], ids=["table", "rpc"])
def test_ls_lists_every_live_object_with_its_state_owner_and_holders(make_daemon, object_slots):
    daemon = make_daemon(object_slots=object_slots)
    sock = daemon.socket_path
    with Producer(sock, timeout_s=TIMEOUT_S) as producer, Consumer(sock, timeout_s=TIMEOUT_S) as consumer:
        held = producer.put(np.ones(2 * MiB, np.uint8))
        lease = consumer.acquire(held)
        waiting = producer.put(np.ones(MiB, np.uint8))  # committed, nobody acquired it yet
        loan = producer.loan(4096)
        listing = _cli_json("ls", "--socket", sock)
        by_size = {int(o["nbytes"]): o for o in listing["objects"]}
        assert int(listing["total_objects"]) == 3 and sorted(by_size) == [4096, MiB, 2 * MiB]
        big, mid, small = by_size[2 * MiB], by_size[MiB], by_size[4096]
        assert (big["state"], big["handoff"], mid["state"], mid["handoff"], small["state"]) == (
            "committed", False, "committed", True, "loaned")
        me = os.getpid()
        assert {big["owner_pid"], mid["owner_pid"], small["owner_pid"]} == {me}
        assert big["owner_session"] == producer.session_id
        assert big["holder_pids"] == [me] and big["holder_sessions"] == [consumer.session_id]
        assert mid["holder_pids"] == [] and small["holder_pids"] == []
        assert big["age_s"] >= 0
        # The CLI's own session is not listed among the clients.
        assert {c["session_id"] for c in listing["clients"]} == {producer.session_id, consumer.session_id}
        # Filters.
        assert [int(o["nbytes"]) for o in _cli_json("ls", "--socket", sock, "--state", "handoff")["objects"]] == [MiB]
        assert [int(o["nbytes"])
                for o in _cli_json("ls", "--socket", sock, "--min-size", "1.5M")["objects"]] == [2 * MiB]
        assert _cli_json("ls", "--socket", sock, "--pid", "1")["objects"] == []
        assert len(_cli_json("ls", "--socket", sock, "--session", consumer.session_id[:8])["objects"]) == 1
        assert [int(o["nbytes"]) for o in _cli_json("ls", "--socket", sock, "--limit", "1")["objects"]] == [2 * MiB]
        table = run_cli("ls", "--socket", sock)
        assert table.returncode == 0 and "3 shown of 3 live objects" in table.stdout
        lease.release()
        loan.release()
        for h in (held, waiting):
            producer.release(h)


def test_ls_shows_a_handed_off_object_whose_producer_is_gone(make_daemon):
    daemon = make_daemon()
    with Producer(daemon.socket_path, timeout_s=TIMEOUT_S) as producer:
        handle = producer.put(np.ones(4096, np.uint8))
    [obj] = _cli_json("ls", "--socket", daemon.socket_path)["objects"]
    assert (obj["owner_pid"], obj["owner_session"], obj["handoff"]) == (0, "", True)
    with Consumer(daemon.socket_path, timeout_s=TIMEOUT_S) as consumer:
        consumer.acquire(handle).release()
    wait_until(lambda: daemon.stat().live_objects == 0, what="the handed-off object released")


def test_stat_json_parses_and_leaves_out_the_clis_own_session(make_daemon):
    daemon = make_daemon()
    with Producer(daemon.socket_path, timeout_s=TIMEOUT_S) as producer:
        handle = producer.put(np.ones(MiB, np.uint8))
        stat = _cli_json("stat", "--socket", daemon.socket_path)
        assert [c["session_id"] for c in stat["clients"]] == [producer.session_id]
        assert int(stat["arena"]["nbytes"]) == daemon.arena_info.nbytes and int(stat["used_nbytes"]) >= MiB
        text = run_cli("stat", "--socket", daemon.socket_path)
        assert text.returncode == 0 and "clients         1" in text.stdout
        producer.release(handle)


def test_health_is_one_line_ok_with_a_daemon_and_unhealthy_without(make_daemon, tmpdir_short):
    daemon = make_daemon()
    ok = run_cli("health", "--socket", daemon.socket_path)
    assert ok.returncode == 0 and ok.stdout.startswith("ok: shmtransportd ") and len(ok.stdout.splitlines()) == 1
    report = _cli_json("health", "--socket", daemon.socket_path)
    assert (report["status"], report["instance_id"], report["clients"]) == ("ok", daemon.instance_id, 0)
    missing = run_cli("health", "--socket", os.path.join(tmpdir_short, "nobody.sock"), "--timeout-s", "2")
    assert missing.returncode == 1 and missing.stdout.startswith("unhealthy: ")
    assert len(missing.stdout.splitlines()) == 1 and not missing.stderr


def _line_with(stream, words: str) -> str:
    deadline = time.monotonic() + TIMEOUT_S
    while time.monotonic() < deadline:
        ready, _, _ = select.select([stream], [], [], deadline - time.monotonic())
        line = stream.readline() if ready else ""
        if words in line or not ready or not line:
            return line
    return ""


@pytest.mark.skipif(not any(importlib.util.find_spec(m) for m in ("nixl_cu12", "nixl")),
                    reason="could not import NIXL (the nixl extra)")
def test_daemon_flags_start_the_remote_tier_with_a_secret_from_a_file(tmpdir_short, new_prefix):
    import grpc

    from shmtransport.remote.auth import SECRET_METADATA_KEY
    from shmtransport.v1 import remote_pb2 as rpb
    from shmtransport.v1 import remote_pb2_grpc as rpb_grpc

    prefix = new_prefix()
    secret, secret_file = "s3cret-" + os.urandom(12).hex(), os.path.join(tmpdir_short, "secret")
    with open(secret_file, "w") as f:
        f.write(secret + "\n")
    proc = subprocess.Popen([sys.executable, "-m", "shmtransport", "daemon", "--socket",
                             os.path.join(tmpdir_short, "d.sock"), "--name-prefix", prefix, "--arena-size", "8M",
                             "--remote", "127.0.0.1:0", "--remote-secret-file", secret_file],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = _line_with(proc.stdout, "shmtransportd ready")  # NIXL logs its own lines on stdout first
        endpoint = line.split("remote ", 1)[1].split()[0]
        assert endpoint.startswith("127.0.0.1:") and "(shared secret)" in line
        with grpc.insecure_channel(endpoint) as channel:
            stub = rpb_grpc.RemoteStub(channel)
            with pytest.raises(grpc.RpcError) as refused:
                stub.Describe(rpb.DescribeRequest(), timeout=TIMEOUT_S)
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
            described = stub.Describe(rpb.DescribeRequest(), metadata=((SECRET_METADATA_KEY, secret),),
                                      timeout=TIMEOUT_S)
            assert described.endpoint == endpoint
        assert secret not in " ".join(proc.args)  # never on the command line, where ps shows it
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=TIMEOUT_S)
    assert proc.returncode == 0, err
    assert segments_of(prefix) == []


def _hold_a_lease(conn, socket_path: str, handle_bytes: bytes) -> None:
    from shmtransport import Consumer, Handle

    consumer = Consumer(socket_path, timeout_s=TIMEOUT_S)
    lease = consumer.acquire(Handle.from_bytes(handle_bytes))
    conn.send(int(lease.handle.nbytes))
    conn.recv()  # killed here


@pytest.mark.parametrize("object_slots", [None, 0], ids=["table", "rpc"])
def test_stat_counts_only_a_kill_as_a_death_and_what_a_close_left_as_released_at_close(make_daemon, object_slots):
    daemon = make_daemon(object_slots=object_slots)
    sock = daemon.socket_path
    with Producer(sock, timeout_s=TIMEOUT_S) as producer:
        killed = producer.put(np.ones(2 * MiB, np.uint8))
        with Consumer(sock, timeout_s=TIMEOUT_S) as consumer:  # an ordinary close: not a death
            consumer.acquire(killed).release()
        left_open = Producer(sock, timeout_s=TIMEOUT_S)
        loan = left_open.loan(MiB)  # never committed nor released: the close has to let it go
        left_open.close()
        del loan  # the close released it: no warning (the suite makes one an error)
        gc.collect()
        with BlockingChild(_hold_a_lease, sock, killed.to_bytes()) as child:
            assert child.recv() == 2 * MiB
            producer.release(killed, wait=True)  # the child's lease is the last reference
            child.kill()
            wait_until(lambda: daemon.stat().live_objects == 0, what="the dead child's lease reclaimed")
    stat = _cli_json("stat", "--socket", sock)
    assert (int(stat["reclaimed_death_leases"]), int(stat["reclaimed_death_nbytes"])) == (1, 2 * MiB)
    assert int(stat["sessions_closed"]) == 3  # both producers and the consumer; the child died
    # A table client releases its own objects in shared memory as it closes; through the daemon
    # (no table, or the pure-Python kernels), the loan is the daemon's to free at the close.
    released = (0, 0) if killed.shm.slot else (0, MiB)
    assert (int(stat["released_at_close_leases"]), int(stat["released_at_close_nbytes"])) == released
    text = run_cli("stat", "--socket", sock).stdout
    assert "reclaimed (death) 1 leases" in text and "(4 sessions closed)" in text  # the CLI closed one too
