"""pytest plugin: shared-memory fixtures for test suites of code that uses shmtransport.

Registered as the ``pytest11`` entry point ``shmtransport`` (or load it with
``-p shmtransport.pytest_plugin``). Inert unless a test uses one of its fixtures or markers: no
autouse fixture, nothing started, and the daemon (gRPC) is imported only inside the fixtures.

Fixtures
  ``shm_daemon``          a real in-process ``Daemon`` for one test: socket in a short /tmp dir, a
                          unique name prefix (``shmtpy`` + hex), a ``--shm-arena-size`` arena; at
                          teardown it is stopped and nothing of its prefix may remain in /dev/shm
  ``shm_daemon_session``  the same, one for the whole session
  ``shm_make_daemon``     factory ``(**DaemonConfig overrides) -> Daemon`` with the same teardown
  ``shm_producer``        a ``Producer`` connected to ``shm_daemon`` (closed at teardown)
  ``shm_consumer``        a ``Consumer`` connected to ``shm_daemon`` (closed at teardown)
  ``shm_leak_check``      fail the test if it leaves new /dev/shm entries of its own, open fds, live
                          child processes, or live leases (object-table ones too) or objects on a
                          daemon fixture, each lease and loan listed with the call site that took
                          it; also applied by ``@pytest.mark.shm_leak_check``. Its own entries: this
                          process's ``testing.RUN_PREFIX`` (one per xdist worker), its daemons'
                          prefixes, what this process opened or mapped, what it or its children
                          hold (``testing.LeakCheck`` has the exact rule); other processes' new
                          entries are only noted (a "Captured shmtransport teardown" section). The
                          fixture value (``testing.LeakCheck``) has knobs (``check_fds = False``,
                          ``own_shm(prefix)``, ``ignore_shm(prefix)``, ...)
  ``shm_owned_prefixes``  override to return more prefixes whose new entries are the test's own (a
                          child's segments with its own naming); ``("",)`` counts every new entry
  ``shm_run_in_child``    ``testing.run_in_child``: a module-level function in a ``spawn`` child,
                          its result or its exception (with the child's traceback) sent back

Options
  ``--shm-arena-size=64M``     arena of the daemon fixtures (bytes, or K/M/G suffixes)
  ``--shm-keep-on-failure``    when a test fails, leave its daemon running, its dedicated segments
                               in /dev/shm and copies of its arena and object table (memfds, gone
                               with the process) in its socket directory, for inspection; the
                               socket path and the files are printed in the terminal summary
"""
from __future__ import annotations

import sys
from collections.abc import Callable, Generator, Iterator
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, runtime_checkable

import pytest

from . import testing

if TYPE_CHECKING:  # pragma: no cover
    from .client import Consumer, Producer
    from .daemon import Daemon

_ENTRY_POINT = "shmtransport"  # this module's pytest11 entry point name
_CLIENT_TIMEOUT_S = 10.0
# Fixtures after which a leak check first warms up gRPC's and multiprocessing's process-wide state.
_PROCESS_STATE_FIXTURES = frozenset(
    {"shm_daemon", "shm_daemon_session", "shm_make_daemon", "shm_producer", "shm_consumer", "shm_run_in_child"}
)

_reports_key = pytest.StashKey[dict[str, pytest.TestReport]]()  # item: phase -> report
_check_key = pytest.StashKey[testing.LeakCheck]()  # item: its active leak check
_item_daemons_key = pytest.StashKey[list["Daemon"]]()  # item: function-scoped daemons it started
_session_daemons_key = pytest.StashKey[list["Daemon"]]()  # config: session-scoped daemons
_session_failed_key = pytest.StashKey[bool]()  # config: a test using shm_daemon_session failed
# config: (nodeid, socket path, segment names in /dev/shm, copies of the sealed segments, tmpdir) kept
_kept_key = pytest.StashKey[list[tuple[str, str, list[str], list[str], str | None]]]()

_ClientT = TypeVar("_ClientT", "Producer", "Consumer")


@runtime_checkable
class _HasFixtureNames(Protocol):
    """An item that requests fixtures (a test function, a doctest)."""

    fixturenames: list[str]


# -- options, markers, hooks ---------------------------------------------------------------------
def pytest_plugin_registered(plugin: object, plugin_name: str, manager: pytest.PytestPluginManager) -> None:
    """Loaded by module name (``-p shmtransport.pytest_plugin``) before the entry points: block the
    entry point's name, or pluggy refuses to register this module a second time under it."""
    if plugin is sys.modules[__name__] and plugin_name != _ENTRY_POINT:
        manager.set_blocked(_ENTRY_POINT)


