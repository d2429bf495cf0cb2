"""The plugin's leak check where /dev/shm is shared: under pytest-xdist (``-n 2``) each worker's
clean tests pass while the other worker creates daemons and segments, and a planted leak still
fails with only the leaking test's own entries and the lease's call site listed; an unrelated
process that makes /dev/shm entries during a clean leak-checked test does not fail it either.

The sample tests run at the same time on purpose: they wait on each other's marker files (with a
deadline), so the other worker's entries appear and stay while the first test is leak-checked."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
from test_pytest_plugin import line_of, run, teardown_errors

from shmtransport.testing import SHM_DIR

pytest_plugins = ["pytester"]

SYNC_TIMEOUT_S = 30

# Marker files in the sample's directory: one test signals, another waits for the signal.
SYNC = '''
import os

from shmtransport.testing import wait_until

HERE = os.path.dirname(os.path.abspath(__file__))


def signal(name, text=""):
    tmp = os.path.join(HERE, f"{name}.{os.getpid()}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
    os.rename(tmp, os.path.join(HERE, name))  # appears whole


def await_signal(name):
    wait_until(lambda: os.path.exists(os.path.join(HERE, name)), timeout_s=30, what=f"signal {name}")
'''

# After each test's teardown (its leak check included): its notes, in notes-TEST; "first-checked".
# (Under xdist both the worker and the controller run this hook, with the same report.)
CONFTEST = SYNC + '''

def pytest_runtest_logreport(report):
    if report.when == "teardown":
        test = report.nodeid.rsplit("::", 1)[1]
        signal("notes-" + test, "".join(c for title, c in report.sections if title == "Captured shmtransport teardown"))
        if test == "test_first":
            signal("first-checked")
'''

SAMPLE_XDIST = SYNC + '''
from multiprocessing import shared_memory

import numpy as np
import pytest

PLANT_LEAKS = {plant}
LEAK_NAME = "{leak_name}"
_kept = []


@pytest.mark.xdist_group("first")
@pytest.mark.shm_leak_check
def test_first(shm_producer, shm_consumer):
    signal("first-started")
    await_signal("second-made")  # the other worker's segments are there from now on
    handle = shm_producer.put(np.arange(1000))
    with shm_consumer.acquire(handle) as lease:
        assert int(lease.array.sum()) == 499500
    shm_producer.release(handle, wait=True)
    segment = shared_memory.SharedMemory(create=True, size=4096)  # a clean one: unlinked
    segment.close()
    segment.unlink()
    if PLANT_LEAKS:
        shared_memory.SharedMemory(name=LEAK_NAME, create=True, size=4096).close()  # never unlinked
        _kept.append(shm_consumer.acquire(shm_producer.put(np.arange(10))))  # LEASE


@pytest.mark.xdist_group("second")
@pytest.mark.shm_leak_check
def test_second(shm_make_daemon):
    from shmtransport.client import Producer

    await_signal("first-started")
    daemon = shm_make_daemon()  # while the first test's leak check runs
    producer = Producer(daemon.socket_path, timeout_s=10)
    dedicated = producer.put(np.arange(10), dedicated=True)  # the daemon's one kind of segment with a name
    held = shared_memory.SharedMemory(create=True, size=4096)  # mapped by this worker
    left = shared_memory.SharedMemory(create=True, size=4096)
    left.close()  # held by nobody
    signal("second-made", " ".join([daemon.config.name_prefix, held.name.lstrip("/"), left.name.lstrip("/")]))
    await_signal("first-checked")
    producer.release(dedicated, wait=True)
    producer.close()
    held.close()
    held.unlink()
    left.unlink()
'''

SAMPLE_UNRELATED = SYNC + '''
import numpy as np
import pytest


@pytest.mark.shm_leak_check
def test_clean_while_another_process_makes_segments(shm_producer, shm_consumer):
    signal("started")
    await_signal("made")
    handle = shm_producer.put(np.arange(100))
    with shm_consumer.acquire(handle) as lease:
        assert int(lease.array.sum()) == 4950
    shm_producer.release(handle, wait=True)
'''

# Not a child of the sample's pytest: waits for its test to start, makes a segment it keeps mapped
# and a file it closes, and removes both when told to.
UNRELATED_PROCESS = '''
import os
import sys
from multiprocessing import shared_memory

from shmtransport.testing import wait_until

here = sys.argv[1]
wait_until(lambda: os.path.exists(os.path.join(here, "started")), timeout_s=30, what="the sample test")
held = shared_memory.SharedMemory(create=True, size=4096)
plain = "/dev/shm/unrelated" + held.name.lstrip("/")
open(plain, "w").close()
print(held.name.lstrip("/"), os.path.basename(plain), flush=True)
open(os.path.join(here, "made"), "w").close()
sys.stdin.read()  # until the test closes our stdin
held.close()
held.unlink()
os.unlink(plain)
'''


@pytest.fixture(autouse=True)
def _xdist():
    pytest.importorskip("xdist")


def notes(pytester: pytest.Pytester, test: str) -> str:
    """What the leak check of ``test`` noted (its "Captured shmtransport teardown" section)."""
    return (pytester.path / f"notes-{test}").read_text()


def run_xdist(pytester: pytest.Pytester, plant: bool, leak_name: str = "") -> tuple[pytest.RunResult, list[str]]:
    """The sample on two workers; (result, [second's daemon prefix, held segment, unheld segment])."""
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(test_xdist=SAMPLE_XDIST.replace("{plant}", str(plant)).replace("{leak_name}", leak_name))
    result = run(pytester, "-p", "xdist", "-n", "2", "--dist", "loadgroup")
    made = pytester.path / "second-made"
    return result, made.read_text().split() if made.exists() else []


def test_clean_tests_on_two_workers_pass_while_each_other_makes_segments(pytester):
    result, (prefix, held, left) = run_xdist(pytester, plant=False)
    out = result.stdout.str()
    result.assert_outcomes(passed=2)
    note = notes(pytester, "test_first")  # the other worker's entries were new, and only noted
    assert "not counted" in note and all(name in note for name in (held, left)), out
    assert re.search(rf"'{prefix}-\w+-t0-obj\d+-[0-9a-f]+'", note), out


def test_a_leak_planted_on_one_worker_fails_with_only_its_own_entries(pytester):
    leak_name = "psm_planted" + os.urandom(4).hex()
    try:
        result, (prefix, held, left) = run_xdist(pytester, plant=True, leak_name=leak_name)
        leak_kept = os.path.exists(os.path.join(SHM_DIR, leak_name))
    finally:
        if os.path.exists(os.path.join(SHM_DIR, leak_name)):
            os.unlink(os.path.join(SHM_DIR, leak_name))
    out = result.stdout.str()
    result.assert_outcomes(passed=2, errors=1)
    assert not leak_kept, out  # the check that reported it removed it
    errors = teardown_errors(out)
    assert set(errors) == {"test_first"}, out
    report = errors["test_first"].split("\n---", 1)[0]  # without its notes
    assert f"/dev/shm entries left behind: /dev/shm/{leak_name}\n" in report, out  # that one alone
    assert "live leases left at the end of the test (1 new)" in report, out
    sample = pytester.path / "test_xdist.py"
    assert f" acquired at {sample}:{line_of(sample, '# LEASE')} in test_first\n" in report, out
    assert not any(name in report for name in (prefix, held, left)), out
    assert all(name in notes(pytester, "test_first") for name in (prefix, held, left)), out  # they were there


def test_an_unrelated_process_making_segments_does_not_fail_a_clean_test(pytester):
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(test_unrelated=SAMPLE_UNRELATED)
    other = subprocess.Popen([sys.executable, "-c", UNRELATED_PROCESS, str(pytester.path)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        result = run(pytester)
    finally:
        other.stdin.close()  # it removes what it made, and exits
        other.wait(timeout=SYNC_TIMEOUT_S)
    with other.stdout:
        names = other.stdout.read().split()
    out = result.stdout.str()
    result.assert_outcomes(passed=1)
    assert len(names) == 2, out
    note = notes(pytester, "test_clean_while_another_process_makes_segments")
    assert "not counted" in note and all(name in note for name in names), out
    assert not [n for n in names if os.path.exists(os.path.join(SHM_DIR, n))]
