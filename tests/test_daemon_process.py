"""The daemon as a real process started by the CLI: signals, crash recovery, restarts, file modes,
and a /dev/shm too small for the arena (a typed error at start, never a SIGBUS later)."""
from __future__ import annotations

import os
import select
import signal
import stat
import subprocess
import sys

import numpy as np
import pytest

from shmtransport.testing import SHM_DIR, remove_tree, short_tmpdir
from shmtransport.client import Consumer, Producer
from shmtransport.daemon import Daemon
from shmtransport.errors import PermissionDenied, Reason, ResourceExhausted, Unavailable

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


class CliDaemon:
    """One ``shmtransport daemon`` process; ready once it printed its ready line."""

    def __init__(self, socket_path: str, prefix: str, arena_nbytes: int = ARENA_NBYTES, log_dir: str = "/tmp"):
        self.socket_path = socket_path
        self.prefix = prefix
        self.log_path = os.path.join(log_dir, f"daemon-{os.path.basename(socket_path)}-{id(self)}.log")
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            cli("daemon", "--socket", socket_path, "--arena-size", str(arena_nbytes), "--name-prefix", prefix),
            stdout=subprocess.PIPE,
            stderr=self._log,
        )

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
def tmpdir_short():
    path = short_tmpdir()
    yield path
    remove_tree(path)


