"""The daemon as a real process started by the CLI: signals, crash recovery, restarts, file modes,
and an arena larger than the memory available (a typed error at start, never an OOM later)."""
from __future__ import annotations

import os
import select
import signal
import stat
import subprocess
import sys

import numpy as np
import pytest

from shmtransport import objtable
from shmtransport.client import Consumer, Producer
from shmtransport.daemon import Daemon
from shmtransport.errors import PermissionDenied, Reason, ResourceExhausted, Unavailable
from shmtransport.testing import SHM_DIR, BlockingChild

MiB = 1 << 20
GiB = 1 << 30
ARENA_NBYTES = 16 * MiB
START_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 15.0
TIMEOUT_S = 10.0


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "shmtransport", *args]


def segments(prefix: str) -> list[str]:
    return sorted(name for name in os.listdir(SHM_DIR) if name.startswith(prefix + "-"))


# Both paths: the object table (the default where the C kernels are) and the RPC registry alone.
BOTH_PATHS = pytest.mark.parametrize("shared_table", [True, False], ids=["table", "rpc"])


def segment_kinds() -> list[str]:
    """The segments a one-tenant daemon keeps: its arena, and its object table's slots and holds."""
    return ["arena", "holds", "objects"]


def kinds_of(names: list[str]) -> list[str]:
    return sorted(name.rsplit("-", 1)[1] for name in names)


def sealed_segments(pid: int, prefix: str) -> dict[str, str]:
    """The memfds of ``prefix`` that process ``pid`` holds: name -> a path that opens it."""
    found = {}
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except FileNotFoundError:
            continue
        if target.startswith(f"/memfd:{prefix}-"):
            found[target.removeprefix("/memfd:").removesuffix(" (deleted)")] = f"/proc/{pid}/fd/{fd}"
    return found


class CliDaemon:
    """One ``shmtransport daemon`` process; ready once it printed its ready line."""

    def __init__(self, socket_path: str, prefix: str, arena_nbytes: int = ARENA_NBYTES, log_dir: str = "/tmp",
                 share_object_table: bool = True):
        self.socket_path = socket_path
        self.prefix = prefix
        self.log_path = os.path.join(log_dir, f"daemon-{os.path.basename(socket_path)}-{id(self)}.log")
        self._log = open(self.log_path, "wb")
        args = ["--socket", socket_path, "--arena-size", str(arena_nbytes), "--name-prefix", prefix]
        if not share_object_table:
            args.append("--no-shared-table")
        self.proc = subprocess.Popen(cli("daemon", *args), stdout=subprocess.PIPE, stderr=self._log)

    def wait_ready(self, timeout_s: float = START_TIMEOUT_S) -> "CliDaemon":
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout_s)
        line = self.proc.stdout.readline() if ready else b""
        if b"ready" not in line:
            self.kill()
            raise AssertionError(f"daemon not ready within {timeout_s} s: {line!r}\n{self.log()}")
        return self

    def wait(self, timeout_s: float = STOP_TIMEOUT_S) -> int:
        return self.proc.wait(timeout_s)

    def signal(self, signum: int) -> None:
        self.proc.send_signal(signum)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(STOP_TIMEOUT_S)

    def log(self) -> str:
        self._log.flush()
        with open(self.log_path, "rb") as f:
            return f.read().decode(errors="replace")

    def close(self) -> None:
        self.kill()
        self.proc.stdout.close()
        self._log.close()


@pytest.fixture
def start_cli_daemon(tmpdir_short, new_prefix):
    """Factory: ``start_cli_daemon(prefix=None, socket_name='d.sock', arena_nbytes=..., share_object_table=True)``
    → a ready CliDaemon.

    Teardown SIGKILLs what still runs, then removes segments those prefixes left (crash tests leave
    them on purpose; the suite's leak check would flag them otherwise)."""
    started: list[CliDaemon] = []

    def factory(prefix: str | None = None, socket_name: str = "d.sock", arena_nbytes: int = ARENA_NBYTES,
                share_object_table: bool = True):
        daemon = CliDaemon(
            os.path.join(tmpdir_short, socket_name), prefix or new_prefix(), arena_nbytes, tmpdir_short,
            share_object_table,
        )
        started.append(daemon)
        return daemon.wait_ready()

    yield factory
    for daemon in started:
        daemon.close()
    for prefix in {d.prefix for d in started}:
        for name in segments(prefix):
            os.unlink(os.path.join(SHM_DIR, name))


