"""Daemon start-up against a hostile node: the default socket location, claiming the socket paths
(one live daemon per socket, stale leftovers taken over, unsafe directories refused), a startup
sweep that never trusts what is planted in /dev/shm, and failed starts that leave nothing behind.

Attackers are real processes of another uid (65534, nobody); a daemon of a non-root uid runs in a
spawned child that drops to ``VICTIM``, a throwaway uid with no passwd entry."""
from __future__ import annotations

import os
import pwd
import secrets
import select
import signal
import socket
import stat
import subprocess
import sys

import numpy as np
import pytest

from shmtransport import testing
from shmtransport.client import Producer
from shmtransport.daemon import Daemon
from shmtransport.daemon.socket_dir import DaemonAlreadyRunning, UnsafeSocketDir
from shmtransport.errors import (
    InvalidArgument,
    Reason,
    ResourceExhausted,
    ShmTransportError,
)
from shmtransport.testing import (
    SHM_DIR,
    BlockingChild,
    remove_tree,
    run_in_child,
    short_tmpdir,
)
from shmtransport.wire import default_socket_path

NOBODY = 65534
START_TIMEOUT_S = 30.0
TIMEOUT_S = 10.0
ARENA = "4M"
SQUAT = "anyone could squat the socket"

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as other uids")


def _unused_uid() -> int:
    while True:
        uid = 60000 + secrets.randbelow(5000)
        try:
            pwd.getpwuid(uid)
        except KeyError:
            return uid


VICTIM = _unused_uid()  # random per run: concurrent runs do not share /tmp/shmtransport-<uid>


# -- helpers -------------------------------------------------------------------------------------
def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "shmtransport", *args]


def segments(prefix: str) -> list[str]:
    return sorted(n for n in os.listdir(SHM_DIR) if n.startswith(prefix + "-"))


def claimed_paths(socket_path: str) -> list[str]:
    return [socket_path, socket_path + ".session", socket_path + ".lock"]


def present(paths: list[str]) -> list[str]:
    return [p for p in paths if os.path.lexists(p)]


def unlink_segments(prefix: str) -> None:
    for name in segments(prefix):
        os.unlink(os.path.join(SHM_DIR, name))


class CliDaemon:
    """One ``shmtransport daemon`` process; ``wait_ready`` is bounded, ``close`` SIGKILLs and reaps."""

    def __init__(self, socket_path: str, prefix: str, *extra: str):
        self.socket_path, self.prefix = socket_path, prefix
        self.log_path = f"{socket_path}-{secrets.token_hex(3)}.log"
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                cli("daemon", "--socket", socket_path, "--arena-size", ARENA, "--name-prefix", prefix, *extra),
                stdout=subprocess.PIPE, stderr=log,
            )

    def wait_ready(self, timeout_s: float = START_TIMEOUT_S) -> "CliDaemon":
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout_s)
        line = self.proc.stdout.readline() if ready else b""
        if b"ready" not in line:
            self.close()
            raise AssertionError(f"daemon not ready within {timeout_s} s ({line!r}):\n{self.log()}")
        return self

    def wait(self, timeout_s: float = START_TIMEOUT_S) -> int:
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.close()
            raise AssertionError(f"daemon still running after {timeout_s} s:\n{self.log()}") from None

    def log(self) -> str:
        with open(self.log_path, "rb") as f:
            return f.read().decode(errors="replace")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(TIMEOUT_S)
        self.proc.stdout.close()


@pytest.fixture
def tmp():
    path = short_tmpdir()
    yield path
    remove_tree(path)


@pytest.fixture
def cli_daemons():
    """``start(socket_path, prefix, *flags)`` → a CliDaemon (not yet waited for); all are killed and
    their prefixes' segments removed at teardown (SIGKILL tests leave them on purpose)."""
    started: list[CliDaemon] = []

    def start(socket_path: str, prefix: str, *extra: str) -> CliDaemon:
        started.append(CliDaemon(socket_path, prefix, *extra))
        return started[-1]

    yield start
    for d in started:
        d.close()
    for prefix in {d.prefix for d in started}:
        unlink_segments(prefix)


