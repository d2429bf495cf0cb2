"""The client's one background thread (``_delayed.DelayedCall``): the earliest request wins, a run
never overlaps another, and stop ends the thread."""
from __future__ import annotations

import threading
import time

from shmtransport._delayed import DelayedCall
from shmtransport.testing import wait_until


def test_the_earliest_request_wins_and_later_ones_do_not_postpone_it():
    runs = []
    call = DelayedCall(lambda: runs.append(time.monotonic()), name="t")
    start = time.monotonic()
    call.within(0.05)
    call.within(10.0)  # later: the 50 ms run stands
    wait_until(lambda: runs, timeout_s=5, what="the run")
    assert runs[0] - start < 5.0
    call.within(10.0)
    call.within(0.0)  # earlier: moves the next run up
    wait_until(lambda: len(runs) == 2, timeout_s=5, what="the second run")
    call.stop()


def test_many_requests_while_a_run_is_in_progress_make_one_more_run_on_one_thread():
    entered, go, runs = threading.Event(), threading.Event(), []

    def run():
        runs.append(threading.current_thread().name)
        entered.set()
        go.wait(5)

    call = DelayedCall(run, name="the-one-thread")
    call.within(0.0)
    assert entered.wait(5)
    before = threading.active_count()
    for _ in range(100):
        call.within(0.0)
    assert threading.active_count() == before  # no thread per request
    go.set()
    wait_until(lambda: len(runs) == 2, timeout_s=5, what="one more run")
    call.stop()
    assert set(runs) == {"the-one-thread"}


def test_cancel_forgets_and_stop_ends_the_thread():
    runs = []
    call = DelayedCall(lambda: runs.append(1), name="stop-ends-me")
    call.within(0.2)
    call.cancel()
    call.within(0.0)
    wait_until(lambda: runs, timeout_s=5, what="the run after cancel")
    call.stop()
    assert not [t for t in threading.enumerate() if t.name == "stop-ends-me"]
    call.within(0.0)  # after stop: nothing runs
    assert runs == [1]
