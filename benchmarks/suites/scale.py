"""``scale``: how each cost grows — with payload size, concurrent pairs, arena occupancy, live leases.

    python benchmarks/run.py scale [--quick] [--json PATH]

Curves (every row carries ``curve`` = the curve it belongs to, and a ``correct`` flag computed from
what the receiver actually got):

* ``latency_vs_size``: one handoff between two processes, 4 KiB -> 1 GiB in x4 steps, per transport
  (the ``transport`` suite's peers and harness: spawned consumers, alternating rounds with the first
  peer rotating, warm-up, collector off in the timed span). Also the *inline crossover*: the size
  where gRPC with the bytes inline stops being faster than ``put`` (hash on) + handle handoff.
* ``throughput_vs_pairs``: request lifecycles (4 x 256 KiB, put -> acquire -> digest check ->
  release) with 1..16 concurrent producer/consumer process pairs on one daemon, and the same
  request shape sent inline over gRPC by as many producer processes to their own servers, and over
  iceoryx2 (one loaned sample per request) by as many publisher/subscriber pairs.
* ``alloc_vs_occupancy``: the daemon's allocator driven in-process on a fixed arena: mixed sizes
  (log-uniform 4 KiB-16 MiB, seeded), random alloc/free churn holding the occupancy at each level,
  then a stream of mixed-size probe allocations (each freed at once). Plus the full daemon path
  (a Loan RPC through the client) at two occupancies of a daemon's arena.
* ``daemon_vs_leases``: one client holds N live objects, another N leases on them; a third pair of
  clients measures a 4 KiB put -> acquire -> release lifecycle, the Stat RPC, the daemon's RSS and
  its CPU per lifecycle (the daemon process's CPU clock). Rows say whether the objects lived in the
  object table (``object_table``): there a lifecycle sends the daemon nothing, so its CPU per
  lifecycle is only its janitor's share, often 0.
* ``kernels_vs_size`` / ``masks_vs_bits``: the C kernels' throughput against size (np.copyto as
  the memcpy floor), and the mask kernels against the number of bits.

Each curve gets a growth statement: the log-log slope over its upper half, classified
(``harness.fit_growth``); they are in the report's ``curves``.
"""
from __future__ import annotations

import bisect
import gc
import math
import os
import shutil
import statistics
import tempfile
import time
import traceback

import numpy as np
import xxhash
from harness import Report
from peers import ALTERNATIVE_PEERS, _ours, import_error
from peers.common import Session, digest_of, rss_kib, verify
from rounds import GiB, KiB, MiB, add_size_row, close_sessions, measure_size, size_label

SEED = 20251201

# (a) size -> (timed rounds, warm-up rounds)
FULL_SIZES = {4 * KiB: (60, 6), 16 * KiB: (60, 6), 64 * KiB: (50, 5), 256 * KiB: (40, 4), 1 * MiB: (30, 3),
              4 * MiB: (20, 2), 16 * MiB: (12, 2), 64 * MiB: (6, 1), 256 * MiB: (4, 1), 1 * GiB: (2, 1)}
QUICK_SIZES = {4 * KiB: (20, 3), 64 * KiB: (15, 2), 1 * MiB: (12, 2), 4 * MiB: (8, 1), 16 * MiB: (6, 1),
               256 * MiB: (2, 1)}
SIZE_PEERS = ("memcpy", "bare_rtt", "grpc_inline", "mp_shared_memory", "segment_pread", "shm_put_hash", "shm_loan",
              *ALTERNATIVE_PEERS)
OURS = ("shm_put_hash", "shm_loan")
# (b)
FULL_PAIRS, QUICK_PAIRS = (1, 2, 4, 8, 16), (1, 4)
LIFECYCLE_SHAPE = {"tensors": 4, "nbytes": 256 * KiB}  # a frontend's request: put with the digest fused
SMALL_SHAPE = {"tensors": 1, "nbytes": 4 * KiB}  # one small object per handoff (audio chunks), no digest
PAIR_DURATION_S = {True: 1.0, False: 3.0}
# (c)
OCCUPANCIES = (10, 30, 50, 70, 80, 90, 95)
ALLOC_ARENA = 4 * GiB  # bookkeeping only: the allocator never touches bytes
ALLOC_MIN, ALLOC_MAX = 4 * KiB, 16 * MiB
DAEMON_OCCUPANCIES = (30, 90)
DAEMON_ARENA = 256 * MiB
DAEMON_ALLOC_MAX = 4 * MiB
# (d)
FULL_LEASES, QUICK_LEASES = (10, 100, 1_000, 10_000, 100_000), (10, 100, 1_000, 10_000)
HELD_NBYTES = 64  # each held object: one cache line
BATCH = 4096  # the daemon's batch limit
# (e)
FULL_KERNEL_SIZES = tuple(4 * KiB * 4**i for i in range(9))  # 4 KiB .. 256 MiB
QUICK_KERNEL_SIZES = (4 * KiB, 256 * KiB, 16 * MiB, 256 * MiB)
FULL_MASK_BITS = tuple(4096 * 4**i for i in range(9))  # 4 Ki .. 256 Mi bits
QUICK_MASK_BITS = (4096, 256 * 1024, 16 * 1024 * 1024)


