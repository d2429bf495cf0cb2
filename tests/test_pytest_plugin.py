"""The pytest plugin (``shmtransport.pytest_plugin``) on sample downstream test files, each run in a
fresh pytest subprocess: fixtures work, leaks fail the leaking test and are listed (leases and
loans with their call sites), the options are honoured, every fixture is documented, and the
plugin does nothing for a suite that uses none of it. Under xdist: test_pytest_plugin_xdist.py."""
from __future__ import annotations

import os
import re
import secrets

import numpy as np
import pytest

from shmtransport import pytest_plugin
from shmtransport.testing import SHM_DIR, remove_tree

pytest_plugins = ["pytester"]

RUN_TIMEOUT_S = 60

# Each daemon fixture a sample test uses writes its name prefix here, so the outer test can check
# /dev/shm for exactly those prefixes (others may run daemons on this machine meanwhile).
RECORD_PREFIX = '''
def record(daemon):
    with open(os.path.join(os.path.dirname(__file__), "prefixes.txt"), "a") as f:
        f.write(daemon.config.name_prefix + "\\n")
'''

SAMPLE_FIXTURES = '''
import os
import subprocess
import sys
from multiprocessing import shared_memory

import numpy as np
import pytest

from shmtransport.client import Producer
from shmtransport.testing import BlockingChild
''' + RECORD_PREFIX + '''
LEAK_NAME = "{leak_name}"
_kept = []  # what the leaking tests hold on to until the end of the run


def child_square(x):
    return x * x


def child_fails():
    raise ValueError("boom in the child")


def child_holds_a_segment(conn, name):
    segment = shared_memory.SharedMemory(name=name, create=True, size=4096)  # mapped until killed
    conn.send(segment.name)
    conn.recv()


def test_round_trip_through_the_fixture_daemon(shm_producer, shm_consumer, shm_daemon):
    record(shm_daemon)
    x = np.arange(4096, dtype=np.float32)
    handle = shm_producer.put(x, digest=True)
    with shm_consumer.acquire(handle) as lease:
        lease.verify()
        assert np.array_equal(lease.array, x)
    shm_producer.release(handle, wait=True)


@pytest.mark.shm_leak_check
def test_clean_round_trip_passes_the_leak_check(shm_producer, shm_consumer, shm_daemon):
    record(shm_daemon)
    handle = shm_producer.put(np.ones(100, dtype=np.int64))
    with shm_consumer.acquire(handle) as lease:
        assert int(lease.array.sum()) == 100
    shm_producer.release(handle, wait=True)


def test_arena_size_option_is_honoured(shm_daemon):
    record(shm_daemon)
    assert shm_daemon.stat().arena.nbytes == 8 << 20


def test_session_daemon_serves_clients(shm_daemon_session):
    record(shm_daemon_session)
    with Producer(shm_daemon_session.socket_path, timeout_s=10) as producer:
        producer.release(producer.put(np.arange(10)), wait=True)


def test_run_in_child_returns_results_and_raises_child_errors(shm_run_in_child):
    assert shm_run_in_child(child_square, 7, timeout_s=60) == 49
    with pytest.raises(ValueError, match="boom in the child") as info:
        shm_run_in_child(child_fails, timeout_s=60)
    assert "traceback in the child process" in "".join(getattr(info.value, "__notes__", []))


@pytest.mark.shm_leak_check
def test_leaks_a_dev_shm_file():
    _kept.append(open(os.path.join("/dev/shm", LEAK_NAME), "w"))


def test_leaks_an_fd(shm_leak_check):
    _kept.extend(os.pipe())


@pytest.mark.shm_leak_check
def test_leaves_a_child_holding_a_segment():
    child = BlockingChild(child_holds_a_segment, LEAK_NAME + "child")
    child.recv(timeout_s=30)
    _kept.append(child)


@pytest.mark.shm_leak_check
def test_leaves_a_subprocess_running():
    _kept.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)  # SUBPROCESS"]))


def test_waits_for_its_subprocess(shm_leak_check):
    subprocess.run([sys.executable, "-c", "pass"], check=True, timeout=60)


@pytest.mark.shm_leak_check
def test_leaks_a_lease(shm_producer, shm_consumer, shm_daemon):
    record(shm_daemon)
    _kept.append(shm_consumer.acquire(shm_producer.put(np.arange(100))))  # LEASE


@pytest.mark.shm_leak_check
def test_keeps_a_view_of_a_released_lease(shm_producer, shm_consumer, shm_daemon):
    lease = shm_consumer.acquire(shm_producer.put(np.arange(100)))  # VIEW
    _kept.append(lease.array)  # the daemon keeps the lease while a view of its bytes lives
    lease.release()


@pytest.mark.shm_leak_check
def test_leaks_a_loan_on_an_unclosed_producer(shm_daemon):
    record(shm_daemon)
    producer = Producer(shm_daemon.socket_path, timeout_s=10)
    _kept.append((producer, producer.loan(100)))  # LOAN
'''

