"""Shared measurement helpers: timing loops, machine/version facts, the report format of §9."""
from __future__ import annotations

import dataclasses
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from importlib import metadata
from typing import Any


def percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


def time_calls(fn: Callable[[], Any], repeat: int, warmup: int = 2) -> list[float]:
    """Wall-clock seconds of ``repeat`` calls of ``fn`` after ``warmup`` untimed calls."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return samples


def time_alternating(fns: dict[str, Callable[[], Any]], repeat: int, warmup: int = 2) -> dict[str, list[float]]:
    """Time several candidates in interleaved rounds so drift in machine state hits all alike."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeat):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            samples[name].append(time.perf_counter() - start)
    return samples


def fit_growth(xs: list[float], ys: list[float], unit: str, upper: float = 0.5) -> tuple[float | None, str]:
    """Least-squares slope of log(y) on log(x) over the upper part of a curve (its last ``upper``
    share of points, at least 3 when there are), and what it means: ``constant`` (|slope| < 0.2),
    ``sublinear`` (< 0.8), ``linear in <unit>`` (<= 1.25), ``superlinear in <unit>``, or
    ``decreasing in <unit>`` (< -0.2). Points with x or y <= 0 are left out."""
    pts = sorted((float(x), float(y)) for x, y in zip(xs, ys) if x is not None and y is not None and x > 0 and y > 0)
    if len(pts) < 2:
        return None, "too few points to fit"
    k = min(len(pts), max(3, math.ceil(len(pts) * upper)))
    top = pts[-k:]
    lx = [math.log(x) for x, _ in top]
    ly = [math.log(y) for _, y in top]
    mx, my = sum(lx) / k, sum(ly) / k
    var = sum((v - mx) ** 2 for v in lx)
    if var == 0:
        return None, "too few distinct x to fit"
    slope = sum((a - mx) * (b - my) for a, b in zip(lx, ly)) / var
    return slope, classify_slope(slope, unit)


def _compact(value: float, unit: str) -> str:
    """256 KiB / 16 Mi (bits) / 10k — for growth statements."""
    if unit in ("bytes", "bits"):
        suffix = "iB" if unit == "bytes" else "i"
        for prefix, scale in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
            if value >= scale and value % scale == 0:
                return f"{value / scale:g} {prefix}{suffix}"
        return f"{value:g}"
    for prefix, scale in (("M", 1e6), ("k", 1e3)):
        if value >= scale and value % scale == 0:
            return f"{value / scale:g}{prefix}"
    return f"{value:g}"


def classify_slope(slope: float, unit: str) -> str:
    if slope < -0.2:
        return f"decreasing in {unit}"
    if slope < 0.2:
        return "constant"
    if slope < 0.8:
        return "sublinear"
    if slope <= 1.25:
        return f"linear in {unit}"
    return f"superlinear in {unit}"


def machine_facts() -> dict[str, Any]:
    return {
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "python": sys.version.split()[0],
    }


def package_versions(*names: str) -> dict[str, str]:
    versions = {}
    for name in ("shmtransport", "numpy", *names):
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = "not installed"
    return versions


@dataclasses.dataclass
class Report:
    suite: str
    rows: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    ratios: dict[str, float] = dataclasses.field(default_factory=dict)
    targets: dict[str, str] = dataclasses.field(default_factory=dict)  # ratio name -> "<= 1.35"
    extra_versions: tuple[str, ...] = ()
    notes: list[str] = dataclasses.field(default_factory=list)
    # curve name -> {"x": str, "y": str, "growth": str, "slope": float | None, ...}
    curves: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)

    def add_curve(self, name: str, x: str, y: str, xs: list[float], ys: list[float], unit: str,
                  what: str = "cost", upper: float = 0.5) -> dict[str, Any]:
        """Fit and record how ``y`` grows with ``x`` (see ``fit_growth``); ``what`` names y in the
        statement (e.g. "throughput" for a rate, where constant means saturated)."""
        slope, growth = fit_growth(xs, ys, unit, upper)
        span = [v for v, w in zip(xs, ys) if v is not None and w is not None and v > 0 and w > 0]
        k = min(len(span), max(3, math.ceil(len(span) * upper))) if span else 0
        where = f" over {x} {_compact(span[-k], unit)}..{_compact(span[-1], unit)}" if k >= 2 else ""
        statement = f"{what} {growth} (log-log slope {slope:.2f}{where})" if slope is not None else growth
        entry = {"x": x, "y": y, "growth": statement, "class": growth,
                 "slope": None if slope is None else round(slope, 3), "points": len(span)}
        self.curves[name] = entry
        return entry

    def add_row(self, name: str, samples: list[float], correct: bool, **params: Any) -> dict[str, Any]:
        extra = params.pop("extra", {})
        row = {
            "name": name,
            "params": params,
            "median_s": statistics.median(samples),
            "p99_s": percentile(samples, 99),
            "n": len(samples),
            "correct": bool(correct),
            **extra,
        }
        self.rows.append(row)
        return row

    def median(self, name: str, **params: Any) -> float:
        for row in self.rows:
            if row["name"] == name and all(row["params"].get(k) == v for k, v in params.items()):
                return row["median_s"]
        raise KeyError(f"no row {name} {params}")

    def target_met(self, ratio: str) -> bool | None:
        target = self.targets.get(ratio)
        if target is None:
            return None
        op, value = target.split()
        return self.ratios[ratio] <= float(value) if op == "<=" else self.ratios[ratio] >= float(value)

    def to_json(self) -> dict[str, Any]:
        return {
            "suite": self.suite,
            "machine": machine_facts(),
            "versions": package_versions(*self.extra_versions),
            "rows": self.rows,
            "ratios": self.ratios,
            "targets": {k: {"target": v, "met": self.target_met(k)} for k, v in self.targets.items()},
            "notes": self.notes,
            "curves": self.curves,
        }


def _fmt_seconds(seconds: float) -> str:
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if seconds >= scale:
            return f"{seconds / scale:8.3f} {unit}"
    return f"{seconds / 1e-9:8.1f} ns"


def print_report(report: Report) -> None:
    print(f"== suite {report.suite}")
    for row in report.rows:
        params = " ".join(f"{k}={v}" for k, v in row["params"].items())
        flag = "ok " if row["correct"] else "BAD"
        extra = f"  {row['gbps']:.2f} GB/s" if "gbps" in row else ""
        if "cpu_s_per_gb" in row:  # per process: producer/consumer/daemon
            extra += "  cpu s/GB " + "/".join(f"{v:.3f}" for v in row["cpu_s_per_gb"].values())
        if "peak_rss_mb" in row:
            extra += "  peak RSS MB " + "/".join(f"{v:.0f}" for v in row["peak_rss_mb"].values())
        print(f"  {flag} {row['name']:<40} {params:<28} median {_fmt_seconds(row['median_s'])}"
              f"  p99 {_fmt_seconds(row['p99_s'])}{extra}")
    for name, value in report.ratios.items():
        met = report.target_met(name)
        verdict = "" if met is None else ("  target " + report.targets[name] + (" met" if met else " MISSED"))
        print(f"  ratio {name:<48} {value:8.3f}{verdict}")
    for name, curve in report.curves.items():
        print(f"  curve {name:<44} {curve['y']} vs {curve['x']}: {curve['growth']}")
    for note in report.notes:
        print(f"  note: {note}")
