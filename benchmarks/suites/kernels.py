"""Kernel suite: C kernels (shmtransport._native) against their peers, in the same run.

    python benchmarks/run.py kernels [--quick] [--json PATH]

Groups (each group's candidates alternate round by round, after warm-up; inputs are seeded):

* copy/hash 64 MiB: np.copyto (glibc memcpy) into a pre-faulted dst; our copy (non-temporal
  stores); fused copy+tree digest (``copy_tree_digest``); fused streaming copy+hash
  (``Xxh3Stream.copy_update``); copy-then-hash (np.copyto + ``xxhash.xxh3_128`` one-shot).
* hash 64 MiB, one thread: our C XXH3-128 one-shot vs ``xxhash.xxh3_128(buf).digest()``.
* tree mode 64 MiB at 1..N threads vs the python-xxhash one-shot, and the machine's own scaling:
  python-xxhash one-shot on one 64 MiB buffer per thread, t threads in parallel, vs one thread.
  efficiency = (one-shot time / tree time at N threads) / (aggregate throughput at N / at 1).
* other hashes at 64 MiB: blake3 (1 thread and all), sha256 (the grpc-mm scheme's hash).
* is_embed masks, 10 M bits, ~30 % set in runs: each C kernel vs the numpy idiom it replaces.
  Both sides allocate their outputs.

Every row's ``correct`` flag is computed from the outputs the candidate actually produced.
"""
from __future__ import annotations

import hashlib
import os
from concurrent.futures import ThreadPoolExecutor

import blake3
import numpy as np
import xxhash
from harness import Report, time_alternating

from shmtransport import _native as N
from shmtransport import _purepy as P

MiB = 1 << 20
SEED = 20251130


def _rand(nbytes: int, seed: int) -> np.ndarray:
    return np.frombuffer(np.random.default_rng(seed).bytes(nbytes), dtype=np.uint8).copy()


def _prefaulted(nbytes: int) -> np.ndarray:
    dst = np.empty(nbytes, dtype=np.uint8)
    dst.fill(0xA5)  # touch every page now, not inside a timed call
    return dst


