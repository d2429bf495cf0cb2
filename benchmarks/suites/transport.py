"""``transport``: one tensor handoff between two processes, shmtransport against its peers.

    python benchmarks/run.py transport [--quick] [--json PATH]

One timed iteration = the producer starts the handoff -> the consumer has the bytes (or a view) ->
the consumer acks -> the producer has the ack. Outside the span the consumer hashes what it got
(xxh3_64 of the whole payload vs the digest sent at setup); a row's ``correct`` is the AND of those
flags. Peers alternate in rounds after warm-up (the first peer rotates each round); every peer's
consumer is its own ``spawn``ed process (``ray_put``'s is a Ray actor, a worker process its raylet
starts), and shmtransport's daemon a third one. Details of each peer
are in ``benchmarks/peers/<peer>.py``; the harness is ``benchmarks/peers/common.py``.
"""
from __future__ import annotations

import os
import shutil
import tempfile
import time
import traceback

from harness import Report
from peers import ALTERNATIVE_PEERS, BASELINE_PEERS, OURS_PEERS, _ours, import_error
from peers.common import MAIN_THREAD_SUFFIX, Session, digest_of, rss_kib, seeded_payload
from rounds import add_size_row, close_sessions, measure_size, size_label

KiB, MiB = 1 << 10, 1 << 20
# size -> (timed rounds, warm-up rounds)
FULL_PLAN = {4 * KiB: (200, 20), 64 * KiB: (200, 20), 1 * MiB: (100, 10), 16 * MiB: (30, 3),
             64 * MiB: (15, 2), 256 * MiB: (8, 1)}
QUICK_PLAN = {4 * KiB: (30, 3), 1 * MiB: (15, 2), 64 * MiB: (5, 1)}
LIFECYCLE = {"pairs": 4, "tensors": 4, "nbytes": 64 * KiB}
RATE_DURATION_S = {True: 1.5, False: 5.0}
BIG = 64 * MiB
# Measured a second time with the consumer receiving in its main thread (``<peer>:main``): the
# floor (raw shared memory over the same channel, zero copies), our loan and iceoryx2's.
MAIN_THREAD_PEERS = ("shm_floor", "shm_loan", "iceoryx2_loan")


def _our_segments() -> set[str]:
    # segment_pread and iceoryx2 (stbench_), multiprocessing.shared_memory, torch
    prefixes = ("stbench_", "psm_", "torch_")
    return {n for n in os.listdir("/dev/shm") if n.startswith(prefixes)}


def _mb(kib: int | None) -> float | None:
    return None if kib is None else round(kib / 1024, 1)


def run(quick: bool) -> Report:
    report = Report("transport", extra_versions=("grpcio", "torch", "xxhash", *ALTERNATIVE_PEERS.values()))
    plan = QUICK_PLAN if quick else FULL_PLAN
    workdir = tempfile.mkdtemp(prefix="stb-transport-")
    sessions: dict[str, Session] = {}
    daemon = None
    rss: dict[str, object] = {}
    started = time.perf_counter()
    shm_before = _our_segments()
    try:
        peers = list(BASELINE_PEERS)
        why_not = _ours.import_error()
        if why_not is None:
            try:
                # Our peers share this daemon, and the harness keeps each consumer's last view until
                # that peer's next round (its lease stays held meanwhile): room for one object of
                # the largest size per peer (and shape), plus the one being placed.
                ours = len(OURS_PEERS) + len(set(OURS_PEERS) & set(MAIN_THREAD_PEERS))
                arena = (ours + 1) * max(plan)
                daemon = _ours.DaemonProcess(os.path.join(workdir, "d.sock"), arena).start()
                rss["idle_start"] = rss_kib(daemon.pid)
                peers += OURS_PEERS
            except Exception:  # noqa: BLE001
                report.notes.append(f"SKIPPED {', '.join(OURS_PEERS)}, lifecycles: the daemon did not "
                                    "start:\n" + traceback.format_exc(limit=4))
                daemon = None
        else:
            report.notes.append(f"SKIPPED {', '.join(OURS_PEERS)}, lifecycles: shmtransport client/daemon "
                                f"not importable ({why_not}); their ratios are omitted")
        for name in ALTERNATIVE_PEERS:
            why_not = import_error(name)
            if why_not is None:
                peers.append(name)
            else:
                report.notes.append(f"SKIPPED {name}: {why_not}; install the peers extra")
        shapes = [(name, False) for name in peers] + [(name, True) for name in peers if name in MAIN_THREAD_PEERS]
        for name, main_thread in shapes:
            options = {"socket_path": daemon.socket_path, "daemon_pid": daemon.pid} if name in OURS_PEERS else {}
            if name in ALTERNATIVE_PEERS:
                options = {"max_nbytes": max(plan)}
            key = name + (MAIN_THREAD_SUFFIX if main_thread else "")
            try:
                sessions[key] = Session(name, main_thread=main_thread, **options).start()
            except Exception:  # noqa: BLE001
                report.notes.append(f"ERROR {key} did not start; no rows:\n" + traceback.format_exc(limit=6))

        _measure_sizes(report, sessions, plan, daemon, rss)
        _measure_rates(report, sessions, daemon, quick, rss)
        _ratios(report, plan)
        if daemon is not None:
            rss["idle_end"] = rss_kib(daemon.pid)
            _rss_note(report, rss)
    finally:
        close_sessions(report, sessions, daemon)
        shutil.rmtree(workdir, ignore_errors=True)
    leaked = _our_segments() - shm_before
    if leaked:
        report.notes.append(f"LEAK: /dev/shm entries left by the peers: {sorted(leaked)}")
    report.notes.append(f"suite wall time {time.perf_counter() - started:.1f} s "
                        f"({'quick' if quick else 'full'}: sizes {', '.join(size_label(n) for n in plan)})")
    return report