@pytest.fixture
def start_cli_daemon(tmpdir_short, new_prefix):
    """Factory: ``start_cli_daemon(prefix=None, socket_name='d.sock')`` → a ready CliDaemon.

    Teardown SIGKILLs what still runs, then removes segments those prefixes left (crash tests leave
    them on purpose; the suite's leak check would flag them otherwise)."""
    started: list[CliDaemon] = []

    def factory(prefix: str | None = None, socket_name: str = "d.sock", arena_nbytes: int = ARENA_NBYTES):
        daemon = CliDaemon(
            os.path.join(tmpdir_short, socket_name), prefix or new_prefix(), arena_nbytes, tmpdir_short
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
def test_sigterm_exits_zero_and_removes_socket_and_segment(start_cli_daemon):
    daemon = start_cli_daemon()
    [segment] = segments(daemon.prefix)
    assert os.path.exists(daemon.socket_path) and os.path.exists(daemon.socket_path + ".session")
    with Producer(daemon.socket_path, timeout_s=TIMEOUT_S) as producer:  # with a live client, too
        producer.put(np.arange(10))
        daemon.signal(signal.SIGTERM)
        assert daemon.wait() == 0, daemon.log()
    assert not os.path.exists(daemon.socket_path)
    assert not os.path.exists(daemon.socket_path + ".session")
    assert not os.path.exists(os.path.join(SHM_DIR, segment))


def test_socket_and_segment_files_are_owner_only(start_cli_daemon):
    daemon = start_cli_daemon()
    [segment] = segments(daemon.prefix)
    for path in (daemon.socket_path, daemon.socket_path + ".session", os.path.join(SHM_DIR, segment)):
        mode = stat.S_IMODE(os.stat(path).st_mode)
        assert mode == 0o600, f"{path}: {oct(mode)}"


def test_in_process_daemon_files_are_owner_only_whatever_the_umask(make_daemon):
    old = os.umask(0)
    try:
        daemon = make_daemon()
    finally:
        os.umask(old)
    for path in (daemon.socket_path, daemon.socket_path + ".session", os.path.join(SHM_DIR, daemon.segment_names[0])):
        mode = stat.S_IMODE(os.stat(path).st_mode)
        assert mode == 0o600, f"{path}: {oct(mode)}"


# -- crash and restart ---------------------------------------------------------------------------
def test_restart_after_sigkill_sweeps_the_dead_instances_segment(start_cli_daemon):
    first = start_cli_daemon()
    [dead_segment] = segments(first.prefix)
    first.kill()  # SIGKILL: no chance to clean up
    assert segments(first.prefix) == [dead_segment]
    second = start_cli_daemon(prefix=first.prefix, socket_name="d2.sock")
    live = segments(second.prefix)
    assert dead_segment not in live and len(live) == 1
    assert "swept 1 leftover segment" in second.log()


def test_startup_sweep_never_touches_a_live_daemons_segment(start_cli_daemon):
    first = start_cli_daemon()
    [first_segment] = segments(first.prefix)
    second = start_cli_daemon(prefix=first.prefix, socket_name="d2.sock")  # same prefix, live first
    both = segments(first.prefix)
    assert first_segment in both and len(both) == 2
    for daemon in (first, second):  # and both serve
        with Producer(daemon.socket_path, timeout_s=TIMEOUT_S) as producer:
            producer.release(producer.put(np.arange(100)), wait=True)
            assert producer.stat().used_nbytes == 0
    for daemon in (first, second):
        daemon.signal(signal.SIGTERM)
        assert daemon.wait() == 0
    assert segments(first.prefix) == []


def test_old_handles_are_refused_with_instance_mismatch_after_a_daemon_restart(start_cli_daemon):
    first = start_cli_daemon()
    with Producer(first.socket_path, timeout_s=TIMEOUT_S) as producer, Consumer(
        first.socket_path, timeout_s=TIMEOUT_S
    ) as consumer:
        handle = producer.put(np.arange(1000), hash=True)
        old_instance = consumer.instance_id
        first.kill()
        start_cli_daemon(prefix=first.prefix)  # same socket, same prefix: sweeps the old arena
        call_until_connected(consumer.stat)
        assert consumer.instance_id != old_instance
        with pytest.raises(Unavailable) as info:
            consumer.acquire(handle)
        assert info.value.reason is Reason.INSTANCE_MISMATCH
        with pytest.raises(Unavailable) as info:
            call_until_connected(lambda: producer.release(handle, wait=True))
        assert info.value.reason is Reason.INSTANCE_MISMATCH
        # And the reconnected clients work against the new daemon.
        fresh = call_until_connected(lambda: producer.put(np.arange(1000), hash=True))
        lease = consumer.acquire(fresh)
        lease.verify()
        consumer.release_many([lease], wait=True)
        producer.release(fresh, wait=True)
        del lease


def test_first_call_after_a_daemon_restart_reconnects_to_the_new_daemon(start_cli_daemon):
    first = start_cli_daemon()
    with Consumer(first.socket_path, timeout_s=TIMEOUT_S) as consumer:
        old_instance = consumer.instance_id
        first.kill()
        second = start_cli_daemon(prefix=first.prefix)
        s = consumer.stat()  # the very next call
        assert s.arena.instance_id != old_instance
        assert second.proc.poll() is None


# -- /dev/shm too small --------------------------------------------------------------------------
def impossible_arena_nbytes() -> int:
    """More than /dev/shm can ever hold: above its total size (so the kernel refuses the reservation
    at once instead of filling /dev/shm first), and above what is free (the brief's free + 1 GiB)."""
    st = os.statvfs(SHM_DIR)
    return max(st.f_blocks, st.f_bavail) * st.f_frsize + 1 * GiB


def test_cli_exits_nonzero_with_shm_size_advice_when_dev_shm_is_too_small(tmpdir_short, new_prefix):
    prefix = new_prefix()
    socket_path = os.path.join(tmpdir_short, "d.sock")
    result = subprocess.run(
        cli("daemon", "--socket", socket_path, "--arena-size", str(impossible_arena_nbytes()), "--name-prefix", prefix),
        capture_output=True,
        timeout=START_TIMEOUT_S,
    )
    assert result.returncode != 0
    assert b"--shm-size" in result.stderr, result.stderr.decode(errors="replace")
    assert segments(prefix) == []
    assert not os.path.exists(socket_path) and not os.path.exists(socket_path + ".session")


def test_daemon_start_raises_shm_too_small_and_leaves_nothing_behind(tmpdir_short, new_prefix):
    prefix = new_prefix()
    socket_path = os.path.join(tmpdir_short, "d.sock")
    daemon = Daemon(socket_path=socket_path, arena_nbytes=impossible_arena_nbytes(), name_prefix=prefix)
    with pytest.raises(ResourceExhausted) as info:
        daemon.start()
    assert info.value.reason is Reason.SHM_TOO_SMALL
    assert "--shm-size" in info.value.message
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