def pytest_addoption(parser: pytest.Parser) -> None:
    """Add the plugin's command-line options ``--shm-arena-size`` and ``--shm-keep-on-failure``."""
    group = parser.getgroup("shmtransport", "shmtransport shared-memory fixtures")
    group.addoption(
        "--shm-arena-size",
        dest="shm_arena_size",
        type=testing.parse_nbytes,
        default=testing.DEFAULT_ARENA_NBYTES,
        metavar="NBYTES",
        help="arena size of the shm_daemon fixtures: bytes or with a K/M/G suffix (default 64M)",
    )
    group.addoption(
        "--shm-keep-on-failure",
        dest="shm_keep_on_failure",
        action="store_true",
        default=False,
        help="when a test fails, do not stop its shm daemon or unlink its segments, copy its arena and "
        "object table to files; print the socket path and the files for inspection",
    )


def pytest_configure(config: pytest.Config) -> None:
    """Register the ``shm_leak_check`` marker."""
    config.addinivalue_line(
        "markers",
        "shm_leak_check: fail the test if it leaves /dev/shm entries, open fds, child processes or "
        "live daemon leases behind (same as using the shm_leak_check fixture)",
    )


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The marker requests the fixture; the leak check goes first so that it is set up before any
    daemon or client fixture and torn down after them."""
    for item in items:
        if not isinstance(item, _HasFixtureNames):
            continue
        names = item.fixturenames
        if "shm_leak_check" in names or item.get_closest_marker("shm_leak_check") is not None:
            item.fixturenames = ["shm_leak_check", *(n for n in names if n != "shm_leak_check")]


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """Keep each phase's report of tests that check leaks or use a daemon, for the fixtures' teardown."""
    report = yield
    if item.stash.get(_check_key, None) is not None or _uses_daemon(item):
        item.stash.setdefault(_reports_key, {})[report.when] = report
        if report.failed and "shm_daemon_session" in getattr(item, "fixturenames", ()):
            item.config.stash[_session_failed_key] = True
    return report


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_teardown(item: pytest.Item) -> None:
    """End of the test body, before any fixture is torn down (clients still open): the leases
    the test left live are still visible on the daemons."""
    check = item.stash.get(_check_key, None)
    if check is None or _keeping(item):
        return
    for daemon in _active_daemons(item):
        check.check_daemon(daemon)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, config: pytest.Config) -> None:
    """List the daemon sockets and segments kept by ``--shm-keep-on-failure``, and how to remove them."""
    kept = config.stash.get(_kept_key, [])
    if not kept:
        return
    terminalreporter.section("shmtransport: daemon state kept for inspection (--shm-keep-on-failure)")
    for nodeid, socket_path, segments, copies, _ in kept:
        terminalreporter.line(f"{nodeid}:")
        terminalreporter.line(f"  socket: {socket_path}")
        for path in [f"/dev/shm/{name}" for name in segments] + copies:
            terminalreporter.line(f"  segment: {path}")
    paths = [f"/dev/shm/{name}" for _, _, segments, _, _ in kept for name in segments]
    paths += sorted({tmpdir for *_, tmpdir in kept if tmpdir})  # the fixtures' own socket dirs
    terminalreporter.line("remove them when done: rm -rf " + " ".join(paths))


# -- helpers -------------------------------------------------------------------------------------
def _uses_daemon(item: pytest.Item) -> bool:
    return not _PROCESS_STATE_FIXTURES.isdisjoint(getattr(item, "fixturenames", ()))


def _failed(item: pytest.Item) -> bool:
    reports = item.stash.get(_reports_key, {})
    return any(r.failed for r in reports.values())


def _keeping(item: pytest.Item) -> bool:
    return item.config.getoption("shm_keep_on_failure") and _failed(item)


def _active_daemons(item: pytest.Item) -> list["Daemon"]:
    session_daemons = item.config.stash.get(_session_daemons_key, [])
    item_daemons = item.stash.get(_item_daemons_key, [])
    return [d for d in [*session_daemons, *item_daemons] if not d.closed]


def _keep(config: pytest.Config, nodeid: str, daemon: "Daemon") -> None:
    tmpdir = testing.daemons.tmpdir_of(daemon) or testing.short_tmpdir()
    config.stash.setdefault(_kept_key, []).append(
        (nodeid, daemon.socket_path, testing.segments_of(daemon.config.name_prefix),
         testing.daemons.copy_sealed_segments(daemon, tmpdir), tmpdir)
    )


def _finish_daemon(daemon: "Daemon", item: pytest.Item | None) -> None:
    """Teardown of one daemon fixture: stop it and require that nothing of its prefix remains in
    /dev/shm (with an active leak check: first report what is still live on it)."""
    check = item.stash.get(_check_key, None) if item is not None else None
    if check is not None and check.check_leases and not daemon.closed:
        # After the clients' teardown: what is still live is held by sessions nobody closed, or handed off.
        s = testing.settle_daemon(daemon, max_leases=0, max_objects=0, timeout_s=1.0)
        if s.live_objects or s.live_leases:
            check.report("still live after the client fixtures closed (an unclosed client, or a committed object "
                         "nobody released or acquired: it outlives its producer for the hand-off window):\n"
                         + testing.util.indent(testing.describe_daemon_state(daemon, s)) + check.describe_held(daemon))
    left = testing.stop_daemon(daemon)
    if left:
        pytest.fail(f"{daemon!r} left /dev/shm entries of its prefix after stop: {left}", pytrace=False)


def _start(config: pytest.Config, **overrides: Any) -> "Daemon":
    __tracebackhide__ = True  # a refused keyword or value is the test's line, not the plugin's
    overrides.setdefault("arena_nbytes", config.getoption("shm_arena_size"))
    return testing.start_daemon(**overrides)


# -- fixtures ------------------------------------------------------------------------------------
@pytest.fixture
def shm_owned_prefixes() -> tuple[str, ...]:
    """More name prefixes whose new /dev/shm entries ``shm_leak_check`` counts as the test's own,
    besides those it attributes itself (see ``testing.LeakCheck``): for entries a child process
    makes under its own naming and lets go of before the end. Default: none. ``("",)`` counts
    every new entry, whoever made it (for a machine nobody else uses)."""
    return ()


@pytest.fixture
def shm_leak_check(request: pytest.FixtureRequest, shm_owned_prefixes: tuple[str, ...]) -> Iterator[testing.LeakCheck]:
    """Fail the test at teardown if it leaves behind new /dev/shm entries of its own, open fds,
    live child processes, or live leases, loans or objects on a daemon fixture; each lease and
    loan still held is listed with the call site (file:line in function) that took it.

    Its own /dev/shm entries: names with this process's ``testing.RUN_PREFIX`` (one per xdist
    worker, on every daemon fixture) or a daemon fixture's prefix or a ``shm_owned_prefixes``
    one, and entries this process opened or mapped or that it or its children hold at the end
    (``testing.LeakCheck`` says exactly); those it reports are removed then. New entries of other
    processes (other xdist workers, anyone sharing /dev/shm) do not fail the test: they are noted
    in a "Captured shmtransport teardown" section. Also applied by ``@pytest.mark.shm_leak_check``. The value is the
    ``testing.LeakCheck``, with knobs: ``check_fds = False``, ``own_shm(prefix)``,
    ``ignore_shm(prefix)``, ..."""
    item = request.node
    if _uses_daemon(item) or "shmtransport.client" in sys.modules:
        testing.warm_up_process_state()  # gRPC's process-wide fds are not this test's leak
    check = testing.LeakCheck(shm_owned_prefixes)
    try:
        for daemon in request.config.stash.get(_session_daemons_key, []):
            check.watch_daemon(daemon)
    except BaseException:
        check.stop()  # no teardown follows a failed setup: recording must not outlive it
        raise
    item.stash[_check_key] = check
    yield check
    del item.stash[_check_key]
    if _keeping(item):
        # The failed test's daemon stays as it is: its segments and fds are not leaks.
        check.check_fds = False
        for _, _, segments, _, _ in request.config.stash.get(_kept_key, []):
            for name in segments:
                check.ignore_shm(name)
    problems, notes = check.problems()
    if notes:
        item.add_report_section("teardown", "shmtransport", "\n".join(notes))
    if problems:
        pytest.fail(check.failure_message(problems), pytrace=False)


@pytest.fixture
def shm_make_daemon(request: pytest.FixtureRequest) -> Iterator[Callable[..., "Daemon"]]:
    """Factory: ``shm_make_daemon(**DaemonConfig overrides)`` → a started in-process Daemon.

    The keywords are ``DaemonConfig`` fields; those a ``shmtransport daemon`` flag sets:
    ``arena_nbytes`` (``--arena-size``; default ``--shm-arena-size``), ``name_prefix``
    (``--name-prefix``; default a unique one), ``socket_path`` (``--socket``; default in a short
    /tmp directory), ``allowed_uids`` (``--allow-uid``), ``allowed_groups`` (``--allow-group``),
    ``socket_group`` (``--group``), ``quota_nbytes`` (``--quota-bytes``), ``quota_leases``
    (``--quota-leases``), ``max_sessions_per_tenant`` (``--max-sessions``), ``max_hold_ms``
    (``--max-hold-ms``), ``object_slots`` (``--object-slots``), ``share_object_table``
    (``--no-shared-table``), ``handoff_window_ms`` (``--handoff-window-ms``), ``cache_nbytes``
    (``--cache-size``), ``shm_reserve_nbytes`` (``--shm-reserve``), ``default_lease_ttl_ms``
    (``--lease-ttl-ms``), ``metrics_port`` (``--metrics-port``), ``metrics_address``
    (``--metrics-address``); and without a flag: ``max_lease_ttl_ms``, ``default_hold_ms``,
    ``shm_namespace``, ``commit_wait_s``, ``max_alloc_wait_ms``, ``page_align_min_nbytes``,
    ``grpc_workers``, ``stop_grace_s``. Another keyword is a one-line TypeError naming the field
    meant (``arena_size``: ``arena_nbytes``); a value out of range, ``DaemonConfig.validate``'s
    one-line InvalidArgument (a ValueError) naming the field and its range."""
    item = request.node
    started = item.stash.setdefault(_item_daemons_key, [])
    mine: list[Daemon] = []

    def factory(**overrides: Any) -> "Daemon":
        __tracebackhide__ = True
        testing.daemons.check_config_fields((n for n in overrides if n != "extensions"), "shm_make_daemon")
        daemon = _start(request.config, **overrides)
        started.append(daemon)
        mine.append(daemon)
        check = item.stash.get(_check_key, None)
        if check is not None:
            check.watch_daemon(daemon)
        return daemon

    yield factory
    keep = _keeping(item)
    errors: list[str] = []
    for daemon in mine:
        if keep:
            _keep(request.config, item.nodeid, daemon)
            continue
        try:
            _finish_daemon(daemon, item)
        except pytest.fail.Exception as exc:
            errors.append(str(exc))
        finally:
            started.remove(daemon)
    if errors:
        pytest.fail("\n".join(errors), pytrace=False)


@pytest.fixture
def shm_daemon(shm_make_daemon: Callable[..., "Daemon"]) -> "Daemon":
    """A real Daemon for this test (see ``shm_make_daemon``), stopped and checked at teardown."""
    return shm_make_daemon()


@pytest.fixture(scope="session")
def shm_daemon_session(request: pytest.FixtureRequest) -> Iterator["Daemon"]:
    """One real Daemon for the whole session; stopped and checked at the end of the session."""
    config = request.config
    daemon = _start(config)
    config.stash.setdefault(_session_daemons_key, []).append(daemon)
    yield daemon
    config.stash[_session_daemons_key].remove(daemon)
    if config.getoption("shm_keep_on_failure") and config.stash.get(_session_failed_key, False):
        _keep(config, "shm_daemon_session", daemon)
        return
    _finish_daemon(daemon, None)


def _client(request: pytest.FixtureRequest, cls: type[_ClientT], daemon: "Daemon") -> Iterator[_ClientT]:
    client = cls(daemon.socket_path, timeout_s=_CLIENT_TIMEOUT_S)
    yield client
    if not _keeping(request.node):  # on a kept failure the session keeps its objects alive
        client.close()


@pytest.fixture
def shm_producer(request: pytest.FixtureRequest, shm_daemon: "Daemon") -> Iterator[Producer]:
    """A ``Producer`` connected to ``shm_daemon``; closed at teardown."""
    from .client import Producer

    yield from _client(request, Producer, shm_daemon)


@pytest.fixture
def shm_consumer(request: pytest.FixtureRequest, shm_daemon: "Daemon") -> Iterator[Consumer]:
    """A ``Consumer`` connected to ``shm_daemon``; closed at teardown."""
    from .client import Consumer

    yield from _client(request, Consumer, shm_daemon)


@pytest.fixture
def shm_run_in_child() -> Callable[..., Any]:
    """``run_in_child(fn, *args, timeout_s=..., **kwargs)``: run module-level ``fn`` in a ``spawn``
    child; its result, or its exception re-raised here with the child's traceback as a note."""
    return testing.run_in_child