def round_trip(socket_path: str) -> None:
    with Producer(socket_path, timeout_s=TIMEOUT_S) as producer:
        producer.release(producer.put(np.arange(100)), wait=True)
        assert producer.stat().used_nbytes == 0


# -- children (imports happen above, before a child drops privileges) -----------------------------
def _become(uid: int) -> None:
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)


def _set_env(env: dict) -> None:
    for key, value in env.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def _default_path_as(uid: int, env: dict) -> str:
    _become(uid)
    _set_env(env)
    return default_socket_path()


def _squat(directory: str, target: str) -> None:
    """The attacker's move: create the victim's socket directory first, open to all, with a symlink
    where the socket goes."""
    _become(NOBODY)
    os.mkdir(directory)
    os.chmod(directory, 0o777)
    os.symlink(target, os.path.join(directory, "daemon.sock"))


def _start_default_daemon_as(uid: int, prefix: str) -> dict:
    """A daemon of ``uid`` on the default socket path (XDG_RUNTIME_DIR unset)."""
    testing.warm_up_process_state()  # as root: gRPC and the stdlib (under a 0700 /root) loaded now
    _become(uid)
    _set_env({"XDG_RUNTIME_DIR": None, "SHMTRANSPORT_SOCKET": None})
    daemon = Daemon(arena_nbytes=1 << 20, name_prefix=prefix)
    try:
        daemon.start()
    except ShmTransportError as exc:
        return {"refused": type(exc).__name__, "message": exc.message}
    daemon.stop()
    return {"started": daemon.socket_path}


def _serve_default_as(conn, uid: int, prefix: str) -> None:
    testing.warm_up_process_state()
    _become(uid)
    _set_env({"XDG_RUNTIME_DIR": None, "SHMTRANSPORT_SOCKET": None})
    with Daemon(arena_nbytes=1 << 20, name_prefix=prefix) as daemon:
        conn.send(daemon.socket_path)
        conn.recv()


def _probe_as_nobody(directory: str, socket_path: str) -> dict:
    """What uid 65534 can do to a socket directory: list it, create entries in it, connect."""
    _become(NOBODY)
    out = {}
    try:
        os.listdir(directory)
        out["list"] = "LISTED"
    except PermissionError:
        out["list"] = "EACCES"
    try:
        os.symlink("/etc/passwd", os.path.join(directory, "planted"))
        out["create"] = "CREATED"
    except PermissionError:
        out["create"] = "EACCES"
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(TIMEOUT_S)
    try:
        s.connect(socket_path + ".session")
        out["connect"] = "CONNECTED"
    except PermissionError:
        out["connect"] = "EACCES"
    finally:
        s.close()
    return out


def _plant_file_as_nobody(path: str) -> int:
    _become(NOBODY)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    os.write(fd, b"not yours")
    os.close(fd)
    return os.stat(path).st_ino


# -- 1. the default socket location --------------------------------------------------------------
def test_default_socket_path_for_root_and_the_environment_override(monkeypatch):
    monkeypatch.setenv("XDG_RUNTIME_DIR", "/run/user/0")
    monkeypatch.delenv("SHMTRANSPORT_SOCKET", raising=False)
    if os.geteuid() == 0:
        assert default_socket_path() == "/run/shmtransport/daemon.sock"  # root ignores XDG_RUNTIME_DIR
    monkeypatch.setenv("SHMTRANSPORT_SOCKET", "/srv/shmt/d.sock")
    assert default_socket_path() == "/srv/shmt/d.sock"


@needs_root
def test_default_socket_path_of_another_uid_is_in_a_directory_of_its_own():
    unset = {"XDG_RUNTIME_DIR": None, "SHMTRANSPORT_SOCKET": None}
    assert run_in_child(_default_path_as, VICTIM, unset) == f"/tmp/shmtransport-{VICTIM}/daemon.sock"
    xdg = {"XDG_RUNTIME_DIR": f"/run/user/{VICTIM}", "SHMTRANSPORT_SOCKET": None}
    assert run_in_child(_default_path_as, VICTIM, xdg) == f"/run/user/{VICTIM}/shmtransport/daemon.sock"
    explicit = {"XDG_RUNTIME_DIR": None, "SHMTRANSPORT_SOCKET": "/srv/x.sock"}
    assert run_in_child(_default_path_as, VICTIM, explicit) == "/srv/x.sock"