def _measure_sizes(report: Report, sessions: dict[str, Session], plan, daemon, rss) -> None:
    peak = [0]

    def sample_rss() -> None:
        if daemon is not None:
            peak[0] = max(peak[0], rss_kib(daemon.pid).get("VmRSS", 0))

    for nbytes, (rounds, warmup) in plan.items():
        payload = seeded_payload(nbytes)
        results = measure_size(report, sessions, payload, digest_of(payload), nbytes, rounds, warmup, sample_rss)
        for name, (samples, ok) in results.items():
            add_size_row(report, sessions[name], name, samples, ok, nbytes)
        del payload
    if daemon is not None:
        rss["peak_transfers"] = peak[0]


def _measure_rates(report: Report, sessions, daemon, quick: bool, rss) -> None:
    duration_s = RATE_DURATION_S[quick]
    bare = sessions.get("bare_rtt")
    if bare is not None:
        try:
            calls_per_s, samples = bare.producer.calls_per_s(duration_s)
            report.add_row("bare_rpc_rate", samples, True, clients=1,
                           extra={"calls_per_s": round(calls_per_s, 1)})
        except Exception:  # noqa: BLE001
            report.notes.append("ERROR bare_rpc_rate:\n" + traceback.format_exc(limit=6))
    if daemon is None:
        return
    from peers.lifecycle import run_lifecycles

    try:
        result = run_lifecycles(daemon.socket_path, duration_s=duration_s, rss_pid=daemon.pid, **LIFECYCLE)
    except Exception:  # noqa: BLE001
        report.notes.append("ERROR lifecycles; no row:\n" + traceback.format_exc(limit=8))
        return
    rss["peak_lifecycles"] = result["daemon_peak_rss_kib"]
    report.add_row("lifecycles", result["samples"], result["correct"], pairs=LIFECYCLE["pairs"],
                   tensors=LIFECYCLE["tensors"], nbytes=LIFECYCLE["nbytes"],
                   extra={"lifecycles_per_s": round(result["lifecycles_per_s"], 1),
                          "daemon_rss_mb": None})  # filled in by _rss_note


