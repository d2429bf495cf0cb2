"""The ``scale`` benchmark suite on tiny parameters, its correctness flags, growth classification and
the plots of every suite shape (``benchmarks/suites/scale.py``, ``benchmarks/plots.py``)."""
from __future__ import annotations

import importlib.util
import json
import math
import os
import pathlib
import subprocess
import sys
import tempfile

import pytest

BENCH = pathlib.Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCH))

from harness import Report, fit_growth
from peers import _ours
from suites import scale

from shmtransport import objtable
from shmtransport.allocator import Allocator

KiB, MiB = 1 << 10, 1 << 20
needs_daemon = pytest.mark.skipif(_ours.import_error() is not None, reason="shmtransport daemon not importable")
HAS_ICEORYX2 = importlib.util.find_spec("iceoryx2") is not None  # the peers extra


@pytest.fixture
def workdir():
    path = tempfile.mkdtemp(prefix="stb-scale-test-")
    yield path
    for name in os.listdir(path):
        os.unlink(os.path.join(path, name))
    os.rmdir(path)


def _rows(report: Report, curve: str) -> list[dict]:
    return [r for r in report.rows if r.get("curve") == curve]


# -- allocator curve -------------------------------------------------------------------------------

def test_alloc_curve_rows_are_correct_and_report_fragmentation():
    report = Report("scale")
    scale.alloc_vs_occupancy(report, occupancies=(30, 90), probes=200, churn=100, arena_nbytes=256 * MiB,
                             daemon_point=False)
    rows = _rows(report, "alloc_vs_occupancy")
    assert [r["params"]["occupancy_pct"] for r in rows] == [30, 90]
    for row in rows:
        assert row["correct"] is True, row["problems"]
        assert row["n"] == 200
        assert 0.0 <= row["failure_rate"] <= 1.0
        assert 0 < row["largest_free_nbytes"] <= row["free_nbytes"]
        assert abs(row["occupancy_actual_pct"] - row["params"]["occupancy_pct"]) < 10
    assert "alloc_vs_occupancy.median_latency" in report.curves
    assert report.curves["alloc_vs_occupancy.failure_rate"]["growth"]


class _GhostAllocator(Allocator):
    """Hands every 5th extent out and silently puts it back in the free set: the next allocation can
    get the same bytes while the first holder still uses them."""

    def __init__(self, nbytes: int):
        super().__init__(nbytes)
        self.calls = 0
        self.ghosts: set[int] = set()

    def allocate(self, nbytes: int) -> int:
        offset = super().allocate(nbytes)
        self.calls += 1
        if self.calls % 5 == 0:
            super().free(offset)
            self.ghosts.add(offset)
        return offset

    def free(self, offset: int) -> int:
        if offset in self.ghosts:
            self.ghosts.discard(offset)
            return 0
        return super().free(offset)


def test_alloc_curve_flag_fails_when_allocations_overlap():
    report = Report("scale")
    scale.alloc_vs_occupancy(report, occupancies=(50,), probes=100, churn=50, arena_nbytes=256 * MiB,
                             allocator_factory=_GhostAllocator, daemon_point=False)
    (row,) = _rows(report, "alloc_vs_occupancy")
    assert row["correct"] is False
    assert any("overlaps" in p or "handed out twice" in p or "used" in p for p in row["problems"])


def test_extent_check_catches_overlap_misalignment_and_bounds():
    live = scale._Extents(1 * MiB, 64 * KiB)
    live.add(0, 100)
    assert live.ok
    assert not live.fits(64, 10)  # inside [0, 128)
    live2 = scale._Extents(1 * MiB, 64 * KiB)
    assert not live2.fits(64, 64 * KiB)  # a page-aligned size at a cache-line offset
    live3 = scale._Extents(1 * MiB, 64 * KiB)
    assert not live3.fits(1 * MiB - 64, 128)  # past the end
    assert live3.ok is False and live3.problems  # a failure sticks to the flag
    assert scale._Extents(1 * MiB, 64 * KiB).fits(128, 100)


# -- growth and crossover --------------------------------------------------------------------------

SIZES = [4 * KiB * 4**i for i in range(10)]  # 4 KiB .. 1 GiB