@needs_root
def test_another_uid_squatting_the_default_socket_directory_makes_the_daemon_refuse(new_prefix, tmp):
    directory = f"/tmp/shmtransport-{VICTIM}"
    target = os.path.join(tmp, "attacker-wants-this")
    prefix = new_prefix()
    remove_tree(directory)
    try:
        run_in_child(_squat, directory, target)
        out = run_in_child(_start_default_daemon_as, VICTIM, prefix)
        assert out.get("refused") == "UnsafeSocketDir", out
        assert directory in out["message"] and f"owned by uid {NOBODY}" in out["message"], out
        assert sorted(os.listdir(directory)) == ["daemon.sock"]  # no lock file, nothing bound
        assert os.readlink(os.path.join(directory, "daemon.sock")) == target and not os.path.lexists(target)
        assert segments(prefix) == []
    finally:
        remove_tree(directory)
        unlink_segments(prefix)


@needs_root
def test_the_default_socket_directory_is_created_private_and_another_uid_cannot_enter_it(new_prefix):
    directory = f"/tmp/shmtransport-{VICTIM}"
    prefix = new_prefix()
    remove_tree(directory)
    try:
        with BlockingChild(_serve_default_as, VICTIM, prefix) as victim:
            socket_path = victim.recv(START_TIMEOUT_S)
            assert socket_path == os.path.join(directory, "daemon.sock")
            st = os.lstat(directory)
            assert stat.S_ISDIR(st.st_mode) and st.st_uid == VICTIM and stat.S_IMODE(st.st_mode) == 0o700
            for path in (socket_path, socket_path + ".session"):
                assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
            out = run_in_child(_probe_as_nobody, directory, socket_path)
            assert out == {"list": "EACCES", "create": "EACCES", "connect": "EACCES"}, out
            victim.finish()
        assert os.listdir(directory) == []  # stop removed the sockets and the lock file
    finally:
        remove_tree(directory)
        unlink_segments(prefix)


# -- 2. claiming the socket paths ----------------------------------------------------------------
def test_a_second_cli_daemon_on_a_live_socket_refuses_and_the_first_keeps_serving(tmp, new_prefix, cli_daemons):
    path = os.path.join(tmp, "d.sock")
    first = cli_daemons(path, new_prefix()).wait_ready()
    second = cli_daemons(path, new_prefix())
    assert second.wait() == 2, second.log()
    assert f"another shmtransportd (pid {first.proc.pid}) is serving {path}" in second.log()
    assert segments(second.prefix) == []
    for p in (path, path + ".session"):
        assert stat.S_ISSOCK(os.lstat(p).st_mode), p
    round_trip(path)
    assert first.proc.poll() is None


def test_a_second_in_process_daemon_on_a_live_socket_raises_daemon_already_running(make_daemon, tmp, new_prefix):
    path = os.path.join(tmp, "d.sock")
    make_daemon(socket_path=path)
    second = Daemon(socket_path=path, arena_nbytes=1 << 20, name_prefix=new_prefix())
    with pytest.raises(DaemonAlreadyRunning) as info:
        second.start()
    assert info.value.message == f"another shmtransportd (pid {os.getpid()}) is serving {path}"
    assert info.value.reason is Reason.WRONG_STATE
    second.stop()
    assert segments(second.config.name_prefix) == []
    round_trip(path)


def test_the_stale_sockets_of_a_sigkilled_daemon_are_taken_over(tmp, new_prefix, cli_daemons):
    path = os.path.join(tmp, "d.sock")
    prefix = new_prefix()
    first = cli_daemons(path, prefix).wait_ready()
    first.proc.send_signal(signal.SIGKILL)
    first.wait()
    assert present(claimed_paths(path)) == claimed_paths(path)  # all left behind
    second = cli_daemons(path, prefix).wait_ready()
    assert f"removed leftover {path}" in second.log()
    round_trip(path)
    second.proc.send_signal(signal.SIGTERM)
    assert second.wait() == 0, second.log()
    assert present(claimed_paths(path)) == []


def _plant(kind: str, path: str, victim: str) -> None:
    if kind in ("dangling symlink", "symlink to a file"):
        os.symlink(victim, path)
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "regular file":
        with open(path, "w") as f:
            f.write("junk")