def _ratios(report: Report, plan) -> None:
    def med(name: str, nbytes: int) -> float | None:
        try:
            return report.median(name, nbytes=nbytes)
        except KeyError:
            return None

    def put(ratio: str, value: float | None, target: str | None = None) -> None:
        if value is None:
            return
        report.ratios[ratio] = round(value, 4)
        if target:
            report.targets[ratio] = target

    def div(a: float | None, b: float | None) -> float | None:
        return None if a is None or b is None else a / b

    tag = size_label(BIG)
    memcpy, bare, ours = med("memcpy", BIG), med("bare_rtt", BIG), med("shm_put_hash", BIG)
    floor = None if memcpy is None or bare is None else memcpy + bare
    put(f"put_handoff_over_floor_{tag}", div(ours, floor), "<= 1.5")
    put(f"put_nohash_handoff_over_floor_{tag}", div(med("shm_put", BIG), floor), "<= 1.2")
    put(f"inline_grpc_speedup_{tag}", div(med("grpc_inline", BIG), ours), ">= 20")
    loan = {n: med("shm_loan", n) for n in plan}
    per_size = {n: div(loan[n], med("bare_rtt", n)) for n in plan}
    if all(v is not None for v in per_size.values()) and per_size:
        put("loan_handoff_over_bare_rtt_max", max(per_size.values()), "<= 3")
        for n, value in per_size.items():
            put(f"loan_handoff_over_bare_rtt_{size_label(n)}", value)
    if all(v is not None for v in loan.values()) and loan:
        put("loan_handoff_flatness", max(loan.values()) / min(loan.values()), "<= 1.5")
    put(f"mp_shared_memory_speedup_{tag}", div(med("mp_shared_memory", BIG), ours), ">= 3")
    put(f"segment_pread_speedup_{tag}", div(med("segment_pread", BIG), ours), ">= 3")
    for peer in ("grpc_inline_tcp", "vllm_msgpack_inline", "dynamo_segment", "mp_shared_memory_reused",
                 "torch_mp_queue", "pickle5_oob"):  # no targets: every peer against the default put path
        put(f"{peer}_speedup_{tag}", div(med(peer, BIG), ours))
    put(f"put_verify_over_put_{tag}", div(med("shm_put_verify", BIG), ours))  # the worker's verification
    main = MAIN_THREAD_SUFFIX
    for n in plan:  # the alternatives against our path of the same shape: in-place write / one copy in
        label = size_label(n)
        put(f"iceoryx2_loan_speedup_{label}", div(med("iceoryx2_loan", n), med("shm_loan", n)))
        put(f"ray_put_speedup_{label}", div(med("ray_put", n), med("shm_put", n)))  # both copy once
        put(f"ray_put_over_loan_{label}", div(med("ray_put", n), med("shm_loan", n)), ">= 10")
        # consumers receiving in their main thread: the shape a single-threaded worker loop has
        put(f"iceoryx2_loan_speedup_main_{label}", div(med("iceoryx2_loan" + main, n), med("shm_loan" + main, n)),
            ">= 1")
        put(f"loan_over_floor_{label}", div(med("shm_loan", n), med("shm_floor", n)))
        put(f"loan_over_floor_main_{label}", div(med("shm_loan" + main, n), med("shm_floor" + main, n)))
        put(f"iceoryx2_over_floor_main_{label}", div(med("iceoryx2_loan" + main, n), med("shm_floor" + main, n)))
    put(f"loan_verify_over_loan_{tag}", div(med("shm_loan_verify", BIG), med("shm_loan", BIG)))
    rates = {row["name"]: row for row in report.rows if row["name"] in ("lifecycles", "bare_rpc_rate")}
    if len(rates) == 2:
        put("lifecycles_per_s_over_bare_rpc_per_s",
            rates["lifecycles"]["lifecycles_per_s"] / rates["bare_rpc_rate"]["calls_per_s"], ">= 0.3")
    bare_by_size = {n: med("bare_rtt", n) for n in plan if med("bare_rtt", n) is not None}
    if len(bare_by_size) > 1:
        spread = max(bare_by_size.values()) / min(bare_by_size.values())
        report.notes.append(
            "bare_rtt itself (same empty call in every round) has median "
            + ", ".join(f"{size_label(n)} {v * 1e3:.2f} ms" for n, v in bare_by_size.items())
            + f" (max/min {spread:.2f}): rounds of big payloads leave every process idle/cold longer between its"
            " calls, and a wake-up after >10 ms idle costs this VM ~0.4-1.2 ms per RPC. loan_handoff_flatness"
            " carries that environment effect; loan_handoff_over_bare_rtt_<size> normalises it per round.")
    if max(plan) < 256 * MiB and "loan_handoff_flatness" in report.ratios:
        report.notes.append("quick run: loan_handoff_* span only the quick sizes, not 4 KiB-256 MiB")


def _rss_note(report: Report, rss) -> None:
    idle = rss.get("idle_start", {})
    fields = {
        "idle_start": _mb(idle.get("VmRSS")),
        "idle_start_split": {k: _mb(v) for k, v in idle.items() if k != "VmRSS"},
        "peak_during_transfers": _mb(rss.get("peak_transfers")),
        "peak_during_lifecycles": _mb(rss.get("peak_lifecycles")),
        "idle_end": _mb(rss.get("idle_end", {}).get("VmRSS")),
    }
    for row in report.rows:
        if row["name"] == "lifecycles":
            row["daemon_rss_mb"] = fields
    verdict = "" if fields["idle_start"] is None else (" (target idle <= 80 MB " +
                                                        ("met" if fields["idle_start"] <= 80 else "MISSED") + ")")
    report.notes.append(f"daemon VmRSS MB: idle {fields['idle_start']}{verdict}, peak under transfers "
                        f"{fields['peak_during_transfers']}, peak under 4-pair lifecycles "
                        f"{fields['peak_during_lifecycles']}, idle at end {fields['idle_end']}; "
                        f"idle split {fields['idle_start_split']}")

