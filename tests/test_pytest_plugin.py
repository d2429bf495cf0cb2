"""The pytest plugin (``shmtransport.pytest_plugin``) on sample downstream test files, each run in a
fresh pytest subprocess: fixtures work, leaks fail the leaking test and are listed, the options are
honoured, and the plugin does nothing for a suite that uses none of it."""
from __future__ import annotations

import os
import re
import secrets

import pytest

from shmtransport import objtable
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
import sys

import numpy as np
import pytest

from shmtransport.client import Producer
from shmtransport.testing import RUN_PREFIX
''' + RECORD_PREFIX + '''
LEAK_NAME = "{leak_name}"
_kept = []  # what the leaking tests hold on to until the end of the run


def child_square(x):
    return x * x


def child_fails():
    raise ValueError("boom in the child")


@pytest.fixture
def shm_owned_prefixes():
    # /dev/shm is shared with other processes on this machine: only ours fail a test
    return (RUN_PREFIX, LEAK_NAME)


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
def test_leaks_a_lease(shm_producer, shm_consumer, shm_daemon):
    record(shm_daemon)
    _kept.append(shm_consumer.acquire(shm_producer.put(np.arange(100))))
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


def teardown_errors(out: str) -> dict[str, str]:
    """Test name -> the text of its "ERROR at teardown" section in a pytest run's output."""
    return dict(re.findall(r"_+ ERROR at teardown of (\w+) _+\n(.*?)(?=\n_{3,} |\n=+ )", out, re.S))


def run(pytester: pytest.Pytester, *args: str) -> pytest.RunResult:
    return pytester.runpytest_subprocess("-p", "no:cacheprovider", *args, timeout=RUN_TIMEOUT_S)


def test_fixtures_round_trip_and_each_leak_fails_its_test_with_the_leak_listed(pytester):
    leak_name = "shmtpyleak" + secrets.token_hex(4)
    pytester.makepyfile(test_sample=SAMPLE_FIXTURES.replace("{leak_name}", leak_name))
    try:
        result = run(pytester, "--shm-arena-size=8M")
    finally:
        leaked = os.path.join(SHM_DIR, leak_name)
        if os.path.exists(leaked):
            os.unlink(leaked)
    out = result.stdout.str()
    result.assert_outcomes(passed=8, errors=3)
    errors = teardown_errors(out)
    assert set(errors) == {"test_leaks_a_dev_shm_file", "test_leaks_an_fd", "test_leaks_a_lease"}, out
    assert f"/dev/shm entries left behind: /dev/shm/{leak_name}" in errors["test_leaks_a_dev_shm_file"], out
    assert re.search(rf"fds left open: \d+ -> /dev/shm/{leak_name}", errors["test_leaks_a_dev_shm_file"]), out
    assert re.search(r"fds left open: \d+ -> pipe:\[\d+\], \d+ -> pipe:\[\d+\]", errors["test_leaks_an_fd"]), out
    lease_block = errors["test_leaks_a_lease"]
    assert "live leases left at the end of the test (1 new)" in lease_block, out
    assert re.search(r"client \w+ \(this process\): 1 lease\(s\)", lease_block), out
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
        segments = re.findall(r"^  segment: /dev/shm/(\S+)$", out, re.M)
        assert len(sockets) == 1, out
        assert kept == segments  # only the failed test's daemon was kept; the passing one is gone
        # Its arena, and its object table's control segment where it keeps one (the object is there).
        kinds = {name.rsplit("-", 1)[1]: name for name in segments}
        assert sorted(kinds) == (["arena", "objects"] if objtable.available() else ["arena"]), out
        assert os.path.getsize(os.path.join(SHM_DIR, kinds["arena"])) == 64 << 20
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


def test_bad_arena_size_is_a_usage_error(pytester):
    pytester.makepyfile(test_plain=SAMPLE_INERT)
    result = run(pytester, "--shm-arena-size=lots")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert "not a size: 'lots'" in result.stderr.str()