def call_until_connected(fn, attempts: int = 3):
    """Calls made right after a daemon restart may fail once while the client notices; then succeed."""
    last = None
    for _ in range(attempts):
        try:
            return fn()
        except (Unavailable, PermissionDenied) as exc:
            if exc.reason is Reason.INSTANCE_MISMATCH:
                raise
            last = exc
    raise AssertionError(f"client did not reconnect in {attempts} calls: {last!r}")


# -- signals -------------------------------------------------------------------------------------
@BOTH_PATHS
def test_sigterm_exits_zero_and_removes_socket_and_segments(start_cli_daemon, shared_table):
    daemon = start_cli_daemon(share_object_table=shared_table)
    assert kinds_of(list(sealed_segments(daemon.proc.pid, daemon.prefix))) == segment_kinds()
    assert os.path.exists(daemon.socket_path) and os.path.exists(daemon.socket_path + ".session")
    with Producer(daemon.socket_path, timeout_s=TIMEOUT_S) as producer:  # with a live client, too
        producer.put(np.arange(10))
        dedicated = producer.put(np.arange(10), dedicated=True)
        assert segments(daemon.prefix) == [dedicated.shm.name]  # the only kind with a name
        daemon.signal(signal.SIGTERM)
        assert daemon.wait() == 0, daemon.log()
    assert not os.path.exists(daemon.socket_path)
    assert not os.path.exists(daemon.socket_path + ".session")
    assert segments(daemon.prefix) == []


def test_socket_and_segment_files_are_owner_only(start_cli_daemon):
    daemon = start_cli_daemon()
    sealed = sealed_segments(daemon.proc.pid, daemon.prefix)
    assert kinds_of(list(sealed)) == segment_kinds()
    with Producer(daemon.socket_path, timeout_s=TIMEOUT_S) as producer:
        dedicated = producer.put(np.arange(10), dedicated=True)
        for path in (daemon.socket_path, daemon.socket_path + ".session", *sealed.values(),
                     os.path.join(SHM_DIR, dedicated.shm.name)):
            mode = stat.S_IMODE(os.stat(path).st_mode)
            assert mode == 0o600, f"{path}: {oct(mode)}"
        producer.release(dedicated, wait=True)


def test_in_process_daemon_files_are_owner_only_whatever_the_umask(make_daemon):
    old = os.umask(0)
    try:
        daemon = make_daemon()
    finally:
        os.umask(old)
    assert kinds_of(daemon.segment_names) == segment_kinds()
    segment_paths = [daemon.tenants[0].segment.open_path, daemon.tenants[0].objects.slots_segment.open_path,
                     daemon.tenants[0].objects.holds_segment.open_path]
    for path in (daemon.socket_path, daemon.socket_path + ".session", *segment_paths):
        mode = stat.S_IMODE(os.stat(path).st_mode)
        assert mode == 0o600, f"{path}: {oct(mode)}"


# -- crash and restart ---------------------------------------------------------------------------
@BOTH_PATHS
def test_restart_after_sigkill_sweeps_what_the_dead_instance_left_by_name(start_cli_daemon, shared_table):
    """The arena and table go with the daemon's process (and its clients' mappings); only its
    dedicated segments have names, and the next daemon sweeps those."""
    first = start_cli_daemon(share_object_table=shared_table)
    with Producer(first.socket_path, timeout_s=TIMEOUT_S) as producer:
        producer.put(np.arange(10), dedicated=True)
        dead = segments(first.prefix)
        assert len(dead) == 1 and "-obj" in dead[0]
        first.kill()  # SIGKILL: no chance to clean up
    assert segments(first.prefix) == dead
    second = start_cli_daemon(prefix=first.prefix, socket_name="d2.sock", share_object_table=shared_table)
    assert segments(second.prefix) == []
    assert kinds_of(list(sealed_segments(second.proc.pid, second.prefix))) == segment_kinds()
    assert "swept 1 leftover segment" in second.log()