@pytest.mark.parametrize("kind", ["dangling symlink", "symlink to a file", "fifo", "regular file"])
def test_a_leftover_at_the_socket_paths_is_removed_never_followed(make_daemon, tmp, kind):
    path = os.path.join(tmp, "d.sock")
    victims = {p: os.path.join(tmp, os.path.basename(p) + "-victim") for p in (path, path + ".session")}
    for p, victim in victims.items():
        if kind == "symlink to a file":
            with open(victim, "w") as f:
                f.write("precious")
        _plant(kind, p, victim)
    daemon = make_daemon(socket_path=path)
    for p, victim in victims.items():
        assert stat.S_ISSOCK(os.lstat(p).st_mode), p
        if kind == "symlink to a file":
            with open(victim) as f:
                assert f.read() == "precious"
        else:
            assert not os.path.lexists(victim)
    round_trip(daemon.socket_path)


def _unsafe_dir(kind: str, tmp: str) -> str:
    directory = os.path.join(tmp, "run")
    if kind == "symlink":
        os.mkdir(directory + "-real", 0o700)
        os.symlink(directory + "-real", directory)
        return directory
    os.mkdir(directory)
    if kind == "owned by another uid":
        os.chown(directory, NOBODY, NOBODY)
        os.chmod(directory, 0o755)
    else:
        os.chmod(directory, {"1777": 0o1777, "0777": 0o777, "group-writable 0770": 0o770}[kind])
    return directory


@pytest.mark.parametrize("kind", ["1777", "0777", "group-writable 0770", "owned by another uid", "symlink"])
def test_a_socket_directory_anyone_else_controls_is_refused(tmp, new_prefix, kind):
    directory = _unsafe_dir(kind, tmp)
    path = os.path.join(directory, "d.sock")
    daemon = Daemon(socket_path=path, arena_nbytes=1 << 20, name_prefix=new_prefix())
    with pytest.raises(UnsafeSocketDir) as info:
        daemon.start()
    assert info.value.reason is Reason.PERMISSION_DENIED
    message = info.value.message
    assert directory in message, message
    if kind in ("1777", "0777", "group-writable 0770"):
        assert f"is writable by other users: {SQUAT}" in message, message
    elif kind == "owned by another uid":
        assert f"owned by uid {NOBODY}" in message, message
    else:
        assert "is a symlink" in message, message
    assert os.listdir(directory) == [] and segments(daemon.config.name_prefix) == []


def _plant_symlink_as_nobody(path: str) -> None:
    _become(NOBODY)
    os.symlink("/etc/shadow", path)


@needs_root
def test_a_symlink_another_uid_planted_in_a_1777_socket_directory_is_never_used(tmp, new_prefix):
    os.chmod(tmp, 0o711)  # the attacker can reach the public directory
    directory = os.path.join(tmp, "pub")
    os.mkdir(directory)
    os.chmod(directory, 0o1777)
    path = os.path.join(directory, "d.sock")
    run_in_child(_plant_symlink_as_nobody, path)
    with pytest.raises(UnsafeSocketDir, match=SQUAT):
        Daemon(socket_path=path, arena_nbytes=1 << 20, name_prefix=new_prefix()).start()
    assert os.listdir(directory) == ["d.sock"] and os.readlink(path) == "/etc/shadow"


@needs_root
@pytest.mark.parametrize(
    "config, dir_mode, dir_gid, socket_mode, nobody",
    [
        ({}, 0o700, 0, 0o600, {"list": "EACCES", "create": "EACCES", "connect": "EACCES"}),
        ({"socket_group": "nogroup"}, 0o750, NOBODY, 0o660,
         {"list": "LISTED", "create": "EACCES", "connect": "CONNECTED"}),
        ({"allowed_uids": (0, NOBODY)}, 0o711, 0, 0o666,
         {"list": "EACCES", "create": "EACCES", "connect": "CONNECTED"}),
    ],
    ids=["owner only", "socket group", "other uids allowed"],
)
def test_the_socket_directory_is_created_with_the_mode_the_config_needs(
    make_daemon, tmp, config, dir_mode, dir_gid, socket_mode, nobody
):
    os.chmod(tmp, 0o711)  # as /run or /tmp would be: others may traverse it
    directory = os.path.join(tmp, "run")  # missing: the daemon creates it
    daemon = make_daemon(socket_path=os.path.join(directory, "d.sock"), **config)
    st = os.lstat(directory)
    assert (stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid) == (dir_mode, 0, dir_gid), oct(st.st_mode)
    for path in (daemon.socket_path, daemon.socket_path + ".session"):
        assert stat.S_IMODE(os.stat(path).st_mode) == socket_mode, path
    assert run_in_child(_probe_as_nobody, directory, daemon.socket_path) == nobody