def _gbps(nbytes: int, samples: list[float]) -> float:
    return nbytes / sorted(samples)[len(samples) // 2] / 1e9


def _copy_hash(report: Report, repeat: int) -> None:
    n = 64 * MiB
    src = _rand(n, SEED)
    dst = _prefaulted(n)
    tree_ref = P.tree_digest(src)
    flat_ref = xxhash.xxh3_128(src).digest()
    results: dict[str, bytes] = {}
    stream = N.Xxh3Stream()

    def fused_stream():
        stream.reset()
        stream.copy_update(dst, src)
        results["fused_stream"] = stream.digest()

    def fused_tree():  # one thread: the ratio targets compare like with like
        results["fused_tree"] = N.copy_tree_digest(dst, src, threads=1)

    def fused_tree_all_cores():
        results["fused_tree_all"] = N.copy_tree_digest(dst, src)

    def copy_then_hash():
        np.copyto(dst, src)
        results["copy_then_hash"] = xxhash.xxh3_128(src).digest()

    candidates = {
        "memcpy_numpy_copyto": lambda: np.copyto(dst, src),
        "copy_c_nt": lambda: N.copy(dst, src, threads=1),
        "copy_c_nt_all_cores": lambda: N.copy(dst, src),
        "fused_copy_tree_digest": fused_tree,
        "fused_copy_tree_digest_all_cores": fused_tree_all_cores,
        "fused_stream_copy_update": fused_stream,
        "copy_then_hash_numpy_xxhash": copy_then_hash,
    }
    samples = time_alternating(candidates, repeat=repeat, warmup=3)
    # correctness: re-run each candidate once on a cleared dst and check what it produced
    checks = {}
    for name, fn in candidates.items():
        dst.fill(0)
        fn()
        ok = bool(np.array_equal(dst, src))
        if name == "fused_copy_tree_digest":
            ok = ok and results["fused_tree"] == tree_ref
        elif name == "fused_copy_tree_digest_all_cores":
            ok = ok and results["fused_tree_all"] == tree_ref
        elif name == "fused_stream_copy_update":
            ok = ok and results["fused_stream"] == flat_ref
        elif name == "copy_then_hash_numpy_xxhash":
            ok = ok and results["copy_then_hash"] == flat_ref
        checks[name] = ok
    for name, s in samples.items():
        report.add_row(name, s, checks[name], nbytes=n, extra={"gbps": _gbps(n, s)})
    med = {name: report.median(name, nbytes=n) for name in samples}
    report.ratios["fused_copy_hash_over_memcpy_64MiB"] = med["fused_copy_tree_digest"] / med["memcpy_numpy_copyto"]
    report.ratios["fused_copy_hash_over_copy_then_hash_64MiB"] = (
        med["fused_copy_tree_digest"] / med["copy_then_hash_numpy_xxhash"])
    report.ratios["fused_stream_copy_hash_over_memcpy_64MiB"] = (
        med["fused_stream_copy_update"] / med["memcpy_numpy_copyto"])
    report.ratios["copy_c_over_memcpy_64MiB"] = med["copy_c_nt"] / med["memcpy_numpy_copyto"]
    report.ratios["fused_copy_hash_all_cores_over_memcpy_64MiB"] = (
        med["fused_copy_tree_digest_all_cores"] / med["memcpy_numpy_copyto"])
    report.targets["fused_copy_hash_over_memcpy_64MiB"] = "<= 1.35"
    report.targets["fused_copy_hash_over_copy_then_hash_64MiB"] = "<= 0.85"


def _hashes(report: Report, repeat: int, slow_repeat: int) -> None:
    n = 64 * MiB
    buf = _rand(n, SEED + 1)
    ref = xxhash.xxh3_128(buf).digest()
    out: dict[str, bytes] = {}
    one = {
        "xxh3_128_c_oneshot": lambda: out.__setitem__("c", N.xxh3_128(buf)),
        "xxh3_128_pyxxhash_oneshot": lambda: out.__setitem__("py", xxhash.xxh3_128(buf).digest()),
    }
    samples = time_alternating(one, repeat=repeat, warmup=3)
    report.add_row("xxh3_128_c_oneshot", samples["xxh3_128_c_oneshot"], out["c"] == ref, nbytes=n, threads=1,
                   extra={"gbps": _gbps(n, samples["xxh3_128_c_oneshot"])})
    report.add_row("xxh3_128_pyxxhash_oneshot", samples["xxh3_128_pyxxhash_oneshot"], out["py"] == ref, nbytes=n,
                   threads=1, extra={"gbps": _gbps(n, samples["xxh3_128_pyxxhash_oneshot"])})
    report.ratios["xxh3_c_over_pyxxhash_64MiB"] = (
        report.median("xxh3_128_c_oneshot") / report.median("xxh3_128_pyxxhash_oneshot"))
    report.targets["xxh3_c_over_pyxxhash_64MiB"] = "<= 1.05"

    # tree mode at 1..N threads, the one-shot reference and the machine's scaling (python-xxhash
    # one-shot, one buffer per thread, t threads in parallel): one alternating group, so drift in
    # what the machine gives us (other tenants on the cores) hits both sides of the efficiency alike
    cores = os.cpu_count() or 1
    tree_ref = P.tree_digest(buf)
    tree_out: dict[int, bytes] = {}
    bufs = [buf] + [_rand(n, SEED + 10 + i) for i in range(1, cores)]
    refs = [xxhash.xxh3_128(b).digest() for b in bufs]
    pool = ThreadPoolExecutor(max_workers=cores)
    par_ok: dict[int, bool] = {}

    def parallel(t: int) -> None:
        futures = [pool.submit(lambda b=b: xxhash.xxh3_128(b).digest()) for b in bufs[:t]]
        par_ok[t] = [f.result() for f in futures] == refs[:t]

    group: dict[str, object] = {}
    for t in range(1, cores + 1):
        group[f"tree_{t}"] = lambda t=t: tree_out.__setitem__(t, N.tree_digest(buf, threads=t))
    group["pyxxhash_oneshot"] = lambda: xxhash.xxh3_128(buf).digest()
    for t in range(1, cores + 1):
        group[f"parallel_{t}"] = lambda t=t: parallel(t)
    gsamples = time_alternating(group, repeat=repeat, warmup=3)
    pool.shutdown()
    for t in range(1, cores + 1):
        s = gsamples[f"tree_{t}"]
        report.add_row("xxh3_tree_digest_c", s, tree_out[t] == tree_ref, nbytes=n, threads=t,
                       extra={"gbps": _gbps(n, s)})
    report.add_row("xxh3_128_pyxxhash_oneshot_tree_group", gsamples["pyxxhash_oneshot"], True, nbytes=n,
                   threads=1, extra={"gbps": _gbps(n, gsamples["pyxxhash_oneshot"])})
    for t in range(1, cores + 1):
        s = gsamples[f"parallel_{t}"]
        report.add_row("machine_scaling_pyxxhash_parallel", s, par_ok[t], nbytes_per_thread=n, threads=t,
                       extra={"gbps": _gbps(t * n, s)})
    agg1 = n / report.median("machine_scaling_pyxxhash_parallel", threads=1)
    aggn = cores * n / report.median("machine_scaling_pyxxhash_parallel", threads=cores)
    machine_scaling = aggn / agg1
    tree_speedup = report.median("xxh3_128_pyxxhash_oneshot_tree_group") / report.median(
        "xxh3_tree_digest_c", threads=cores)
    report.ratios["machine_scaling_pyxxhash_64MiB"] = machine_scaling
    report.ratios["xxh3_tree_speedup_all_cores_vs_pyxxhash_64MiB"] = tree_speedup
    report.ratios["xxh3_tree_threads_efficiency_64MiB"] = tree_speedup / machine_scaling
    report.targets["xxh3_tree_threads_efficiency_64MiB"] = ">= 0.9"

    # other hashes (fewer repeats: sha256 is ~60 ms per call here)
    b3 = blake3.blake3(buf).digest()
    sha = hashlib.sha256(buf).digest()
    got: dict[str, bytes] = {}
    other = {
        "blake3_1thread": lambda: got.__setitem__("b1", blake3.blake3(buf, max_threads=1).digest()),
        "blake3_all_threads": lambda: got.__setitem__("ba",
                                                      blake3.blake3(buf, max_threads=blake3.blake3.AUTO).digest()),
        "sha256_hashlib": lambda: got.__setitem__("sha", hashlib.sha256(buf).digest()),
    }
    osamples = time_alternating(other, repeat=slow_repeat, warmup=1)
    checks = {"blake3_1thread": got["b1"] == b3, "blake3_all_threads": got["ba"] == b3,
              "sha256_hashlib": got["sha"] == sha}
    for name, s in osamples.items():
        report.add_row(name, s, checks[name], nbytes=n, extra={"gbps": _gbps(n, s)})


def _mask_input(nbits: int, seed: int) -> np.ndarray:
    """~30 % set, in runs: alternating gap/run lengths, geometric with means 70 and 30."""
    rng = np.random.default_rng(seed)
    pairs = nbits // 100 * 2 + 16
    lengths = np.empty(pairs, dtype=np.int64)
    lengths[0::2] = rng.geometric(1 / 70, pairs // 2)
    lengths[1::2] = rng.geometric(1 / 30, pairs // 2)
    values = np.tile(np.array([False, True]), pairs // 2)
    bits = np.repeat(values, lengths)
    while bits.size < nbits:  # pragma: no cover - extremely unlikely with the slack above
        bits = np.concatenate((bits, bits))
    return bits[:nbits]


def _numpy_runs(packed: np.ndarray, nbits: int) -> np.ndarray:
    bits = np.unpackbits(packed, count=nbits).view(np.int8)
    edges = np.diff(np.concatenate((np.zeros(1, np.int8), bits, np.zeros(1, np.int8))))
    starts = np.flatnonzero(edges == 1)
    ends = np.flatnonzero(edges == -1)
    return np.stack((starts, ends - starts), axis=1)


def _masks(report: Report, repeat: int) -> None:
    nbits = 10_000_000
    bits = _mask_input(nbits, SEED + 2)
    packed = np.packbits(bits)
    density = float(bits.mean())
    ref_indices = np.flatnonzero(bits)
    ref_runs = _numpy_runs(packed, nbits)
    ref_cumsum = np.cumsum(bits, dtype=np.int64)
    start, end = nbits // 3, 2 * nbits // 3
    ref_window = (int(bits[:start].sum()), int(bits[:end].sum()))

    kernels = {
        # name: (ours, numpy peer, check(result) -> bool, target)
        "indices": (lambda: N.mask_indices(packed, nbits),
                    lambda: np.flatnonzero(np.unpackbits(packed, count=nbits)),
                    lambda r: np.array_equal(r, ref_indices), 5.0),
        "runs": (lambda: N.mask_runs(packed, nbits), lambda: _numpy_runs(packed, nbits),
                 lambda r: np.array_equal(r, ref_runs), 10.0),
        "popcount": (lambda: N.mask_popcount(packed, nbits),
                     lambda: np.count_nonzero(np.unpackbits(packed, count=nbits)),
                     lambda r: int(r) == ref_indices.size, 4.0),
        "unpack": (lambda: N.mask_unpack(packed, nbits),
                   lambda: np.unpackbits(packed, count=nbits).view(bool),
                   lambda r: np.array_equal(r, bits), 1.0),
        "cumsum": (lambda: N.mask_cumsum(packed, nbits),
                   lambda: np.cumsum(np.unpackbits(packed, count=nbits), dtype=np.int64),
                   lambda r: np.array_equal(r, ref_cumsum), None),
        "window": (lambda: N.mask_window(packed, nbits, start, end),
                   lambda: (int(np.count_nonzero(np.unpackbits(packed, count=start))),
                            int(np.count_nonzero(np.unpackbits(packed, count=end)))),
                   lambda r: tuple(r) == ref_window, None),
    }
    for name, (ours, peer, check, target) in kernels.items():
        samples = time_alternating({"c": ours, "numpy": peer}, repeat=repeat, warmup=2)
        report.add_row(f"mask_{name}_c", samples["c"], check(ours()), nbits=nbits, density=round(density, 3))
        report.add_row(f"mask_{name}_numpy", samples["numpy"], check(peer()), nbits=nbits, density=round(density, 3))
        ratio = f"mask_{name}_speedup_1e7"
        report.ratios[ratio] = report.median(f"mask_{name}_numpy") / report.median(f"mask_{name}_c")
        if target is not None:
            report.targets[ratio] = f">= {target:g}"


def run(quick: bool) -> Report:
    report = Report("kernels", extra_versions=("xxhash", "blake3", "cffi"))
    repeat = 9 if quick else 41
    slow_repeat = 3 if quick else 9
    _copy_hash(report, repeat)
    _hashes(report, repeat, slow_repeat)
    _masks(report, 7 if quick else 31)
    report.notes.append(f"C extension XXH3 link mode: {N.XXH_LINK_MODE}; tree chunk {N.TREE_CHUNK_NBYTES} bytes")
    report.notes.append("memcpy peer = np.copyto into a pre-faulted dst; glibc uses no non-temporal stores "
                        "below ~190 MB, our copy does from 256 KiB")
    report.notes.append("machine scaling = aggregate python-xxhash one-shot throughput with one 64 MiB buffer per "
                        "thread, all cores vs one; efficiency divides the tree-mode speedup by it")
    missed = [f"{name} = {report.ratios[name]:.3f} (target {target})"
              for name, target in report.targets.items() if not report.target_met(name)]
    report.notes.append("where we lose: " + ("; ".join(missed) if missed else "no target missed in this run"))
    return report