def _hold_handed_segments(conn, socket_path: str) -> None:
    """Keep, flock and map every segment fd a producer's handshake passes, past the daemon's death."""
    import fcntl
    import mmap

    from shmtransport import arena

    kept, attach = [], arena.attach_fd

    def keeping(fd, name, *args, **kwargs):
        kept.append(os.dup(fd))
        return attach(fd, name, *args, **kwargs)

    arena.attach_fd = keeping
    Producer(socket_path, timeout_s=TIMEOUT_S)  # left open: its session dies with the daemon
    maps = []
    for fd in kept:
        fcntl.flock(fd, fcntl.LOCK_SH)
        maps.append(mmap.mmap(fd, os.fstat(fd).st_size, mmap.MAP_SHARED, mmap.PROT_READ))
    conn.send(len(kept))
    conn.recv()
    conn.send(sum(m[0] for m in maps) >= 0)  # still mapped and readable after the daemon died
    conn.recv()


def test_a_client_holding_a_dead_daemons_segments_leaves_nothing_by_name_and_blocks_no_restart(start_cli_daemon):
    first = start_cli_daemon()
    with BlockingChild(_hold_handed_segments, first.socket_path) as child:
        # the arena, and where the table is shared (the C kernels), its two segments
        assert child.recv(timeout_s=60) == (3 if objtable.available() else 1)
        first.kill()
        assert segments(first.prefix) == []  # nothing of the dead instance has a name to sweep
        child.send("read")
        assert child.recv(timeout_s=10) is True
        second = start_cli_daemon(prefix=first.prefix)
        with Producer(second.socket_path, timeout_s=TIMEOUT_S) as producer:
            producer.release(producer.put(np.arange(100)), wait=True)
        child.send("exit")
    assert segments(first.prefix) == []


@BOTH_PATHS
def test_startup_sweep_never_touches_a_live_daemons_segments(start_cli_daemon, shared_table):
    first = start_cli_daemon(share_object_table=shared_table)
    with Producer(first.socket_path, timeout_s=TIMEOUT_S) as kept:
        dedicated = kept.put(np.arange(100), dedicated=True)
        second = start_cli_daemon(prefix=first.prefix, socket_name="d2.sock", share_object_table=shared_table)
        assert segments(first.prefix) == [dedicated.shm.name]
        kept.release(dedicated, wait=True)
    for daemon in (first, second):  # and both serve
        with Producer(daemon.socket_path, timeout_s=TIMEOUT_S) as producer:
            producer.release(producer.put(np.arange(100)), wait=True)
            assert producer.stat().used_nbytes == 0
    for daemon in (first, second):
        daemon.signal(signal.SIGTERM)
        assert daemon.wait() == 0
    assert segments(first.prefix) == []


@BOTH_PATHS
def test_old_handles_are_refused_with_instance_mismatch_after_a_daemon_restart(start_cli_daemon, shared_table):
    first = start_cli_daemon(share_object_table=shared_table)
    with Producer(first.socket_path, timeout_s=TIMEOUT_S) as producer, Consumer(
        first.socket_path, timeout_s=TIMEOUT_S
    ) as consumer:
        handle = producer.put(np.arange(1000), digest=True)
        assert handle.shm.slot  # every object lives in the table
        old_instance = consumer.instance_id
        first.kill()
        start_cli_daemon(prefix=first.prefix, share_object_table=shared_table)  # same socket, same prefix: sweeps
        call_until_connected(consumer.stat)
        assert consumer.instance_id != old_instance
        with pytest.raises(Unavailable) as info:
            consumer.acquire(handle)
        assert info.value.reason is Reason.INSTANCE_MISMATCH
        # The reconnected clients work against the new daemon; the new object may sit in the very
        # slot, generation and offset the old handle names.
        fresh = call_until_connected(lambda: producer.put(np.arange(1000), digest=True))
        assert fresh.shm.instance_id == consumer.instance_id
        # Refused on both paths, and never taken for the new daemon's object in the same slot.
        with pytest.raises(Unavailable) as info:
            producer.release(handle, wait=True)
        assert info.value.reason is Reason.INSTANCE_MISMATCH
        lease = consumer.acquire(fresh)
        lease.verify()
        consumer.release([lease], wait=True)
        producer.release(fresh, wait=True)
        assert consumer.stat().live_objects == 0


