"""The suite's policy, built on the shmtransport pytest plugin (``shmtransport.pytest_plugin``,
loaded through its ``pytest11`` entry point; its helpers are in ``shmtransport.testing``).

- autouse ``no_leaks``: the plugin's ``shm_leak_check`` on every test: a test fails if it leaves a
  new /dev/shm entry of its own (named with this process's daemons' prefixes, or opened, mapped or
  still held by this process or its children; other new entries are only noted: /dev/shm is
  shared with other people), an open fd (after up to ~2 s of settling: gRPC closes channels
  asynchronously), a live child process or a live lease on a daemon fixture. Opt out per test with
  ``@pytest.mark.allow_leaks``.
- ``make_daemon(**overrides)``: the plugin's ``shm_make_daemon`` (short socket path, unique name
  prefix, 64 MiB arena unless overridden or ``--shm-arena-size``), plus this suite's rule that at
  teardown the daemon's stat shows no live objects and no live leases (opt out with
  ``@pytest.mark.allow_live_objects``).
- ``daemon``: ``make_daemon()`` with the defaults.
- ``new_prefix``: factory of fresh segment-name prefixes for daemons a test starts itself.
- ``vllm_session`` (tests/vllm_engine.py): vLLM's real engine behind our worker and the stock server,
  started once per run and shared by every module and doc example that needs it.
- ``ONCE_UNDER_C``: modules whose subject is not the kernels run under the C backend only.
- Optional packages: a module that needs one (``OPTIONAL``, or ``pytest.importorskip`` inside)
  is skipped where it is missing, e.g. in a venv with only the wheel and its test tools. Under
  ``SHMTRANSPORT_REQUIRE_EXTRAS=1`` (``make test``) a missing one fails instead: there, a skip
  for want of a package would be a test that silently stopped testing.
"""
from __future__ import annotations

import faulthandler
import gc
import importlib.util
import os
import tempfile
import warnings

import pytest
from vllm_engine import vllm_session  # noqa: F401 - the one vLLM engine session of the run

from shmtransport import testing  # noqa: E402
from shmtransport.daemon import Daemon  # noqa: E402
from shmtransport.errors import DeadlineExceeded  # noqa: E402

DAEMON_SETTLE_S = 3.0
REQUIRE_EXTRAS = os.environ.get("SHMTRANSPORT_REQUIRE_EXTRAS") == "1"

# Test modules that import optional upstream packages at their top.
OPTIONAL = {
    "test_bridges_smg.py": ("torch", "smg_grpc_servicer"),
    "test_conformance_dynamo.py": ("torch", "vllm", "dynamo"),
    "test_conformance_smg.py": ("torch", "vllm", "smg_grpc_servicer"),
    "test_conformance_vllm.py": ("torch", "vllm"),
    "test_embedmask.py": ("torch", "vllm"),
    "test_engine_vllm.py": ("torch", "vllm", "transformers"),
    "test_ec_connector.py": ("torch", "vllm", "openai"),
    "test_ec_connector_scheduler.py": ("torch", "vllm"),
    "test_protocol_e2e.py": ("torch",),
}


# Test modules whose subject does not depend on the kernels, run once: under the C backend (what
# `make demo` and the wheel use). Each reason says why the pure-Python run would only repeat it.
ONCE_UNDER_C = {
    "test_engine_vllm.py": "vLLM's engine behind our worker (~3 min of engine start); the pure-Python "
                           "kernels' part of that path is in the protocol and worker tests",
    "test_engine_handles.py": "handles through vLLM's engine to the model, at TP=1 and TP=2 (engine starts); "
                              "the resolver under both backends is test_handle_items.py",
    "test_generator_client.py": "the public Generator client against vLLM's engine (the shared engine session "
                                "starts once, under C); its Python code does not touch the kernels",
    "test_engine_families.py": "several model families on vLLM's engine (three engine sessions); the kernels' part "
                               "of that path runs under both backends in the protocol and worker tests",
    "test_vllm_renderer.py": "vLLM's own processor against our hand-written renderer (no kernel involved)",
    "test_ec_connector.py": "encoder disaggregation on vLLM's OpenAI servers (five engine starts); the identity "
                            "index under both backends is test_identity_index.py",
    "test_aio.py": "the asyncio wrapper; its tests already run each call with and without the object table",
    "test_pytest_plugin_xdist.py": "the plugin's leak attribution under xdist",
    "test_packaging.py": "building and installing the artifacts",
    "test_layers.py": "the import graph",
    "test_cli_worker.py": "the workers' command lines (each vLLM-worker case imports vLLM, ~20 s)",
    "test_bench_peers.py": "the benchmark harness's peers (benchmarks measure what ships: the C kernels)",
    "test_bench_scale.py": "the benchmark harness's scale suite and plots (benchmarks measure the C kernels)",
}
BACKEND_UNDER_TEST = os.environ.get("SHMTRANSPORT_BACKEND", "auto").strip().lower()