def payload(nbytes: int, seed: int = SEED) -> np.ndarray:
    """A writable, seeded uint8 array (the generator's raw words: ~2 GB/s, vs ~0.4 for rng.bytes)."""
    words = np.random.default_rng(seed + nbytes).bit_generator.random_raw((nbytes + 7) // 8)
    return words.view(np.uint8)[:nbytes]


def process_cpu_s(pid: int) -> float:
    """CPU seconds (all threads) of another process: Linux's CPU-clock id for a pid."""
    return time.clock_gettime(((~pid) << 3) | 2)  # MAKE_PROCESS_CPUCLOCK(pid, CPUCLOCK_SCHED)


def _our_segments() -> set[str]:
    prefixes = ("stbench_", "psm_", "shmt")  # iceoryx2's files carry stbench_ too
    try:
        return {n for n in os.listdir("/dev/shm") if n.startswith(prefixes)}
    except OSError:
        return set()


def _section(report: Report, what: str, fn, *args) -> None:
    started = time.perf_counter()
    try:
        fn(report, *args)
    except Exception:  # noqa: BLE001 — one broken curve must not lose the others
        report.notes.append(f"ERROR {what}; its rows may be missing:\n" + traceback.format_exc(limit=8))
    report.notes.append(f"{what}: {time.perf_counter() - started:.1f} s")


def run(quick: bool) -> Report:
    report = Report("scale", extra_versions=("grpcio", "xxhash", "matplotlib", *ALTERNATIVE_PEERS.values()))
    started = time.perf_counter()
    shm_before = _our_segments()
    workdir = tempfile.mkdtemp(prefix="stb-scale-")
    try:
        sizes = QUICK_SIZES if quick else FULL_SIZES
        _section(report, "latency_vs_size", latency_vs_size, sizes, workdir)
        _section(report, "throughput_vs_pairs", throughput_vs_pairs, QUICK_PAIRS if quick else FULL_PAIRS,
                 PAIR_DURATION_S[quick], workdir)
        _section(report, "small_throughput_vs_pairs", throughput_vs_pairs, QUICK_PAIRS if quick else FULL_PAIRS,
                 PAIR_DURATION_S[quick], workdir, SMALL_SHAPE, True, "small_throughput_vs_pairs", False)
        _section(report, "alloc_vs_occupancy", alloc_vs_occupancy, OCCUPANCIES, 400 if quick else 3000,
                 300 if quick else 2000)
        _section(report, "daemon_vs_leases", daemon_vs_leases, QUICK_LEASES if quick else FULL_LEASES,
                 200 if quick else 500, workdir)
        _section(report, "kernels_vs_size", kernels_vs_size, QUICK_KERNEL_SIZES if quick else FULL_KERNEL_SIZES,
                 QUICK_MASK_BITS if quick else FULL_MASK_BITS, 5 if quick else 15)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    leaked = _our_segments() - shm_before
    if leaked:
        report.notes.append(f"LEAK: /dev/shm entries left behind: {sorted(leaked)}")
    report.notes.append(f"suite wall time {time.perf_counter() - started:.1f} s ({'quick' if quick else 'full'})")
    return report


# -- (a) latency vs payload size -------------------------------------------------------------------

def _session_options(name: str, daemon, max_nbytes: int) -> dict:
    if name in ALTERNATIVE_PEERS:
        return {"max_nbytes": max_nbytes}
    if name not in OURS:
        return {}
    return {"socket_path": daemon.socket_path, "daemon_pid": daemon.pid}


def latency_vs_size(report: Report, sizes: dict[int, tuple[int, int]], workdir: str,
                    peers: tuple[str, ...] = SIZE_PEERS) -> None:
    sessions: dict[str, Session] = {}
    daemon = None
    try:
        wanted = list(peers)
        if any(p in OURS for p in wanted):
            why_not = _ours.import_error()
            if why_not is not None:
                report.notes.append(f"SKIPPED {', '.join(OURS)}: shmtransport not importable ({why_not})")
                wanted = [p for p in wanted if p not in OURS]
            else:
                # two objects of the largest size may be live at once (a release is piggybacked)
                daemon = _ours.DaemonProcess(os.path.join(workdir, "size.sock"), 2 * max(sizes)).start()
        for name in [p for p in wanted if p in ALTERNATIVE_PEERS]:
            why_not = import_error(name)
            if why_not is not None:
                report.notes.append(f"SKIPPED {name}: {why_not}; install the peers extra")
                wanted.remove(name)
        for name in wanted:
            try:
                sessions[name] = Session(name, **_session_options(name, daemon, max(sizes))).start()
            except Exception:  # noqa: BLE001
                report.notes.append(f"ERROR {name} did not start; no rows:\n" + traceback.format_exc(limit=6))
        for nbytes, (rounds, warmup) in sizes.items():
            data = payload(nbytes)
            results = measure_size(report, sessions, data, digest_of(data), nbytes, rounds, warmup)
            del data
            for name, (samples, ok) in results.items():
                add_size_row(report, sessions[name], name, samples, ok, nbytes, curve="latency_vs_size")
            gc.collect()
    finally:
        close_sessions(report, sessions, daemon)
    names = [n for n in peers if any(r["name"] == n and r.get("curve") == "latency_vs_size" for r in report.rows)]
    for name in names:
        xs, ys = _series(report, "latency_vs_size", name, "nbytes")
        report.add_curve(f"latency_vs_size.{name}", "nbytes", "median_s", xs, ys, "bytes")
    _inline_crossover(report)


def _series(report: Report, curve: str, name: str, xkey: str, ykey: str = "median_s") -> tuple[list, list]:
    rows = sorted((r for r in report.rows if r.get("curve") == curve and r["name"] == name),
                  key=lambda r: r["params"][xkey])
    return [r["params"][xkey] for r in rows], [r.get(ykey) for r in rows]


def crossover(xs: list[float], a: list[float], b: list[float]) -> dict | None:
    """Where ``a`` stops being below ``b`` (a < b at smaller x, a >= b from the bracket on), x
    interpolated log-log between the bracketing points: log-ratio linear in log x when both sides are
    positive, else the difference linear in log x. None when ``a`` is below ``b`` everywhere or
    never below it."""
    for i in range(len(xs) - 1):
        if a[i] < b[i] and a[i + 1] >= b[i + 1]:
            lx0, lx1 = math.log(xs[i]), math.log(xs[i + 1])
            if min(a[i], a[i + 1], b[i], b[i + 1]) > 0:
                f0, f1 = math.log(a[i] / b[i]), math.log(a[i + 1] / b[i + 1])
                method = "log-log"
            else:
                f0, f1 = a[i] - b[i], a[i + 1] - b[i + 1]
                method = "difference linear in log size (a non-positive value)"
            t = f0 / (f0 - f1) if f1 != f0 else 0.0
            return {"nbytes": math.exp(lx0 + t * (lx1 - lx0)), "bracket": [xs[i], xs[i + 1]], "method": method}
    return None


def _inline_crossover(report: Report) -> None:
    xs, inline = _series(report, "latency_vs_size", "grpc_inline", "nbytes")
    xs2, put = _series(report, "latency_vs_size", "shm_put_hash", "nbytes")
    if xs != xs2 or len(xs) < 2:
        report.notes.append("inline crossover: grpc_inline and shm_put_hash rows do not cover the same sizes")
        return
    marginal = [v - inline[0] for v in inline]
    found = {}
    for kind, series in (("standalone", inline), ("marginal", marginal)):
        hit = crossover(xs, series, put)
        key = f"inline_crossover_nbytes_{kind}"
        if hit is None:
            always = all(s < p for s, p in zip(series, put))
            report.notes.append(f"{key}: no crossover in {size_label(xs[0])}..{size_label(xs[-1])} "
                                f"(grpc_inline {'always' if always else 'never'} faster)")
            continue
        report.ratios[key] = round(hit["nbytes"])
        found[kind] = hit
        report.notes.append(
            f"{key} = {hit['nbytes'] / KiB:.0f} KiB, between {size_label(hit['bracket'][0])} and "
            f"{size_label(hit['bracket'][1])} ({hit['method']})"
            + ("; marginal = grpc_inline(size) - grpc_inline(smallest size): what the inline bytes add to a "
               "request that is sent anyway" if kind == "marginal" else ""))
    statement = "; ".join(f"{k}: {v['nbytes'] / KiB:.0f} KiB (between {size_label(v['bracket'][0])} and "
                          f"{size_label(v['bracket'][1])})" for k, v in found.items()) or "no crossover found"
    report.curves["inline_crossover"] = {
        "x": "nbytes", "y": "grpc_inline median_s vs shm_put_hash median_s", "growth": statement, "slope": None,
        **{f"{k}_nbytes": round(v["nbytes"]) for k, v in found.items()},
        **{f"{k}_bracket": v["bracket"] for k, v in found.items()},
    }


# -- (b) throughput vs concurrent pairs ------------------------------------------------------------

def throughput_vs_pairs(report: Report, pairs_list: tuple[int, ...], duration_s: float, workdir: str,
                        shape: dict | None = None, grpc_line: bool = True, curve: str = "throughput_vs_pairs",
                        fused_hash: bool = True) -> None:
    """Lifecycles per second with 1..N pairs; ``fused_hash``: our producers put with the digest
    fused in (iceoryx2's and inline gRPC's producers compute none)."""
    from peers.lifecycle import run_grpc_inline_lifecycles, run_lifecycles

    shape = shape or LIFECYCLE_SHAPE
    request_nbytes = shape["tensors"] * shape["nbytes"]
    why_not = _ours.import_error()
    iceoryx2_line = import_error("iceoryx2_loan")
    if iceoryx2_line is not None:
        report.notes.append(f"SKIPPED iceoryx2 lifecycles vs pairs: {iceoryx2_line}; install the peers extra")
    daemon = None
    try:
        if why_not is None:
            arena = 4 * max(pairs_list) * request_nbytes + 16 * MiB
            daemon = _ours.DaemonProcess(os.path.join(workdir, "pairs.sock"), arena).start()
        else:
            report.notes.append(f"SKIPPED shm lifecycles vs pairs: shmtransport not importable ({why_not})")
        for pairs in pairs_list:
            runs = []
            if daemon is not None:
                runs.append(("lifecycles_shm", lambda p=pairs: run_lifecycles(
                    daemon.socket_path, pairs=p, duration_s=duration_s, rss_pid=daemon.pid, fused_hash=fused_hash,
                    **shape)))
            if grpc_line:
                runs.append(("lifecycles_grpc_inline", lambda p=pairs: run_grpc_inline_lifecycles(
                    workdir, pairs=p, duration_s=duration_s, **shape)))
            if iceoryx2_line is None:
                from peers._iceoryx2 import run_iceoryx2_lifecycles

                runs.append(("lifecycles_iceoryx2", lambda p=pairs: run_iceoryx2_lifecycles(
                    pairs=p, duration_s=duration_s, **shape)))
            for name, fn in runs:
                try:
                    cpu0 = process_cpu_s(daemon.pid) if name == "lifecycles_shm" else None
                    result = fn()
                    extra = {"curve": curve, "fused_hash": fused_hash and name == "lifecycles_shm",
                             "lifecycles_per_s": round(result["lifecycles_per_s"], 1),
                             "gbps": round(result["lifecycles_per_s"] * request_nbytes / 1e9, 4)}
                    if cpu0 is not None:
                        count = len(result["samples"])
                        extra["daemon_cpu_us_per_lifecycle"] = round((process_cpu_s(daemon.pid) - cpu0) / count * 1e6,
                                                                     1)
                except Exception:  # noqa: BLE001
                    report.notes.append(f"ERROR {name} at {pairs} pairs; no row:\n" + traceback.format_exc(limit=8))
                    continue
                report.add_row(name, result["samples"], result["correct"], pairs=pairs, extra=extra, **shape)
    finally:
        if daemon is not None:
            daemon.stop()
    for name in ("lifecycles_shm", "lifecycles_grpc_inline", "lifecycles_iceoryx2"):
        xs, ys = _series(report, curve, name, "pairs", "lifecycles_per_s")
        if xs:
            report.add_curve(f"{curve}.{name}", "pairs", "lifecycles_per_s", xs, ys, "pairs", what="throughput")
    rates = {name: dict(zip(*_series(report, curve, name, "pairs", "lifecycles_per_s")))
             for name in ("lifecycles_shm", "lifecycles_iceoryx2")}
    if 1 in rates["lifecycles_shm"] and 1 in rates["lifecycles_iceoryx2"]:
        key = f"{curve}_shm_over_iceoryx2_1pair"
        report.ratios[key] = round(rates["lifecycles_shm"][1] / rates["lifecycles_iceoryx2"][1], 3)
        report.targets[key] = ">= 0.3"
    report.notes.append(f"{curve}: each pair = a producer and a consumer process; request = "
                        f"{shape['tensors']} x {size_label(shape['nbytes'])} (our put "
                        f"{'with' if fused_hash else 'without'} the fused digest); {duration_s:g} s per point; "
                        f"{os.cpu_count()} cores; lifecycles_iceoryx2 = one loaned sample per request (the "
                        f"arrays copied in), the consumer's digest check, the sample dropped, an ack event; no "
                        f"ray_put line (N drivers against one Ray cluster would measure its scheduler, not a "
                        f"handoff)")


# -- (c) allocation latency and failure rate vs occupancy ------------------------------------------

def _round_up(value: int, align: int) -> int:
    return (value + align - 1) // align * align


class _Extents:
    """The caller's view of what is live: offset -> reserved bytes, with an overlap check."""

    def __init__(self, arena_nbytes: int, page_align_min: int):
        self.arena = arena_nbytes
        self.page_align_min = page_align_min
        self.sizes: dict[int, int] = {}
        self.offsets: list[int] = []  # sorted
        self.order: list[int] = []  # for picking a random victim
        self.ok = True
        self.problems: list[str] = []

    def _bad(self, why: str) -> None:
        self.ok = False
        if len(self.problems) < 5:
            self.problems.append(why)

    def fits(self, offset: int, nbytes: int) -> bool:
        """Is [offset, offset + reserved) inside the arena, aligned, and clear of every live extent?"""
        size = _round_up(nbytes, 64)
        align = 4096 if nbytes >= self.page_align_min else 64
        if offset % align or offset < 0 or offset + size > self.arena:
            self._bad(f"extent {offset}+{size} misaligned or outside the arena")
            return False
        i = bisect.bisect_left(self.offsets, offset)
        if i < len(self.offsets) and self.offsets[i] < offset + size:
            self._bad(f"extent {offset}+{size} overlaps live {self.offsets[i]}+{self.sizes[self.offsets[i]]}")
            return False
        if i > 0 and self.offsets[i - 1] + self.sizes[self.offsets[i - 1]] > offset:
            self._bad(f"extent {offset}+{size} overlaps live {self.offsets[i - 1]}+{self.sizes[self.offsets[i - 1]]}")
            return False
        return True

    def add(self, offset: int, nbytes: int) -> None:
        self.fits(offset, nbytes)
        if offset in self.sizes:
            self._bad(f"offset {offset} handed out twice")
            return
        self.sizes[offset] = _round_up(nbytes, 64)
        bisect.insort(self.offsets, offset)
        self.order.append(offset)

    def pop(self, index: int) -> int:
        offset = self.order[index]
        self.order[index] = self.order[-1]
        self.order.pop()
        del self.sizes[offset]
        del self.offsets[bisect.bisect_left(self.offsets, offset)]
        return offset

    @property
    def used(self) -> int:
        return sum(self.sizes.values())


def alloc_vs_occupancy(report: Report, occupancies=OCCUPANCIES, probes: int = 3000, churn: int = 2000,
                       arena_nbytes: int = ALLOC_ARENA, seed: int = SEED, allocator_factory=None,
                       daemon_point: bool = True) -> None:
    from shmtransport.allocator import Allocator
    from shmtransport.errors import ResourceExhausted

    make = allocator_factory or Allocator
    alloc = make(arena_nbytes)
    page_align_min = getattr(alloc, "page_align_min_nbytes", 64 * KiB)
    rng = np.random.default_rng(seed)
    lo, hi = math.log(ALLOC_MIN), math.log(ALLOC_MAX)

    def draw() -> int:
        return int(math.exp(rng.uniform(lo, hi)))

    live = _Extents(arena_nbytes, page_align_min)

    def alloc_one(nbytes: int) -> bool:
        try:
            offset = alloc.allocate(nbytes)
        except ResourceExhausted:
            return False
        live.add(offset, nbytes)
        return True

    def free_random() -> None:
        offset = live.pop(int(rng.integers(len(live.order))))
        try:
            alloc.free(offset)
        except Exception as exc:  # noqa: BLE001 — the allocator disowning a live extent is a wrong answer
            live._bad(f"free({offset}) failed: {exc!r}")

    for pct in occupancies:
        target = arena_nbytes * pct / 100
        churn_failures = 0
        # fill to the target, then churn: free a random extent, refill to the target (fragmenting it)
        for step in range(churn + 1):
            if step:
                free_random()
            while alloc.used_nbytes < target:
                if not alloc_one(draw()):
                    churn_failures += 1
                    if live.order:
                        free_random()  # make room the way a real workload would: something is released
                    break
        samples: list[float] = []
        failures = 0
        for _ in range(probes):
            nbytes = draw()
            t0 = time.perf_counter()
            try:
                offset = alloc.allocate(nbytes)
            except ResourceExhausted:
                samples.append(time.perf_counter() - t0)
                failures += 1
                continue
            samples.append(time.perf_counter() - t0)
            live.fits(offset, nbytes)
            try:
                alloc.free(offset)
            except Exception as exc:  # noqa: BLE001
                live._bad(f"free({offset}) of a probe failed: {exc!r}")
        # the allocator's own books against ours
        if alloc.used_nbytes != live.used:
            live._bad(f"allocator says {alloc.used_nbytes} bytes used, the live extents add up to {live.used}")
        free = arena_nbytes - alloc.used_nbytes
        largest = alloc.largest_free_nbytes
        report.add_row(
            "allocator_alloc", samples, live.ok, occupancy_pct=pct, arena_nbytes=arena_nbytes,
            extra={"curve": "alloc_vs_occupancy", "failure_rate": round(failures / probes, 4),
                   "occupancy_actual_pct": round(100 * alloc.used_nbytes / arena_nbytes, 2),
                   "free_nbytes": free, "largest_free_nbytes": largest,
                   "largest_free_over_free": round(largest / free, 4) if free else None,
                   "free_extents": alloc.free_extents, "live_allocations": len(live.order),
                   "probes": probes, "churn_steps": churn, "churn_alloc_failures": churn_failures,
                   "problems": list(live.problems)})
    xs, ys = _series(report, "alloc_vs_occupancy", "allocator_alloc", "occupancy_pct")
    report.add_curve("alloc_vs_occupancy.median_latency", "occupancy_pct", "median_s", xs, ys, "occupancy")
    xs, fails = _series(report, "alloc_vs_occupancy", "allocator_alloc", "occupancy_pct", "failure_rate")
    first = next((x for x, f in zip(xs, fails) if f > 0), None)
    report.curves["alloc_vs_occupancy.failure_rate"] = {
        "x": "occupancy_pct", "y": "failure_rate", "slope": None,
        "growth": ("no probe failed at any occupancy" if first is None else
                   f"first failures at {first} % occupancy; {100 * fails[-1]:.1f} % of probes fail at {xs[-1]} %"
                   f" (probes log-uniform {size_label(ALLOC_MIN)}-{size_label(ALLOC_MAX)})")}
    if daemon_point and _ours.import_error() is None:
        _daemon_loan_points(report, seed)


def _daemon_loan_points(report: Report, seed: int, occupancies=DAEMON_OCCUPANCIES, probes: int = 200) -> None:
    """A Loan RPC through the client (and its piggybacked release) at a daemon arena's occupancies."""
    from shmtransport.errors import ResourceExhausted

    client = _ours.client()
    workdir = tempfile.mkdtemp(prefix="stb-scale-loan-")
    rng = np.random.default_rng(seed + 1)
    lo, hi = math.log(ALLOC_MIN), math.log(DAEMON_ALLOC_MAX)
    try:
        with _ours.DaemonProcess(os.path.join(workdir, "loan.sock"), DAEMON_ARENA) as daemon:
            holder = client.Producer(daemon.socket_path, timeout_s=_ours.CLIENT_TIMEOUT_S, alloc_wait_s=0)
            prober = client.Producer(daemon.socket_path, timeout_s=_ours.CLIENT_TIMEOUT_S, alloc_wait_s=0)
            held: list = []
            live = _Extents(DAEMON_ARENA, 64 * KiB)
            try:
                for pct in occupancies:
                    target = DAEMON_ARENA * pct / 100
                    for step in range(200):  # fill, then churn to fragment
                        if step and held:
                            victim = held.pop(int(rng.integers(len(held))))
                            live.pop(live.order.index(victim.handle.shm.offset))
                            victim.release()
                        while live.used < target:
                            nbytes = int(math.exp(rng.uniform(lo, hi)))
                            try:
                                loan = holder.loan(nbytes=nbytes)
                            except ResourceExhausted:
                                break
                            live.add(loan.handle.shm.offset, nbytes)
                            held.append(loan)
                    holder.flush()
                    samples, failures = [], 0
                    gc.collect()
                    gc.disable()
                    try:
                        for _ in range(probes):
                            nbytes = int(math.exp(rng.uniform(lo, hi)))
                            t0 = time.perf_counter()
                            try:
                                loan = prober.loan(nbytes=nbytes)
                            except ResourceExhausted:
                                samples.append(time.perf_counter() - t0)
                                failures += 1
                                continue
                            samples.append(time.perf_counter() - t0)
                            live.fits(loan.handle.shm.offset, nbytes)
                            loan.release()  # queued: rides on the next Loan
                    finally:
                        gc.enable()
                    prober.flush()
                    stat = prober.stat()
                    report.add_row("daemon_loan_rpc", samples, live.ok, occupancy_pct=pct, arena_nbytes=DAEMON_ARENA,
                                   extra={"curve": "alloc_vs_occupancy", "failure_rate": round(failures / probes, 4),
                                          "occupancy_actual_pct": round(100 * stat.used_nbytes / DAEMON_ARENA, 2),
                                          "largest_free_over_free": round(
                                              stat.largest_free_nbytes / max(stat.free_nbytes, 1), 4),
                                          "probes": probes, "problems": list(live.problems)})
            finally:
                for loan in held:
                    loan.release()
                prober.close()
                holder.close()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    report.notes.append(f"daemon_loan_rpc: Loan RPC via the client (release piggybacked on the next Loan), probes "
                        f"log-uniform {size_label(ALLOC_MIN)}-{size_label(DAEMON_ALLOC_MAX)} on a "
                        f"{size_label(DAEMON_ARENA)} arena held at {occupancies} % by another client's loans")


# -- (d) daemon cost vs live leases ----------------------------------------------------------------

def daemon_vs_leases(report: Report, counts: tuple[int, ...], lifecycles: int, workdir: str,
                     stat_calls: int = 30) -> None:
    why_not = _ours.import_error()
    if why_not is not None:
        report.notes.append(f"SKIPPED daemon_vs_leases: shmtransport not importable ({why_not})")
        return
    client = _ours.client()
    small = payload(4 * KiB, SEED + 7)
    small_digest = digest_of(small)
    arena = max(counts) * 128 + 64 * MiB
    # Every held object is in the table: room for all of them and for the lifecycles measured
    # beside (never fewer slots than the largest default table, which grants of any density fit).
    slots = max(2 * max(counts), 65536)
    with _ours.DaemonProcess(os.path.join(workdir, "leases.sock"), arena, object_slots=slots) as daemon:
        opts = {"timeout_s": 60.0}
        holder_p = client.Producer(daemon.socket_path, **opts)
        holder_c = client.Consumer(daemon.socket_path, **opts)
        prod = client.Producer(daemon.socket_path, **opts)
        cons = client.Consumer(daemon.socket_path, **opts)
        leases: list = []
        handles: list = []
        held_ok = True
        try:
            for count in counts:
                while len(leases) < count:  # grow the held set to ``count`` objects with one lease each
                    n = min(BATCH, count - len(leases))
                    base = len(leases)
                    arrays = [np.full(HELD_NBYTES, (base + i) % 251, dtype=np.uint8) for i in range(n)]
                    new = holder_p.put_many(arrays)
                    handles.extend(new)
                    got = holder_c.acquire_many(new, ttl_ms=3_600_000)
                    held_ok = held_ok and all(
                        lease.array.size == HELD_NBYTES and int(lease.array[0]) == (base + i) % 251
                        and int(lease.array[-1]) == (base + i) % 251 for i, lease in enumerate(got))
                    leases.extend(got)
                stat = prod.stat()
                held_ok = held_ok and stat.live_objects >= count and stat.live_leases >= count
                in_table = bool(handles[0].shm.slot)
                for _ in range(10):  # warm-up, and settle queued releases
                    _one_lifecycle(prod, cons, small, small_digest)
                prod.flush()
                cons.flush()
                gc.collect()
                gc.disable()
                try:
                    samples, flags = [], True
                    cpu0 = process_cpu_s(daemon.pid)
                    for _ in range(lifecycles):
                        t0 = time.perf_counter()
                        ok = _one_lifecycle(prod, cons, small, small_digest)
                        samples.append(time.perf_counter() - t0)
                        flags = flags and ok
                    prod.flush()
                    cons.flush()
                    cpu = process_cpu_s(daemon.pid) - cpu0
                    stat_samples = []
                    for _ in range(stat_calls):
                        t0 = time.perf_counter()
                        stat = prod.stat()
                        stat_samples.append(time.perf_counter() - t0)
                finally:
                    gc.enable()
                stat_ok = stat.live_objects >= count and stat.live_leases >= count
                rss = rss_kib(daemon.pid)
                extra = {"curve": "daemon_vs_leases", "daemon_rss_mb": round(rss.get("VmRSS", 0) / 1024, 2),
                         "daemon_cpu_us_per_lifecycle": round(cpu / lifecycles * 1e6, 1),
                         "live_objects": stat.live_objects, "live_leases": stat.live_leases, "object_table": in_table}
                report.add_row("leases_lifecycle_4KiB", samples, flags and held_ok, leases=count, extra=extra)
                report.add_row("leases_stat_rpc", stat_samples, stat_ok and held_ok, leases=count,
                               extra={"curve": "daemon_vs_leases", "live_objects": stat.live_objects,
                                      "live_leases": stat.live_leases, "object_table": in_table})
        finally:
            if leases:
                holder_c.release(leases)  # queued; close() sends them in batches
            leases.clear()
            for c in (holder_c, holder_p, cons, prod):
                try:
                    c.close()
                except Exception:  # noqa: BLE001
                    report.notes.append("ERROR closing a client:\n" + traceback.format_exc(limit=4))
    for name, y, what in (("leases_lifecycle_4KiB", "median_s", "lifecycle"), ("leases_stat_rpc", "median_s", "stat"),
                          ("leases_lifecycle_4KiB", "daemon_rss_mb", "daemon_rss"),
                          ("leases_lifecycle_4KiB", "daemon_cpu_us_per_lifecycle", "daemon_cpu_per_lifecycle")):
        xs, ys = _series(report, "daemon_vs_leases", name, "leases", y)
        if xs:
            report.add_curve(f"daemon_vs_leases.{what}", "leases", y, xs, ys, "leases")
    xs, rss = _series(report, "daemon_vs_leases", "leases_lifecycle_4KiB", "leases", "daemon_rss_mb")
    if len(xs) > 1 and xs[-1] > xs[0]:
        per_lease = (rss[-1] - rss[0]) * MiB / (xs[-1] - xs[0])
        entry = report.curves.get("daemon_vs_leases.daemon_rss")
        if entry is not None:
            entry["bytes_per_lease"] = round(per_lease, 1)
            entry["growth"] += f"; {per_lease:.0f} bytes of daemon RSS per held object + lease above {xs[0]}"
    report.notes.append(f"daemon_vs_leases: a holder Producer/Consumer pair holds N objects of {HELD_NBYTES} B and N "
                        f"leases; another pair measures put(4 KiB, digest=True) -> acquire -> digest check -> "
                        f"release x{lifecycles} (in the object table: shared memory alone; else releases queued "
                        f"and piggybacked on the next call) and Stat x"
                        f"{stat_calls}; clients in the benchmark process, the daemon in its own")


def _one_lifecycle(prod, cons, data: np.ndarray, digest: int) -> bool:
    handle = prod.put(data, digest=True)
    lease = cons.acquire(handle)
    ok = verify(lease.array, digest)
    lease.release()
    prod.release(handle)
    return ok


# -- (e) kernels vs size ---------------------------------------------------------------------------

def _time_kernels(fns: dict, rounds: int, est_call_s: dict[str, float]) -> dict[str, list[float]]:
    """Per-call seconds: blocks of ``inner`` calls (>= ~2 ms per block), candidates alternating."""
    inner = {name: max(1, min(10_000, int(2e-3 / max(est_call_s[name], 1e-7)))) for name in fns}
    samples: dict[str, list[float]] = {name: [] for name in fns}
    names = list(fns)
    gc.collect()
    gc.disable()
    try:
        for r in range(rounds):
            shift = r % len(names)
            for name in names[shift:] + names[:shift]:
                fn, k = fns[name], inner[name]
                t0 = time.perf_counter()
                for _ in range(k):
                    fn()
                samples[name].append((time.perf_counter() - t0) / k)
    finally:
        gc.enable()
    return samples


def _estimate(fns: dict) -> dict[str, float]:
    est = {}
    for name, fn in fns.items():
        fn()  # warm
        t0 = time.perf_counter()
        fn()
        est[name] = time.perf_counter() - t0
    return est


def kernels_vs_size(report: Report, sizes: tuple[int, ...], mask_bits: tuple[int, ...], rounds: int) -> None:
    for nbytes in sizes:
        _kernels_at(report, nbytes, rounds if nbytes < 64 * MiB else max(3, rounds // 3))
    for name in ("memcpy_numpy_copyto", "xxh3_128_c_oneshot", "tree_digest_c", "fused_copy_tree_digest_c"):
        xs, ys = _series(report, "kernels_vs_size", name, "nbytes")
        if xs:
            report.add_curve(f"kernels_vs_size.{name}", "nbytes", "median_s", xs, ys, "bytes")
    for nbits in mask_bits:
        _masks_at(report, nbits, rounds if nbits < 64 * MiB else max(3, rounds // 3))
    for name in ("mask_unpack_c", "mask_indices_c", "mask_indices_numpy"):
        xs, ys = _series(report, "masks_vs_bits", name, "nbits")
        if xs:
            report.add_curve(f"masks_vs_bits.{name}", "nbits", "median_s", xs, ys, "bits")
    report.notes.append("kernels_vs_size: per-call time from blocks of calls (>= ~2 ms a block) at small sizes; "
                        "tree_digest_c and fused_copy_tree_digest_c use all cores (the put path), xxh3 one-shot "
                        "one; masks ~30 % set, in runs")


def _kernels_at(report: Report, nbytes: int, rounds: int) -> None:
    from shmtransport import _native as N
    from shmtransport import _purepy as P

    src = payload(nbytes, SEED + 3)
    dst = np.empty(nbytes, dtype=np.uint8)
    dst.fill(0xA5)  # fault the pages in before timing
    dst2 = np.empty(nbytes, dtype=np.uint8)
    dst2.fill(0x5A)
    flat_ref = xxhash.xxh3_128(src).digest()
    tree_ref = P.tree_digest(src)
    out: dict[str, bytes] = {}
    fns = {
        "memcpy_numpy_copyto": lambda: np.copyto(dst, src),
        "xxh3_128_c_oneshot": lambda: out.__setitem__("flat", N.xxh3_128(src)),
        "tree_digest_c": lambda: out.__setitem__("tree", N.tree_digest(src)),
        "fused_copy_tree_digest_c": lambda: out.__setitem__("fused", N.copy_tree_digest(dst2, src)),
    }
    samples = _time_kernels(fns, rounds, _estimate(fns))
    checks = {"memcpy_numpy_copyto": bool(np.array_equal(dst, src)),
              "xxh3_128_c_oneshot": out["flat"] == flat_ref,
              "tree_digest_c": out["tree"] == tree_ref,
              "fused_copy_tree_digest_c": out["fused"] == tree_ref and bool(np.array_equal(dst2, src))}
    for name, s in samples.items():
        med = statistics.median(s)
        report.add_row(name, s, checks[name], size=size_label(nbytes), nbytes=nbytes,
                       extra={"curve": "kernels_vs_size", "gbps": round(nbytes / med / 1e9, 3)})


def _masks_at(report: Report, nbits: int, rounds: int) -> None:
    from shmtransport import _native as N
    from suites.kernels import _mask_input

    bits = _mask_input(nbits, SEED + 4)
    packed = np.packbits(bits)
    ref_indices = np.flatnonzero(bits)
    got: dict[str, np.ndarray] = {}
    fns = {
        "mask_unpack_c": lambda: got.__setitem__("unpack", N.mask_unpack(packed, nbits)),
        "mask_indices_c": lambda: got.__setitem__("indices", N.mask_indices(packed, nbits)),
        "mask_indices_numpy": lambda: got.__setitem__("indices_np", np.flatnonzero(np.unpackbits(packed, count=nbits))),
    }
    samples = _time_kernels(fns, rounds, _estimate(fns))
    checks = {"mask_unpack_c": bool(np.array_equal(got["unpack"], bits)),
              "mask_indices_c": bool(np.array_equal(got["indices"], ref_indices)),
              "mask_indices_numpy": bool(np.array_equal(got["indices_np"], ref_indices))}
    for name, s in samples.items():
        med = statistics.median(s)
        report.add_row(name, s, checks[name], nbits=nbits, density=round(float(ref_indices.size / nbits), 3),
                       extra={"curve": "masks_vs_bits", "gbits_per_s": round(nbits / med / 1e9, 3)})