SAMPLE_HANDOFF = '''
import os

import numpy as np
import pytest

from shmtransport.client import Producer
''' + RECORD_PREFIX + '''
_kept = []


@pytest.mark.shm_leak_check
def test_leaks_a_lease_on_a_handed_off_object(shm_daemon, request):
    record(shm_daemon)
    with Producer(shm_daemon.socket_path, timeout_s=10) as producer:
        handle = producer.put(np.arange(100))
    # The object outlives its producer (hand-off); a consumer that connects now acquires it.
    consumer = request.getfixturevalue("shm_consumer")
    _kept.append(consumer.acquire(handle))


@pytest.mark.shm_leak_check
def test_leaves_a_handed_off_object(shm_producer, shm_daemon):
    record(shm_daemon)
    shm_producer.put(np.arange(100))  # never released nor acquired: it outlives the producer
'''

SAMPLE_KEEP = '''
import os

import numpy as np
''' + RECORD_PREFIX + '''

def test_default_arena_is_64_mib(shm_daemon):
    record(shm_daemon)
    assert shm_daemon.stat().arena.nbytes == 64 << 20


def test_fails_with_an_object_in_the_arena(shm_producer, shm_daemon):
    record(shm_daemon)
    shm_producer.put(np.arange(1000))
    assert False, "deliberate failure"
'''

SAMPLE_INERT = '''
import os
import sys

from shmtransport.testing import RUN_PREFIX


def test_plugin_is_loaded_but_started_nothing(request):
    assert request.config.pluginmanager.hasplugin("shmtransport")
    for module in ("shmtransport.daemon", "shmtransport.client", "grpc", "torch"):
        assert module not in sys.modules, module
    assert not [n for n in os.listdir("/dev/shm") if n.startswith(RUN_PREFIX)]
    assert request.config.getoption("shm_arena_size") == 64 << 20


def test_plain_test_still_runs():
    assert 1 + 1 == 2
'''


def recorded_prefixes(pytester: pytest.Pytester) -> list[str]:
    path = pytester.path / "prefixes.txt"
    return sorted(set(path.read_text().split())) if path.exists() else []


def leftovers(prefixes: list[str]) -> list[str]:
    return sorted(n for n in os.listdir(SHM_DIR) if n.startswith(tuple(p + "-" for p in prefixes)))


def line_of(path, marker: str) -> int:
    """The line of ``path`` that holds ``marker`` (makepyfile strips the source's leading lines)."""
    return next(i for i, line in enumerate(path.read_text().splitlines(), 1) if marker in line)


def teardown_errors(out: str) -> dict[str, str]:
    """Test name -> the text of its "ERROR at teardown" section in a pytest run's output."""
    return dict(re.findall(r"_+ ERROR at teardown of (\w+) _+\n(.*?)(?=\n_{3,} |\n=+ )", out, re.S))


def run(pytester: pytest.Pytester, *args: str) -> pytest.RunResult:
    return pytester.runpytest_subprocess("-p", "no:cacheprovider", *args, timeout=RUN_TIMEOUT_S)


