"""Alternating rounds over transport peers, shared by the ``transport`` and ``scale`` suites.

A round runs every live peer's ``Session.iteration`` once; the first peer rotates each round, so
no peer always runs right after the same neighbour. Warm-up rounds are run and thrown away.
"""
from __future__ import annotations

import gc
import statistics
import traceback
from collections.abc import Callable

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30


def size_label(nbytes: int) -> str:
    for unit, scale in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale}{unit}"
    return f"{nbytes}B"


def run_rounds(report, live, order, payload, nbytes, rounds, warmup, samples, flags, failed, between) -> None:
    """Warm-up then timed rounds; each round runs every live peer once, the first peer rotating."""
    for round_no in range(warmup + rounds):
        if round_no == warmup:
            for session in live.values():
                session.usage.take(0)  # resource use counts timed rounds only
        shift = round_no % len(order) if order else 0
        for name in order[shift:] + order[:shift]:
            if name in failed:
                continue
            try:
                seconds, ok = live[name].iteration(payload)
            except Exception:  # noqa: BLE001
                failed.add(name)
                report.notes.append(f"ERROR {name} at {size_label(nbytes)}, round {round_no}; "
                                    f"row omitted:\n" + traceback.format_exc(limit=6))
                continue
            if round_no >= warmup:
                samples[name].append(seconds)
                flags[name] = flags[name] and ok
        between()  # untimed: e.g. sample the daemon's RSS (an object may still be held here)


def measure_size(report, sessions: dict, payload, digest: int, nbytes: int, rounds: int, warmup: int,
                 between: Callable[[], None] = lambda: None) -> dict[str, tuple[list[float], bool]]:
    """Prepare every session for ``nbytes``, run the rounds with the collector off; per peer that
    finished: (timed samples, AND of the receiver's flags). Failures become notes, not rows."""
    live = {}
    for name, session in sessions.items():
        try:
            session.prepare(nbytes, digest)
            live[name] = session
        except Exception:  # noqa: BLE001
            report.notes.append(f"ERROR {name} setup at {size_label(nbytes)}:\n" + traceback.format_exc(limit=6))
    samples: dict[str, list[float]] = {name: [] for name in live}
    flags: dict[str, bool] = {name: True for name in live}
    failed: set[str] = set()
    order = list(live)
    gc.collect()
    gc.disable()  # as timeit does: no collector pauses inside a timed span
    try:
        run_rounds(report, live, order, payload, nbytes, rounds, warmup, samples, flags, failed, between)
    finally:
        gc.enable()
    return {name: (samples[name], flags[name]) for name in order if name not in failed and samples[name]}


def add_size_row(report, session, name: str, samples: list[float], ok: bool, nbytes: int, **extra) -> None:
    """One peer at one size: latency, throughput and the session's resource use over the timed rounds."""
    payload = name != "bare_rtt"  # the bare round trip moves no payload
    extra["gbps" if payload else "payload_nbytes"] = (round(nbytes / statistics.median(samples) / 1e9, 4) if payload
                                                      else 0)
    extra.update(session.usage.take(nbytes if payload else 0))
    report.add_row(name, samples, ok, size=size_label(nbytes), nbytes=nbytes, extra=extra)


def close_sessions(report, sessions: dict, daemon=None) -> None:
    """Close every session (a failure becomes a note), then the daemon."""
    for session in sessions.values():
        try:
            session.close()
        except Exception:  # noqa: BLE001
            report.notes.append(f"ERROR closing {session.peer_name}:\n" + traceback.format_exc(limit=4))
    if "iceoryx2_loan" in sessions:  # its processes are gone now: so may its management file be
        from peers._iceoryx2 import remove_management_file

        remove_management_file()
    if daemon is not None:
        daemon.stop()
