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
from shmtransport.testing import BlockingChild, segments_of, wait_until

TIMEOUT_S = 60
MiB = 1 << 20


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "shmtransport", *args], capture_output=True, text=True,
                          timeout=TIMEOUT_S)


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
    if mistake == "metrics port in use":
        assert f"cannot serve metrics on 127.0.0.1:{port}: Address already in use" in lines[0]
    assert segments_of(prefix) == []  # a failed start leaves nothing behind


def _cli_json(*args: str) -> dict:
    result = run_cli(*args, "--json")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


@pytest.mark.parametrize("shared_table", [True, False], ids=["table", "rpc"])
def test_ls_lists_every_live_object_with_its_state_owner_and_holders(make_daemon, shared_table):
    daemon = make_daemon(share_object_table=shared_table)
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
    """The first line of a child's pipe that holds ``words``; "" when the child says nothing more
    within TIMEOUT_S or ends first. Reads the fd itself: ``select`` on the buffered stream missed
    lines its buffer already held (NIXL's log lines and ours arrive in one read), and waited out
    the whole timeout for a line it had."""
    fd, wanted = stream.fileno(), words.encode()
    deadline = time.monotonic() + TIMEOUT_S
    pending = b""
    while True:
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            if wanted in line:
                return line.decode()
        remaining = deadline - time.monotonic()
        if remaining <= 0 or not select.select([fd], [], [], remaining)[0]:
            return ""
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            return ""
        pending += chunk


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
    proc = subprocess.Popen([sys.executable, "-X", "faulthandler", "-m", "shmtransport", "daemon", "--socket",
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
        err = _terminate(proc)
    assert proc.returncode == 0, err
    assert segments_of(prefix) == []


def _terminate(proc: subprocess.Popen[str]) -> str:
    """SIGTERM, then its stderr; one that does not exit in time is made to dump every thread's
    stack (faulthandler, on SIGABRT) into the failure, and never outlives the test."""
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.communicate(timeout=TIMEOUT_S)[1]
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGABRT)
        _, err = proc.communicate(timeout=TIMEOUT_S)
        pytest.fail(f"the daemon did not exit within {TIMEOUT_S} s of SIGTERM; its threads:\n{err}")


def _hold_a_lease(conn, socket_path: str, handle_bytes: bytes) -> None:
    from shmtransport import Consumer, Handle

    consumer = Consumer(socket_path, timeout_s=TIMEOUT_S)
    lease = consumer.acquire(Handle.from_bytes(handle_bytes))
    conn.send(int(lease.handle.nbytes))
    conn.recv()  # killed here


@pytest.mark.parametrize("shared_table", [True, False], ids=["table", "rpc"])
def test_stat_counts_only_a_kill_as_a_death_and_what_a_close_left_as_released_at_close(make_daemon, shared_table):
    daemon = make_daemon(share_object_table=shared_table)
    sock = daemon.socket_path
    with Producer(sock, timeout_s=TIMEOUT_S) as producer:
        killed = producer.put(np.ones(2 * MiB, np.uint8))
        with Consumer(sock, timeout_s=TIMEOUT_S) as consumer:  # an ordinary close: not a death
            consumer.acquire(killed).release()
        left_open = Producer(sock, timeout_s=TIMEOUT_S)
        loan = left_open.loan(MiB)  # never committed nor released: the close has to let it go
        placed_itself = loan._placed is not None  # in its own grant (else the daemon placed it)
        left_open.close()
        del loan  # the close released it: no warning (the suite makes one an error)
        gc.collect()
        with BlockingChild(_hold_a_lease, sock, killed.to_bytes()) as child:
            assert child.recv() == 2 * MiB
            producer.release(killed, wait=True)  # the child's lease is the last reference
            child.kill()
            wait_until(lambda: daemon.stat().live_objects == 0, what="the dead child's lease reclaimed")
    stat = _cli_json("stat", "--socket", sock)
    assert (stat["reclaimed_death_leases"], stat["reclaimed_death_loans"], stat["reclaimed_death_nbytes"]) == (
        1, 0, 2 * MiB)
    assert stat["sessions_closed"] == 3  # both producers and the consumer; the child died
    # A table client releases its own objects in shared memory as it closes; through the daemon
    # (no table, or the pure-Python kernels), the loan is the daemon's to free at the close.
    released = (0, 0, 0) if placed_itself else (0, 1, MiB)
    assert (stat["released_at_close_leases"], stat["released_at_close_loans"],
            stat["released_at_close_nbytes"]) == released
    text = run_cli("stat", "--socket", sock).stdout
    # The CLI's own session of the stat above only looked: not one of the sessions closed.
    assert "reclaimed (death) 1 lease, 0 uncommitted loans" in text
    assert "(3 sessions closed; 1 more only looked" in text


def _ls_text(sock: str, *args: str) -> str:
    result = run_cli("ls", "--socket", sock, *args)
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_ls_says_the_daemon_cut_the_list_only_when_it_did_and_filters_objects_with_holders(make_daemon):
    daemon = make_daemon()
    sock = daemon.socket_path
    with Producer(sock, timeout_s=TIMEOUT_S) as producer, Consumer(sock, timeout_s=TIMEOUT_S) as consumer:
        leased = producer.put(np.ones(2 * MiB, np.uint8))
        lease = consumer.acquire(leased)
        waiting = producer.put(np.ones(MiB, np.uint8))
        loan = producer.loan(4096)
        # A filter hides objects; the daemon sent all three: no word of --limit.
        text = _ls_text(sock, "--state", "handoff")
        assert "1 shown of 3 live objects" in text and "2 hidden by the filters" in text
        assert "the daemon sent" not in text and "--limit" not in text
        # --limit cut the list: said, with how many were sent.
        text = _ls_text(sock, "--limit", "1")
        assert "1 shown of 3 live objects" in text and "the daemon sent the largest 1 only (--limit)" in text
        assert "hidden" not in text
        # Who holds memory: the objects with consumer leases, and only them.
        listing = _cli_json("ls", "--socket", sock, "--leased")
        assert [(o["nbytes"], o["holder_sessions"]) for o in listing["objects"]] == [(2 * MiB, [consumer.session_id])]
        text = _ls_text(sock, "--leased")
        assert "1 shown of 3 live objects" in text and "2 hidden by the filters" in text
        lease.release()
        wait_until(lambda: _cli_json("ls", "--socket", sock, "--leased")["objects"] == [],
                   timeout_s=TIMEOUT_S, what="the released lease gone from ls --leased")
        loan.release()
        for h in (leased, waiting):
            producer.release(h)


def test_stat_and_ls_json_print_counters_as_json_numbers(make_daemon):
    daemon = make_daemon()
    sock = daemon.socket_path
    with Producer(sock, timeout_s=TIMEOUT_S) as producer:
        handle = producer.put(np.ones(MiB, np.uint8))
        stat = _cli_json("stat", "--socket", sock)
        # 64-bit counters are numbers, not the strings of protobuf's JSON mapping: jq '.used_nbytes > 0' works.
        assert type(stat["used_nbytes"]) is int and stat["used_nbytes"] >= MiB
        assert type(stat["arena"]["nbytes"]) is int and stat["arena"]["nbytes"] == daemon.arena_info.nbytes
        assert type(stat["allocations_total"]) is int and type(stat["allocations_per_s"]) in (int, float)
        [client] = stat["clients"]
        assert type(client["pid"]) is int and type(client["committed_nbytes"]) is int
        assert client["committed_nbytes"] + client["table_committed_nbytes"] == MiB
        listing = _cli_json("ls", "--socket", sock)
        assert type(listing["total_objects"]) is int and listing["total_objects"] == 1
        [obj] = listing["objects"]
        assert (type(obj["offset"]), type(obj["nbytes"]), type(obj["generation"])) == (int, int, int)
        assert obj["nbytes"] == MiB and obj["holder_pids"] == [] and obj["state"] == "committed"
        report = _cli_json("health", "--socket", sock)
        assert report["status"] == "ok" and type(report["used_nbytes"]) is int
        producer.release(handle)


def test_ls_and_stat_into_a_pipe_whose_reader_is_gone_end_quietly(make_daemon):
    daemon = make_daemon()
    with Producer(daemon.socket_path, timeout_s=TIMEOUT_S) as producer:
        handles = [producer.put(np.ones(4096, np.uint8)) for _ in range(3)]
        for command in ("ls", "stat"):
            read_end, write_end = os.pipe()
            os.close(read_end)  # `shmtransport ls | head` once head has exited
            try:
                result = subprocess.run([sys.executable, "-m", "shmtransport", command, "--socket", daemon.socket_path],
                                        stdout=write_end, stderr=subprocess.PIPE, text=True, timeout=TIMEOUT_S)
            finally:
                os.close(write_end)
            # As a process SIGPIPE killed: no traceback, no "Exception ignored" at exit.
            assert (result.returncode, result.stderr) == (128 + signal.SIGPIPE, ""), (command, result.stderr)
        for h in handles:
            producer.release(h)


def _loan_and_wait(conn, socket_path: str, nbytes: int, count: int) -> None:
    from shmtransport import Producer

    producer = Producer(socket_path, timeout_s=TIMEOUT_S)
    loans = [producer.loan(nbytes) for _ in range(count)]  # never committed
    conn.send(sum(loan.handle.nbytes for loan in loans))
    conn.recv()  # killed here


@pytest.mark.parametrize("shared_table", [True, False], ids=["table", "rpc"])
def test_stat_counts_a_killed_producers_uncommitted_loans_as_loans_not_leases(make_daemon, shared_table):
    daemon = make_daemon(share_object_table=shared_table)
    sock = daemon.socket_path
    with BlockingChild(_loan_and_wait, sock, MiB, 2) as child:
        assert child.recv() == 2 * MiB
        child.kill()
    wait_until(lambda: daemon.stat().live_objects == 0, timeout_s=TIMEOUT_S, what="the dead producer's loans freed")
    stat = _cli_json("stat", "--socket", sock)
    assert (stat["reclaimed_death_leases"], stat["reclaimed_death_loans"], stat["reclaimed_death_nbytes"]) == (
        0, 2, 2 * MiB)
    text = run_cli("stat", "--socket", sock).stdout
    assert f"reclaimed (death) 0 leases, 2 uncommitted loans, {2 * MiB} bytes" in text


def test_stat_per_client_lines_count_the_leases_a_consumer_holds_in_the_object_table(make_daemon):
    daemon = make_daemon()
    sock = daemon.socket_path
    with Producer(sock, timeout_s=TIMEOUT_S) as producer, Consumer(sock, timeout_s=TIMEOUT_S) as consumer:
        handles = [producer.put(np.ones(4096, np.uint8)) for _ in range(5)]
        leases = [consumer.acquire(h) for h in handles]
        stat = _cli_json("stat", "--socket", sock)
        assert stat["live_leases"] == 5
        by_session = {c["session_id"]: c for c in stat["clients"]}
        mine = by_session[consumer.session_id]
        assert mine["leases"] + mine["table_leases"] == 5
        made = by_session[producer.session_id]
        assert made["leases"] + made["table_leases"] == 0
        assert made["committed_nbytes"] + made["table_committed_nbytes"] == 5 * 4096
        text = run_cli("stat", "--socket", sock).stdout
        assert "objects/leases  5 / 5" in text
        assert f"session {consumer.session_id[:8]}: loaned 0 B, committed 0 B, 5 leases" in text
        assert f"session {producer.session_id[:8]}: loaned 0 B, committed {5 * 4096} B, 0 leases" in text
        for lease in leases:
            lease.release()
        for h in handles:
            producer.release(h)


def test_the_clis_own_sessions_are_not_counted_as_closed_sessions(make_daemon):
    daemon = make_daemon()
    sock = daemon.socket_path
    with Producer(sock, timeout_s=TIMEOUT_S) as producer:
        handle = producer.put(np.ones(4096, np.uint8))
        with Consumer(sock, timeout_s=TIMEOUT_S) as consumer:
            consumer.acquire(handle).release()
        producer.release(handle)
    for looked, command in enumerate(("stat", "ls", "health", "stat")):
        if command != "stat":
            assert run_cli(command, "--socket", sock).returncode == 0
            continue
        stat = _cli_json("stat", "--socket", sock)
        # The producer and the consumer closed; the CLI's earlier runs only looked.
        assert (stat["sessions_closed"], stat["observer_sessions_closed"]) == (2, looked)
    assert "(2 sessions closed; 4 more only looked: stat, ls, health)" in run_cli("stat", "--socket", sock).stdout