def test_fixtures_round_trip_and_each_leak_fails_its_test_with_the_leak_listed(pytester):
    leak_name = "sampleleak" + secrets.token_hex(4)  # no prefix of the run: the sample opened it
    sample = pytester.makepyfile(test_sample=SAMPLE_FIXTURES.replace("{leak_name}", leak_name))
    try:
        result = run(pytester, "--shm-arena-size=8M")
    finally:
        for leaked in (leak_name, leak_name + "child"):
            if os.path.exists(os.path.join(SHM_DIR, leaked)):
                os.unlink(os.path.join(SHM_DIR, leaked))
    out = result.stdout.str()
    result.assert_outcomes(passed=13, errors=7)
    errors = teardown_errors(out)
    assert set(errors) == {"test_leaks_a_dev_shm_file", "test_leaks_an_fd", "test_leaves_a_child_holding_a_segment",
                           "test_leaves_a_subprocess_running", "test_leaks_a_lease",
                           "test_keeps_a_view_of_a_released_lease", "test_leaks_a_loan_on_an_unclosed_producer"}, out
    assert f"/dev/shm entries left behind: /dev/shm/{leak_name}" in errors["test_leaks_a_dev_shm_file"], out
    assert re.search(rf"fds left open: \d+ -> /dev/shm/{leak_name}", errors["test_leaks_a_dev_shm_file"]), out
    assert re.search(r"fds left open: \d+ -> pipe:\[\d+\], \d+ -> pipe:\[\d+\]", errors["test_leaks_an_fd"]), out
    child_block = errors["test_leaves_a_child_holding_a_segment"]  # the child made it, and holds it
    assert re.search(r"child processes still alive \(killed\): pid \d+ \(.*spawn_main", child_block), out
    # A child started with subprocess, not multiprocessing: found too, named by its command line.
    assert re.search(r"child processes still alive \(killed\): pid \d+ \(.*# SUBPROCESS\)",
                     errors["test_leaves_a_subprocess_running"]), out
    assert f"/dev/shm entries left behind: /dev/shm/{leak_name}child" in child_block, out
    lease_block = errors["test_leaks_a_lease"]
    assert "live leases left at the end of the test (1 new)" in lease_block, out
    assert re.search(r"client \w+ \(this process\): 1 lease\(s\)", lease_block), out
    # Each leaked lease and loan with the line of the test that took it.
    assert re.search(rf"Lease\(id=\d+, .*, live\) acquired at {re.escape(str(sample))}:{line_of(sample, '# LEASE')} "
                     r"in test_leaks_a_lease$", lease_block, re.M), out
    assert re.search(rf"Lease\(.*, released\) acquired at {re.escape(str(sample))}:{line_of(sample, '# VIEW')} in "
                     r"test_keeps_a_view_of_a_released_lease \(released, but a view of its bytes is still alive\)$",
                     errors["test_keeps_a_view_of_a_released_lease"], re.M), out
    loan_block = errors["test_leaks_a_loan_on_an_unclosed_producer"]
    assert "still live after the client fixtures closed" in loan_block, out
    assert re.search(rf"Loan\(.*, live\) loaned at {re.escape(str(sample))}:{line_of(sample, '# LOAN')} "
                     r"in test_leaks_a_loan_on_an_unclosed_producer$", loan_block, re.M), out
    assert "acquired at" not in errors["test_leaks_a_dev_shm_file"] + loan_block  # only a test's own views
    assert not leftovers(recorded_prefixes(pytester))  # every fixture daemon was stopped and unlinked