@pytest.mark.parametrize(("ys", "expected"), [
    ([2e-3] * 10, "constant"),
    ([1e-3 + n / 1e9 for n in SIZES], "linear in bytes"),  # a fixed cost, then bytes dominate
    ([math.sqrt(n) * 1e-6 for n in SIZES], "sublinear"),
    ([(n / 1e6) ** 2 for n in SIZES], "superlinear in bytes"),
    ([1 / n for n in SIZES], "decreasing in bytes"),
])
def test_growth_classification_on_synthetic_curves(ys, expected):
    slope, growth = fit_growth(SIZES, ys, "bytes")
    assert growth == expected, (slope, growth)


def test_growth_uses_the_upper_part_and_skips_non_positive_points():
    leases = [10, 100, 1_000, 10_000, 100_000]
    stat = [5e-4, 5e-4, 6e-4, 5e-3, 5e-2]  # flat, then linear
    slope, growth = fit_growth(leases, stat, "leases")
    assert growth == "linear in leases" and 0.8 < slope < 1.25
    assert fit_growth([1, 2], [0.0, -1.0], "bytes") == (None, "too few points to fit")
    report = Report("scale")
    entry = report.add_curve("c", "leases", "median_s", leases, stat, "leases")
    assert report.to_json()["curves"]["c"] is entry
    assert entry["class"] == "linear in leases" and "1k..100k" in entry["growth"]  # the upper 3 of 5 points


def test_crossover_is_interpolated_log_log_between_the_bracketing_sizes():
    xs = [1 * KiB, 4 * KiB, 16 * KiB]
    inline = [1.0, 2.0, 8.0]
    put = [2.0, 4.0, 4.0]  # inline faster at 1 and 4 KiB, slower at 16 KiB
    hit = scale.crossover(xs, inline, put)
    assert hit["bracket"] == [4 * KiB, 16 * KiB]
    # log(a/b) goes from log(0.5) to log(2): zero halfway in log size, i.e. 8 KiB
    assert hit["nbytes"] == pytest.approx(8 * KiB, rel=1e-9)
    assert scale.crossover(xs, [0.1, 0.1, 0.1], put) is None  # always faster: no crossover
    marginal = [0.0, -0.5, 7.0]  # a non-positive point in the bracket: the difference is interpolated
    hit = scale.crossover(xs, marginal, put)
    assert hit["bracket"] == [4 * KiB, 16 * KiB] and "difference" in hit["method"]


# -- the measured pieces on tiny parameters --------------------------------------------------------

def test_kernels_vs_size_rows_are_correct():
    pytest.importorskip("shmtransport._native", reason="could not import the C kernels: not built",
                        exc_type=ImportError)
    report = Report("scale")
    scale.kernels_vs_size(report, (4 * KiB, 1 * MiB), (4096, 65536), rounds=2)
    rows = _rows(report, "kernels_vs_size") + _rows(report, "masks_vs_bits")
    assert len(rows) == 2 * 4 + 2 * 3
    assert all(r["correct"] for r in rows), [r["name"] for r in rows if not r["correct"]]
    assert report.curves["kernels_vs_size.memcpy_numpy_copyto"]["slope"] is not None


@needs_daemon
@pytest.mark.timeout(90)
def test_latency_vs_size_rows_are_correct_and_give_a_crossover_verdict(workdir):
    report = Report("scale")
    sizes = {4 * KiB: (2, 1), 256 * KiB: (2, 1)}
    peers = ("memcpy", "grpc_inline", "shm_put_hash", "shm_loan") + (("iceoryx2_loan",) if HAS_ICEORYX2 else ())
    scale.latency_vs_size(report, sizes, workdir, peers=peers)
    rows = _rows(report, "latency_vs_size")
    assert {(r["name"], r["params"]["nbytes"]) for r in rows} == {(p, n) for p in peers for n in sizes}
    assert all(r["correct"] and r["n"] == 2 for r in rows)
    assert "inline_crossover" in report.curves or any("inline_crossover" in n for n in report.notes)
    assert not [n for n in report.notes if n.startswith("ERROR")]