@BOTH_PATHS
def test_a_producer_closes_cleanly_after_a_daemon_restart(start_cli_daemon, shared_table):
    """Its first call after the restart is its close: what it held died with the old daemon, and
    nothing of it may be handed to the new one, where another producer may hold grants and
    objects of the same ids."""
    first = start_cli_daemon(share_object_table=shared_table)
    stale = Producer(first.socket_path, timeout_s=TIMEOUT_S)
    stale.put(np.arange(1000))
    first.kill()
    second = start_cli_daemon(prefix=first.prefix, share_object_table=shared_table)
    with Producer(second.socket_path, timeout_s=TIMEOUT_S) as producer:
        handle = producer.put(np.arange(1000))
        before = producer.stat()
        stale.close()
        after = producer.stat()
        assert (after.live_objects, after.used_nbytes, after.granted_nbytes) == (
            before.live_objects, before.used_nbytes, before.granted_nbytes)
        producer.release(handle, wait=True)


def test_first_call_after_a_daemon_restart_reconnects_to_the_new_daemon(start_cli_daemon):
    first = start_cli_daemon()
    with Consumer(first.socket_path, timeout_s=TIMEOUT_S) as consumer:
        old_instance = consumer.instance_id
        first.kill()
        second = start_cli_daemon(prefix=first.prefix)
        s = consumer.stat()  # the very next call
        assert s.arena.instance_id != old_instance
        assert second.proc.poll() is None


# -- not enough memory for the arena ----------------------------------------------------------------
def impossible_arena_nbytes() -> int:
    """More than this machine's memory: refused before a page is reserved (never an OOM)."""
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") + 1 * GiB


def test_cli_exits_nonzero_with_memory_advice_when_the_arena_cannot_fit(tmpdir_short, new_prefix):
    prefix = new_prefix()
    socket_path = os.path.join(tmpdir_short, "d.sock")
    result = subprocess.run(
        cli("daemon", "--socket", socket_path, "--arena-size", str(impossible_arena_nbytes()), "--name-prefix", prefix),
        capture_output=True,
        timeout=START_TIMEOUT_S,
    )
    assert result.returncode != 0
    assert b"memory limit" in result.stderr, result.stderr.decode(errors="replace")
    assert segments(prefix) == []
    assert not os.path.exists(socket_path) and not os.path.exists(socket_path + ".session")


def test_daemon_start_raises_shm_too_small_for_more_than_memory_and_leaves_nothing_behind(tmpdir_short, new_prefix):
    prefix = new_prefix()
    socket_path = os.path.join(tmpdir_short, "d.sock")
    daemon = Daemon(socket_path=socket_path, arena_nbytes=impossible_arena_nbytes(), name_prefix=prefix)
    with pytest.raises(ResourceExhausted) as info:
        daemon.start()
    assert info.value.reason is Reason.SHM_TOO_SMALL
    assert "memory limit" in info.value.message
    daemon.stop()  # idempotent after a failed start
    assert segments(prefix) == []
    assert not os.path.exists(socket_path) and not os.path.exists(socket_path + ".session")


# -- stat ----------------------------------------------------------------------------------------
def test_stat_cli_prints_the_arena_size_and_used_bytes(start_cli_daemon):
    daemon = start_cli_daemon(arena_nbytes=64 * MiB)
    with Producer(daemon.socket_path, timeout_s=TIMEOUT_S) as producer:
        handle = producer.put(np.zeros(MiB, dtype=np.uint8))
        result = subprocess.run(
            cli("stat", "--socket", daemon.socket_path), capture_output=True, timeout=START_TIMEOUT_S
        )
        producer.release(handle, wait=True)
    assert result.returncode == 0, result.stderr.decode(errors="replace")
    lines = {line.split()[0]: line for line in result.stdout.decode().splitlines() if line.strip()}
    assert "64.0 MiB" in lines["arena"]
    assert lines["used"].split()[3:5] == ["1.0", "MiB"], lines["used"]


def test_stat_cli_exits_nonzero_when_no_daemon_listens(tmpdir_short):
    result = subprocess.run(
        cli("stat", "--socket", os.path.join(tmpdir_short, "nobody.sock"), "--timeout-s", "2"),
        capture_output=True,
        timeout=START_TIMEOUT_S,
    )
    assert result.returncode != 0
    assert b"cannot reach" in result.stderr