def pytest_collection_modifyitems(config, items):
    if BACKEND_UNDER_TEST != "python":
        return
    for item in items:
        reason = ONCE_UNDER_C.get(item.path.name)
        if reason is not None:
            item.add_marker(pytest.mark.skip(reason=f"runs once, under the C backend: {reason}"))


def _missing(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is None
    except ImportError:
        return True


def pytest_pycollect_makemodule(module_path, parent):
    missing = [m for m in OPTIONAL.get(module_path.name, ()) if _missing(m)]
    if missing and not REQUIRE_EXTRAS:
        return _SkippedModule.from_parent(parent, path=module_path, missing=missing)
    return None  # the usual Module


class _SkippedModule(pytest.File):
    """Stands for a test module whose optional packages are missing: one visible skip."""

    def __init__(self, *, missing: list[str], **kwargs):
        super().__init__(**kwargs)
        self.missing = missing

    def collect(self):
        pytest.skip(f"{self.path.name}: could not import {', '.join(self.missing)}: not installed",
                    allow_module_level=True)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    if call.excinfo is not None and call.excinfo.errisinstance(DeadlineExceeded):
        # A call of ours ran out of time: where every thread of this process (the in-process
        # daemons' among them) is right now says what it waited for.
        with tempfile.TemporaryFile("w+") as f:
            faulthandler.dump_traceback(f, all_threads=True)
            f.seek(0)
            item.add_report_section(call.when, "threads when the deadline passed", f.read())
    report = yield
    if REQUIRE_EXTRAS and report.skipped and "could not import" in str(report.longrepr):
        report.outcome = "failed"  # SHMTRANSPORT_REQUIRE_EXTRAS: the environment is incomplete
    return report


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector):
    report = yield
    if REQUIRE_EXTRAS and report.skipped and "could not import" in str(report.longrepr):
        report.outcome = "failed"
    return report


def pytest_configure(config):
    config.addinivalue_line("markers", "allow_live_objects: the daemon fixture skips its zero-live-objects check")
    config.addinivalue_line("markers", "allow_leaks: skip the /dev/shm, fd and child-process leak check")


@pytest.fixture(scope="session", autouse=True)
def _warm_up_process_state():
    """Create the process-wide state that gRPC, the client and multiprocessing's spawn keep for the
    whole run once, up front, so the per-test fd check sees only what a test itself opened."""
    try:
        testing.warm_up_process_state()
    except Exception as exc:  # the daemon tests will say what is wrong; other tests still run
        warnings.warn(f"could not warm up a daemon and client ({exc!r}): fd checks may over-report", stacklevel=2)
    # Everything imported at collection (torch, vLLM, ...) lives for the whole run: keep it out of
    # the collections the leak check runs around every test, which otherwise scan millions of
    # objects (about 0.5 s a test once vLLM is loaded).
    gc.collect()
    gc.freeze()
    yield
    gc.unfreeze()  # let the interpreter's exit tear them down as usual


@pytest.fixture(autouse=True)
def no_leaks(request):
    if request.node.get_closest_marker("allow_leaks"):
        yield None
        return
    check = request.getfixturevalue("shm_leak_check")
    if request.node.get_closest_marker("allow_live_objects"):
        check.check_leases = False
    yield check


@pytest.fixture
def make_daemon(request, shm_make_daemon):
    started: list[Daemon] = []

    def factory(**overrides) -> Daemon:
        daemon = shm_make_daemon(**overrides)
        started.append(daemon)
        return daemon

    yield factory

    if request.node.get_closest_marker("allow_live_objects") is not None:
        return
    failures = []
    for daemon in started:
        if daemon.closed:
            continue
        s = testing.settle_daemon(daemon, max_leases=0, max_objects=0, timeout_s=DAEMON_SETTLE_S)
        if s.live_objects or s.live_leases or s.used_nbytes:
            failures.append(
                f"{daemon!r} still holds {s.live_objects} objects, {s.live_leases} leases, "
                f"{s.used_nbytes} bytes at teardown\n  " + testing.describe_daemon_state(daemon, s)
            )
    if failures:
        pytest.fail("\n".join(failures), pytrace=False)


@pytest.fixture
def daemon(make_daemon) -> Daemon:
    return make_daemon()


@pytest.fixture
def pair(daemon):
    """A producer and a consumer of ``daemon``, closed after the test."""
    from shmtransport.client import Consumer, Producer

    with Producer(daemon.config.socket_path, timeout_s=10.0) as producer, \
            Consumer(daemon.config.socket_path, timeout_s=10.0) as consumer:
        yield producer, consumer


@pytest.fixture
def tmpdir_short():
    """A fresh directory with a short path (AF_UNIX socket paths are limited to 108 bytes)."""
    path = testing.short_tmpdir()
    yield path
    testing.remove_tree(path)


@pytest.fixture
def new_prefix():
    """Factory of segment-name prefixes for daemons a test starts itself (e.g. through the CLI)."""
    return testing.unique_prefix