@needs_daemon
@pytest.mark.timeout(90)
def test_throughput_vs_pairs_has_a_row_per_transport(workdir):
    report = Report("scale")
    scale.throughput_vs_pairs(report, (1,), 0.3, workdir, shape={"tensors": 2, "nbytes": 16 * KiB})
    rows = {r["name"]: r for r in _rows(report, "throughput_vs_pairs")}
    expected = {"lifecycles_shm", "lifecycles_grpc_inline"} | ({"lifecycles_iceoryx2"} if HAS_ICEORYX2 else set())
    assert set(rows) == expected, report.notes
    for row in rows.values():
        assert row["correct"] is True
        assert row["lifecycles_per_s"] > 0 and row["gbps"] > 0
    assert rows["lifecycles_shm"]["daemon_cpu_us_per_lifecycle"] > 0


@needs_daemon
@pytest.mark.timeout(90)
def test_daemon_vs_leases_holds_the_leases_it_reports(workdir):
    report = Report("scale")
    scale.daemon_vs_leases(report, (10, 300), lifecycles=10, workdir=workdir, stat_calls=3)
    rows = _rows(report, "daemon_vs_leases")
    assert [(r["name"], r["params"]["leases"]) for r in rows] == [
        ("leases_lifecycle_4KiB", 10), ("leases_stat_rpc", 10), ("leases_lifecycle_4KiB", 300),
        ("leases_stat_rpc", 300)]
    assert all(r["correct"] for r in rows)
    assert all(r["live_leases"] >= r["params"]["leases"] for r in rows)
    assert all(r["object_table"] is objtable.available() for r in rows)  # the daemon's default path
    life = [r for r in rows if r["name"] == "leases_lifecycle_4KiB"]
    assert all(r["daemon_rss_mb"] > 0 for r in life)
    # Through the RPC registry every lifecycle costs the daemon CPU; in the object table none does
    # (the timed span may catch none of the janitor's ticks).
    assert all(r["daemon_cpu_us_per_lifecycle"] > 0 for r in life if not r["object_table"])
    assert "daemon_vs_leases.stat" in report.curves


@needs_daemon
@pytest.mark.timeout(60)
def test_daemon_loan_points_are_correct():
    report = Report("scale")
    scale._daemon_loan_points(report, seed=1, occupancies=(50,), probes=20)
    (row,) = [r for r in report.rows if r["name"] == "daemon_loan_rpc"]
    assert row["correct"] is True and row["n"] == 20


# -- plots -----------------------------------------------------------------------------------------

def _row(name: str, median: float, **params) -> dict:
    extra = params.pop("extra", {})
    return {"name": name, "params": params, "median_s": median, "p99_s": median * 1.5, "n": 3, "correct": True,
            **extra}


