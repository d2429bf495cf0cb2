"""Chaos: random producer/consumer workloads while producers, consumers and the daemon process are
SIGKILLed at chosen points (``tools/chaos.py``). The invariants: no leaks, no hang, no stale or
foreign bytes, no refusal of a live instance's handle, only typed errors; see the harness's
docstring for the full list of checks.

The CI run (>= 200 iterations) runs only when SHMTRANSPORT_BACKEND is ``c`` or unset: it exercises
the daemon, sessions and client lifetimes, not the kernels (the python backend computes the same
digests), so running it twice would only double its cost.

Full run (>= 2,000 iterations):  .venv/bin/python tools/chaos.py --iterations 2000 --seed 1
Soak (10 minutes, not in CI):     SHMTRANSPORT_SOAK_S=600 .venv/bin/python -m pytest tests/chaos -k soak
"""
from __future__ import annotations

import os
import pathlib
import sys

import numpy as np
import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "tools"))

import chaos

from shmtransport import testing
from shmtransport.client import Consumer, Producer

TIMEOUT_S = 10.0
CI_ITERATIONS = int(os.environ.get("SHMTRANSPORT_CHAOS_ITERATIONS", "200"))
_backend = os.environ.get("SHMTRANSPORT_BACKEND", "c") or "c"


@pytest.mark.skipif(_backend != "c", reason="chaos exercises lifetimes, not kernels: run once, with the c backend")
@pytest.mark.timeout(150)
def test_random_kills_of_any_party_at_any_point_leave_no_leak_no_hang_and_only_verified_bytes_or_typed_errors():
    report = chaos.run_chaos(CI_ITERATIONS, seed=int(os.environ.get("SHMTRANSPORT_CHAOS_SEED", "20261130")))
    assert not report["failures"], "\n".join(report["failures"][:20])
    assert report["iterations"] == CI_ITERATIONS
    # The harness really injected kills of every party, and transfers really happened.
    assert set(report["kills"]) >= {"producer", "consumer", "daemon"}, report["kills"]
    assert report["kills_total"] >= CI_ITERATIONS // 3
    assert report["outcomes"].get("get:ok", 0) >= CI_ITERATIONS // 4, report["outcomes"]
    assert report["final"]["baseline"] is not None
    # Every table-internal kill point was hit, and the fixed stale-instance bug stayed fixed (each
    # refusal is also a failure above; this names the bug when it returns).
    assert {p for points in report["kills"].values() for p in points} & set(chaos.TABLE_PRODUCER_POINTS)
    assert report["stale_instance_refusals"] == 0, report["outcomes"]


@pytest.mark.skipif(_backend != "c", reason="chaos exercises lifetimes, not kernels")
@pytest.mark.parametrize("party,point", [("producer", "mid_copy"), ("consumer", "c_after_acquire"),
                                         ("daemon", "mid_copy"), ("daemon", "c_after_acquire"),
                                         ("producer", "c_after_acquire"), ("stall", "c_after_acquire"),
                                         # inside the object table's sequences
                                         ("producer", "t_after_grant"), ("producer", "t_after_publish"),
                                         ("producer", "t_before_commit"), ("consumer", "c_t_after_acquire"),
                                         ("daemon", "c_t_after_acquire"), ("consumer", "c_t_after_release")])
def test_a_kill_at_a_chosen_point_is_injected_there_and_the_daemon_settles_clean(party, point):
    c = chaos.Chaos(seed=7)
    with c:
        c.iteration(party, point)
        c.iteration("none", "before_loan")  # the survivors (or their respawns) still move bytes
        c.final_check()
    report = c.report()
    assert not report["failures"], report["failures"]
    assert report["kills"] == {party: {point: 1}}
    # after the kill, an iteration without kills delivered verified bytes
    assert report["outcomes"].get("get:ok", 0) >= 1, report["outcomes"]
    if party == "stall":  # the lease outlived its TTL (quarantined) or is held in the table: never reused
        assert report["outcomes"].get("stall:lease_held_in_table") == 1, report["outcomes"]
        assert report["outcomes"].get("get:ok") == 2 and not report["outcomes"].get("get:foreign"), report["outcomes"]


def test_the_harness_reports_foreign_bytes_as_a_failure():
    """The check can fail: a worker answer of stale/foreign bytes is a failure, not a typed error."""
    c = chaos.Chaos(seed=0)  # not started: only its accounting of worker answers runs
    try:
        c._note("get", ("foreign", ("IdentityMismatch", "identity_mismatch", "digest mismatch")))
        c._note("put", ("crash", "Traceback: KeyError"))
        c._note("get", ("silent_foreign", ("-", "-", "digest verified but the bytes differ")))
        c._note("get", ("stale_instance", ("Unavailable", "instance_mismatch", "handle of daemon instance 'b', "
                                                                               "connected to 'a'")))
        assert len(c.failures) == 4 and c.stale_instance_refusals == 1
    finally:
        testing.remove_tree(c.tmp)


ARRAY = np.arange(4096, dtype=np.float32)


def test_a_consumer_idle_across_a_daemon_restart_acquires_handles_of_the_new_instance(make_daemon, monkeypatch):
    """However recent its last liveness check: a handle of a newer instance makes it check."""
    from shmtransport.client.connection import _Connection

    monkeypatch.setattr(_Connection, "LIVENESS_CHECK_S", 3600.0)  # the restart falls inside the window
    tmp = testing.short_tmpdir()
    path = os.path.join(tmp, "d.sock")
    try:
        first = make_daemon(socket_path=path)
        with Consumer(path, timeout_s=TIMEOUT_S) as consumer:
            consumer.stat()
            first.stop()
            make_daemon(socket_path=path)
            with Producer(path, timeout_s=TIMEOUT_S) as producer:
                handle = producer.put(ARRAY, digest=True)
                try:
                    lease = consumer.acquire(handle)
                    lease.verify()
                    consumer.release([lease], wait=True)
                finally:
                    producer.release(handle, wait=True)
    finally:
        testing.remove_tree(tmp)


@pytest.mark.skipif(not os.environ.get("SHMTRANSPORT_SOAK_S"), reason="soak: set SHMTRANSPORT_SOAK_S=600 (not in CI)")
@pytest.mark.timeout(0)
def test_soak_throughput_stays_within_10_percent_and_rss_and_leaks_stay_flat():
    report = chaos.run_soak(float(os.environ["SHMTRANSPORT_SOAK_S"]), seed=1)
    assert not report["failures"], report["failures"]
    assert report["stale_instance_refusals"] == 0
