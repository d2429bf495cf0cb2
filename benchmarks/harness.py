"""Shared measurement helpers: timing loops, machine/version facts, the report format of §9."""
from __future__ import annotations

import dataclasses
import os
import platform
import statistics
import sys
import time
from importlib import metadata
from typing import Any, Callable


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
        print(f"  {flag} {row['name']:<40} {params:<28} median {_fmt_seconds(row['median_s'])}"
              f"  p99 {_fmt_seconds(row['p99_s'])}{extra}")
    for name, value in report.ratios.items():
        met = report.target_met(name)
        verdict = "" if met is None else ("  target " + report.targets[name] + (" met" if met else " MISSED"))
        print(f"  ratio {name:<48} {value:8.3f}{verdict}")
    for note in report.notes:
        print(f"  note: {note}")