def _sample_reports() -> list[dict]:
    sizes = [4 * KiB, 1 * MiB, 64 * MiB]
    transport = [_row(p, 1e-3 + n / f, size=f"{n}", nbytes=n, extra={"gbps": n / (1e-3 + n / f) / 1e9})
                 for p, f in (("memcpy", 8e9), ("grpc_inline", 4e8), ("shm_put_hash", 5e9), ("new_peer", 1e9))
                 for n in sizes] + [_row("bare_rpc_rate", 5e-4, clients=1)]
    scale_rows = (
        [dict(r, curve="latency_vs_size") for r in transport if "nbytes" in r["params"]]
        + [_row(n, 1e-3 * p, pairs=p, tensors=4, nbytes=256 * KiB,
                extra={"curve": "throughput_vs_pairs", "lifecycles_per_s": 500 * p ** 0.5, "gbps": 0.5 * p ** 0.5})
           for n in ("lifecycles_shm", "lifecycles_grpc_inline") for p in (1, 4)]
        + [_row(n, 2e-6 if n == "allocator_alloc" else 8e-4, occupancy_pct=o, arena_nbytes=1 << 30,
                extra={"curve": "alloc_vs_occupancy", "failure_rate": o / 1000, "largest_free_over_free": 1 - o / 100})
           for n in ("allocator_alloc", "daemon_loan_rpc") for o in (30, 90)]
        + [_row(n, 1e-3 * (1 + k / 1e4), leases=k,
                extra={"curve": "daemon_vs_leases", "daemon_rss_mb": 50 + k / 1e3, "daemon_cpu_us_per_lifecycle": 900})
           for n in ("leases_lifecycle_4KiB", "leases_stat_rpc") for k in (10, 1000, 10000)]
        + [_row(n, s / 1e10, size=str(s), nbytes=s, extra={"curve": "kernels_vs_size", "gbps": 10.0})
           for n in ("memcpy_numpy_copyto", "tree_digest_c") for s in sizes]
        + [_row(n, b / 1e9, nbits=b, density=0.3, extra={"curve": "masks_vs_bits", "gbits_per_s": 1.0})
           for n in ("mask_unpack_c", "mask_indices_numpy") for b in (4096, 1 << 20)]
    )
    kernels = [_row("memcpy_numpy_copyto", 8e-3, nbytes=64 * MiB, extra={"gbps": 8.0}),
               _row("xxh3_tree_digest_c", 3e-3, nbytes=64 * MiB, threads=2, extra={"gbps": 22.0}),
               _row("mask_indices_c", 3e-3, nbits=10**7, density=0.3),
               _row("mask_indices_numpy", 1.6e-2, nbits=10**7, density=0.3)]
    pipeline = [_row("handoff", t, kind=k, path=p, nbytes=n) for k, n in (("image", 5 * MiB), ("audio", 1 * MiB))
                for p, t in (("shm", 7e-3), ("inline", 26e-3), ("segment_pread", 8e-3))]
    remote = [_row(n, t * s / MiB, nbytes=s, size=str(s)) for n, t in (("nixl_remote_read", 1e-3),
                                                                        ("grpc_inline", 2e-3)) for s in sizes]
    engine = [_row(name, t, kind=k, path=p, nbytes=n) for name in ("first_token", "first_token_repeat")
              for k, n in (("image", 5 * MiB), ("video", 2 * MiB))
              for p, t in (("ours", 3e-2), ("stock-shm", 9e-2), ("stock-inline", 8e-2))]
    other = [_row("something", 1e-3, kind="a"), _row("something", 2e-3, kind="b")]
    machine = {"cpus": 2, "platform": "test", "python": "3.11"}
    out = []
    for suite, rows in (("transport", transport), ("scale", scale_rows), ("kernels", kernels),
                        ("pipeline", pipeline), ("remote", remote), ("engine", engine), ("future_suite", other)):
        out.append({"suite": suite, "machine": machine, "rows": rows,
                    "ratios": {"inline_crossover_nbytes_standalone": 900_000.0} if suite == "scale" else {},
                    "curves": {}, "notes": []})
    return out


def test_write_plots_writes_non_empty_pngs_for_every_suite_shape(tmp_path):
    """Through the CLI, in a child process: matplotlib's font cache keeps the font files it loaded
    open for the life of the process, which the suite's fd-leak check would count against the test."""
    pytest.importorskip("matplotlib")
    expected = {
        "transport": {"transport_latency_vs_size.png"},
        "scale": {f"scale_{c}.png" for c in ("latency_vs_size", "throughput_vs_pairs", "alloc_vs_occupancy",
                                              "daemon_vs_leases", "kernels_vs_size", "masks_vs_bits")},
        "kernels": {"kernels_gbps.png", "kernels_masks.png"},
        "pipeline": {"pipeline_handoff.png"},
        "remote": {"remote_latency_vs_size.png"},
        "engine": {"engine_first_token.png", "engine_first_token_repeat.png"},
        "future_suite": {"future_suite_rows.png"},
    }
    paths = []
    for report in _sample_reports():
        path = tmp_path / f"{report['suite']}.json"
        path.write_text(json.dumps(report))
        paths.append(str(path))
    done = subprocess.run([sys.executable, str(BENCH / "plots.py"), *paths], capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    written = {pathlib.Path(line.split(" ", 1)[1]).name for line in done.stdout.splitlines()
               if line.startswith("wrote ")}
    assert written == set().union(*expected.values())
    for name in written:
        data = (tmp_path / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000, name


def test_run_without_matplotlib_notes_it_and_does_not_fail(monkeypatch, tmp_path, capsys):
    import run

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    run._plots({"suite": "scale", "rows": []}, tmp_path)
    assert "no plots written" in capsys.readouterr().out
    assert not list(tmp_path.iterdir())
