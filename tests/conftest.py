"""Suite-wide fixtures: a leak check on every test, and in-process daemons that must end clean.

- autouse ``no_leaks``: a test fails if it leaves a new /dev/shm entry of this run's daemons
  (prefix ``RUN_PREFIX``; other new entries only warn: /dev/shm is shared with other people), an
  open fd (after up to ~2 s of settling: gRPC closes channels asynchronously) or a live child
  process. Opt out per test with ``@pytest.mark.allow_leaks``.
- ``make_daemon(**overrides)``: start an in-process ``Daemon`` on a short socket path with a unique
  name prefix (64 MiB arena unless overridden); stopped at teardown, after asserting that its stat
  shows no live objects and no live leases (opt out with ``@pytest.mark.allow_live_objects``).
- ``daemon``: ``make_daemon()`` with the defaults.
- ``new_prefix``: factory of fresh segment-name prefixes for daemons a test starts itself.
"""
from __future__ import annotations

import os
import secrets
import sys
import warnings

import pytest

sys.path.insert(0, os.path.dirname(__file__))  # `import helpers` from test modules and spawned children

from helpers import LeakSnapshot, remove_tree, short_tmpdir, wait_until  # noqa: E402

from shmtransport.daemon import Daemon  # noqa: E402

ARENA_NBYTES = 64 << 20
DAEMON_SETTLE_S = 3.0


def pytest_configure(config):
    config.addinivalue_line("markers", "allow_live_objects: the daemon fixture skips its zero-live-objects check")
    config.addinivalue_line("markers", "allow_leaks: skip the /dev/shm, fd and child-process leak check")


# Every daemon of this test run gets a name prefix starting with RUN_PREFIX, so the leak check
# can tell this run's segments from those of anyone else sharing /dev/shm (even another run of
# this very suite).
RUN_PREFIX = "shmtt" + secrets.token_hex(3)


def unique_prefix() -> str:
    """A fresh segment-name prefix for one daemon ([A-Za-z0-9_.], short)."""
    return RUN_PREFIX + secrets.token_hex(3)


@pytest.fixture(scope="session", autouse=True)
def _warm_up_process_state():
    """Create the process-wide state that gRPC, the client and multiprocessing's spawn keep for the
    whole run once, up front, so the per-test fd check sees only what a test itself opened."""
    import multiprocessing.resource_tracker

    from shmtransport.client import Consumer

    multiprocessing.resource_tracker.ensure_running()  # spawn starts it once and keeps a pipe fd
    tmp = short_tmpdir()
    try:
        with Daemon(socket_path=os.path.join(tmp, "d.sock"), arena_nbytes=1 << 20, name_prefix=unique_prefix()) as d:
            with Consumer(d.socket_path, timeout_s=10) as c:
                c.stat()
    except Exception as exc:  # the daemon tests will say what is wrong; other tests still run
        warnings.warn(f"could not warm up a daemon and client ({exc!r}): fd checks may over-report")
    finally:
        remove_tree(tmp)
    yield


@pytest.fixture(autouse=True)
def no_leaks(request):
    if request.node.get_closest_marker("allow_leaks"):
        yield
        return
    before = LeakSnapshot(ours_prefix=RUN_PREFIX)
    yield
    problems = []
    children = LeakSnapshot.live_children()
    if children:
        problems.append(f"child processes still alive: {children}")
        for child in children:
            child.kill()
            child.join(5)
    ours, foreign = before.new_shm_entries()
    if ours:
        problems.append(f"/dev/shm entries left behind: {sorted(ours)}")
    if foreign:
        warnings.warn(f"new /dev/shm entries not made by shmtransport (other processes?): {sorted(foreign)}")
    grown = before.fd_growth()
    if grown:
        problems.append(f"fds left open: {grown}")
    if problems:
        pytest.fail("test left resources behind:\n  " + "\n  ".join(problems), pytrace=False)


def _wait_daemon_empty(daemon: Daemon, timeout_s: float = DAEMON_SETTLE_S):
    """Sessions close asynchronously (the daemon sees the session socket's EOF): poll briefly."""

    def empty():
        s = daemon.stat()
        return s if s.live_objects == 0 and s.live_leases == 0 else None

    try:
        return wait_until(empty, timeout_s=timeout_s, what="daemon has no live objects or leases")
    except TimeoutError:
        s = daemon.stat()
        return s


@pytest.fixture
def make_daemon(request):
    started: list[tuple[Daemon, str]] = []

    def factory(**overrides) -> Daemon:
        tmp = short_tmpdir()
        overrides.setdefault("socket_path", os.path.join(tmp, "d.sock"))
        overrides.setdefault("arena_nbytes", ARENA_NBYTES)
        overrides.setdefault("name_prefix", unique_prefix())
        daemon = Daemon(**overrides)
        try:
            daemon.start()
        except BaseException:
            remove_tree(tmp)
            raise
        started.append((daemon, tmp))
        return daemon

    yield factory

    check = request.node.get_closest_marker("allow_live_objects") is None
    failures = []
    for daemon, tmp in started:
        try:
            if check and not daemon.closed:
                s = _wait_daemon_empty(daemon)
                if s.live_objects or s.live_leases or s.used_nbytes:
                    failures.append(
                        f"{daemon!r} still holds {s.live_objects} objects, {s.live_leases} leases, "
                        f"{s.used_nbytes} bytes at teardown"
                    )
        finally:
            daemon.stop(grace_s=1.0)
            remove_tree(tmp)
    if failures:
        pytest.fail("\n".join(failures), pytrace=False)


@pytest.fixture
def daemon(make_daemon) -> Daemon:
    return make_daemon()


@pytest.fixture
def new_prefix():
    """Factory of segment-name prefixes for daemons a test starts itself (e.g. through the CLI)."""
    return unique_prefix