def test_what_a_hand_off_leaves_fails_its_test(pytester):
    """A committed object outlives its producer until a first acquire: a test that leaves one, or
    a lease on one, left something behind. (The consumer that takes a handed-off object over may
    get the session bit its producer had, in the object table: its lease is a lease all the same.)"""
    pytester.makepyfile(test_handoff=SAMPLE_HANDOFF)
    result = run(pytester)
    out = result.stdout.str()
    result.assert_outcomes(passed=2, errors=2)
    errors = teardown_errors(out)
    assert set(errors) == {"test_leaks_a_lease_on_a_handed_off_object", "test_leaves_a_handed_off_object"}, out
    lease_block = errors["test_leaks_a_lease_on_a_handed_off_object"]
    assert "live leases left at the end of the test (1 new)" in lease_block, out
    assert re.search(r"client \w+ \(this process\): 1 lease\(s\)", lease_block), out
    object_block = errors["test_leaves_a_handed_off_object"]
    assert "still live after the client fixtures closed" in object_block, out
    assert re.search(r"holds 1 live object\(s\) \(\d+ bytes\), 0 live lease\(s\)", object_block), out
    assert not leftovers(recorded_prefixes(pytester))


def test_keep_on_failure_leaves_the_failed_tests_daemon_segments_and_prints_where(pytester):
    pytester.makepyfile(test_keep=SAMPLE_KEEP)
    result = run(pytester, "--shm-keep-on-failure")
    prefixes = recorded_prefixes(pytester)
    kept = leftovers(prefixes)
    try:
        result.assert_outcomes(passed=1, failed=1)
        out = result.stdout.str()
        assert "daemon state kept for inspection" in out
        sockets = re.findall(r"^  socket: (\S+)$", out, re.M)
        segments = re.findall(r"^  segment: (\S+)$", out, re.M)
        assert len(sockets) == 1, out
        assert kept == []  # nothing by name: the passing test's daemon is gone, the failed one has no dedicated
        # Copies of its arena and object table (memfds, gone with the process) beside its socket;
        # the object the test put is in the arena's.
        kinds = {os.path.basename(path).rsplit("-", 1)[1]: path for path in segments}
        assert sorted(kinds) == ["arena", "holds", "objects"], out
        assert {os.path.dirname(path) for path in segments} == {os.path.dirname(sockets[0])}, out
        assert os.path.getsize(kinds["arena"]) == 64 << 20
        with open(kinds["arena"], "rb") as arena:
            assert np.arange(1000).tobytes() in arena.read()
    finally:
        for name in kept:
            os.unlink(os.path.join(SHM_DIR, name))
        for socket_path in re.findall(r"^  socket: (\S+)$", result.stdout.str(), re.M):
            if socket_path.startswith("/tmp/"):
                remove_tree(os.path.dirname(socket_path))


def test_plugin_is_inert_for_a_suite_that_uses_none_of_its_fixtures(pytester):
    pytester.makepyfile(test_plain=SAMPLE_INERT)
    result = run(pytester, "--trace-config")
    result.assert_outcomes(passed=2)
    assert re.search(r"shmtransport.*pytest_plugin", result.stdout.str()), "plugin not registered by its entry point"


def test_every_fixture_is_documented_in_pytest_fixtures(pytester):
    """``pytest --fixtures`` shows a docstring for each fixture (loading the plugin by module name
    too, where its entry point is installed), and the plugin's module docstring lists each one."""
    result = run(pytester, "--fixtures", "-p", "shmtransport.pytest_plugin")
    assert result.ret == 0, result.stderr.str()
    out = result.stdout.str()
    section = out.split("fixtures defined from shmtransport.pytest_plugin", 1)[1].split("\n---", 1)[0]
    docs = dict(re.findall(r"^(\w+)(?: \[\w+ scope\])? -- \S+\n((?: {4}.*\n)+)", section, re.M))
    assert set(docs) == {"shm_daemon", "shm_daemon_session", "shm_make_daemon", "shm_producer", "shm_consumer",
                         "shm_leak_check", "shm_owned_prefixes", "shm_run_in_child"}, out
    for name, doc in docs.items():
        assert "no docstring available" not in doc, (name, out)
        assert f"``{name}``" in pytest_plugin.__doc__, name
    assert "call site" in docs["shm_leak_check"], out


def test_bad_arena_size_is_a_usage_error(pytester):
    pytester.makepyfile(test_plain=SAMPLE_INERT)
    result = run(pytester, "--shm-arena-size=lots")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert "not a size: 'lots'" in result.stderr.str()