# -- 3. the startup sweep never trusts /dev/shm ----------------------------------------------------
def _plant_in_shm(kind: str, path: str) -> None:
    if kind == "fifo":
        os.mkfifo(path, 0o600)
    elif kind == "socket":
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.bind(path)
        s.close()  # the socket file stays
    else:
        run_in_child(_plant_file_as_nobody, path)


@needs_root
@pytest.mark.parametrize("kind", ["fifo", "socket", "file of another uid"])
def test_the_startup_sweep_skips_what_is_not_a_dead_segment_of_ours(tmp, new_prefix, cli_daemons, kind):
    prefix = new_prefix()
    planted = os.path.join(SHM_DIR, f"{prefix}-{secrets.token_hex(6)}-arena")
    dead = os.path.join(SHM_DIR, f"{prefix}-{secrets.token_hex(6)}-t0-arena")  # ours, lock free
    try:
        _plant_in_shm(kind, planted)
        with open(dead, "wb"):
            pass
        before = os.lstat(planted)
        daemon = cli_daemons(os.path.join(tmp, "d.sock"), prefix).wait_ready()  # bounded: a FIFO would hang it
        after = os.lstat(planted)
        assert (after.st_ino, after.st_uid, stat.S_IFMT(after.st_mode)) == (
            before.st_ino, before.st_uid, stat.S_IFMT(before.st_mode))
        assert not os.path.exists(dead)
        assert f"left {planted} alone" in daemon.log() and "swept 1 leftover segment" in daemon.log()
        round_trip(daemon.socket_path)
    finally:
        for path in (planted, dead):
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass


# -- 4. a failed start leaves nothing ------------------------------------------------------------
FAILURES = {
    "missing socket group": ({"socket_group": "no-such-group"}, InvalidArgument, "socket group 'no-such-group'"),
    "missing allowed group": ({"allowed_groups": ("no-such-group",)}, InvalidArgument, "no-such-group"),
    "arena too large": ({"arena_nbytes": None}, ResourceExhausted, "memory limit"),  # size set in the test
    "socket dir refused": ({}, UnsafeSocketDir, SQUAT),
}


def impossible_arena_nbytes() -> int:
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") + (1 << 30)


@pytest.mark.parametrize("failure", list(FAILURES))
def test_a_failed_start_leaves_no_segment_socket_or_lock_file(tmp, new_prefix, failure):
    overrides, error, text = FAILURES[failure]
    overrides = dict(overrides, arena_nbytes=impossible_arena_nbytes() if failure == "arena too large" else 1 << 20)
    directory = tmp
    if failure == "socket dir refused":
        directory = os.path.join(tmp, "pub")
        os.mkdir(directory)
        os.chmod(directory, 0o1777)
    path = os.path.join(directory, "d.sock")
    prefix = new_prefix()
    daemon = Daemon(socket_path=path, name_prefix=prefix, **overrides)
    with pytest.raises(error, match=text):
        daemon.start()
    daemon.stop()
    assert segments(prefix) == []
    assert present(claimed_paths(path)) == []
    assert os.listdir(directory) == []


def test_a_cli_daemon_with_a_missing_group_exits_2_and_leaves_nothing(tmp, new_prefix, cli_daemons):
    path = os.path.join(tmp, "d.sock")
    daemon = cli_daemons(path, new_prefix(), "--group", "no-such-group")
    assert daemon.wait() == 2, daemon.log()
    assert "socket group 'no-such-group' does not exist" in daemon.log()
    assert segments(daemon.prefix) == [] and present(claimed_paths(path)) == []
