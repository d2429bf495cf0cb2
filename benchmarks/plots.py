"""PNG plots of benchmark reports (matplotlib, Agg): ``<suite>_<curve>.png`` next to the JSON.

    python benchmarks/plots.py benchmarks/results/*.json     # regenerate from committed JSON

``benchmarks/run.py SUITE --json PATH`` calls ``write_plots`` after writing the JSON. Every suite
gets what is natural for its rows: lines on log axes where sizes span decades (one line per peer,
the memcpy floor dashed), bars where the rows are a handful of candidates. A suite without a plotter
of its own gets latency against size when its rows carry ``nbytes``, else a bar chart per row.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import sys
from collections import defaultdict
from typing import Any

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
FLOORS = {"memcpy", "memcpy_numpy_copyto"}  # dashed: the data-plane floor
CONTROL_FLOORS = {"bare_rtt"}  # dotted: the control-plane floor
OURS_PREFIXES = ("shm", "lifecycles_shm", "nixl")
PEER_MARKERS = ("numpy", "pyxxhash", "blake3", "sha256", "hashlib")  # kernels rows that are not ours
FIGSIZE = (10.5, 6.2)
DPI = 110


# -- formatting --------------------------------------------------------------------------------------

def _scaled(value: float, units: tuple[tuple[str, float], ...], smallest: str) -> str:
    """``value`` in the largest unit it reaches, whole when it is nearly so (axis tick labels)."""
    for unit, scale in units:
        if value >= scale:
            v = value / scale
            return f"{v:.0f}{unit}" if abs(v - round(v)) < 0.05 else f"{v:.1f}{unit}"
    return f"{value:g}{smallest}"


def fmt_bytes(value: float, _pos: Any = None) -> str:
    return _scaled(value, ((" GiB", GiB), (" MiB", MiB), (" KiB", KiB)), " B")


def fmt_count(value: float, _pos: Any = None) -> str:
    return _scaled(value, (("G", 1e9), ("M", 1e6), ("k", 1e3)), "")


def fmt_bits(value: float, _pos: Any = None) -> str:
    return _scaled(value, ((" Gi", GiB), (" Mi", MiB), (" Ki", KiB)), "")


def fmt_seconds(value: float, _pos: Any = None) -> str:
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6)):
        if value >= scale:
            v = value / scale
            return f"{v:g} {unit}"
    return f"{value / 1e-9:g} ns"


COLORS = {  # one colour per peer in every plot; anything else takes the next of the default cycle
    "grpc_inline": "tab:blue", "grpc_inline_tcp": "tab:cyan", "vllm_msgpack_inline": "tab:brown",
    "mp_shared_memory": "tab:orange", "mp_shared_memory_reused": "gold",
    "segment_pread": "tab:green", "dynamo_segment": "yellowgreen",
    "torch_mp_queue": "tab:pink", "pickle5_oob": "tab:gray",
    "shm_put_hash": "tab:purple", "shm_put": "tab:olive", "shm_loan": "tab:red",
    "shm_put_verify": "indigo", "shm_loan_verify": "darkred",
    "lifecycles_shm": "tab:red", "lifecycles_grpc_inline": "tab:blue", "nixl_remote_read": "tab:red",
}
MARK_COLOR = "teal"


def _style(name: str) -> dict[str, Any]:
    if name in FLOORS:
        return {"linestyle": "--", "color": "black", "linewidth": 1.8, "marker": None}
    if name in CONTROL_FLOORS:
        return {"linestyle": ":", "color": "dimgray", "linewidth": 2.0, "marker": None}
    bold = name.startswith(OURS_PREFIXES)
    style = {"linestyle": "-." if name.endswith("_verify") else "-", "linewidth": 2.4 if bold else 1.5,
             "marker": "o" if bold else ".", "markersize": 5 if bold else 6}
    if name in COLORS:
        style["color"] = COLORS[name]
    return style


def _log_bytes_axis(ax, axis: str = "x", formatter=fmt_bytes) -> None:
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    target = ax.xaxis if axis == "x" else ax.yaxis
    (ax.set_xscale if axis == "x" else ax.set_yscale)("log", base=2)
    target.set_major_locator(LogLocator(base=4))
    target.set_major_formatter(FuncFormatter(formatter))
    target.set_minor_formatter(NullFormatter())


def _log_seconds_axis(ax, axis: str = "y") -> None:
    """Log scale with times as "10 µs", "1 ms"; when the data span less than ~1.5 decades the 2x
    and 5x minor ticks are labelled too (else a log axis may show no label, or 3x10^-3)."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    (ax.set_yscale if axis == "y" else ax.set_xscale)("log")
    target = ax.yaxis if axis == "y" else ax.xaxis
    target.set_major_locator(LogLocator(base=10))
    target.set_major_formatter(FuncFormatter(fmt_seconds))
    lo, hi = ax.get_ylim() if axis == "y" else ax.get_xlim()
    if lo > 0 and hi / lo < 30:
        target.set_minor_locator(LogLocator(base=10, subs=(2.0, 5.0)))
        target.set_minor_formatter(FuncFormatter(fmt_seconds))
    else:
        target.set_minor_formatter(NullFormatter())


def _finish(fig, ax_or_axes, title: str, subtitle: str | None = None) -> None:
    fig.suptitle(title, fontsize=13, fontweight="bold")
    axes = ax_or_axes if isinstance(ax_or_axes, (list, tuple)) else [ax_or_axes]
    for ax in axes:
        ax.grid(True, which="major", alpha=0.35)
        ax.grid(True, which="minor", alpha=0.12)
    if subtitle:
        fig.text(0.5, 0.005, subtitle, ha="center", va="bottom", fontsize=8, color="dimgray", wrap=True)
    fig.tight_layout(rect=(0, 0.04 if subtitle else 0, 1, 0.97))


def _label(name: str, curves: dict[str, dict], key: str | None) -> str:
    curve = curves.get(key) if key else None
    if curve and curve.get("slope") is not None:
        return f"{name}  ({curve['class']}, slope {curve['slope']:.2f})"
    return name


def _machine(report: dict) -> str:
    m = report.get("machine", {})
    return f"{m.get('cpus', '?')} cpus, {m.get('platform', '')}, Python {m.get('python', '')}".strip()


def _series(rows: list[dict], xkey: str, ykey: str = "median_s", where=None) -> dict[str, tuple[list, list]]:
    """name -> (xs, ys) sorted by x, from rows with ``xkey`` in params (and ``where(row)``)."""
    out: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for row in rows:
        x = row.get("params", {}).get(xkey)
        y = row.get(ykey)
        if x is None or y is None or (where is not None and not where(row)):
            continue
        out[row["name"]].append((x, y))
    return {name: ([p[0] for p in sorted(pts)], [p[1] for p in sorted(pts)]) for name, pts in out.items()}


def _order(names, preferred: tuple[str, ...] = ()) -> list[str]:
    first = [n for n in preferred if n in names]
    return first + sorted(n for n in names if n not in first)


# -- suites ------------------------------------------------------------------------------------------

def _latency_vs_size(plt, report: dict, series: dict, title: str, curves: dict | None = None,
                     curve_prefix: str | None = None, marks: list[tuple[float, str]] = ()) -> Any:
    fig, ax = plt.subplots(figsize=FIGSIZE)
    preferred = ("memcpy", "bare_rtt")
    for name in _order(series, preferred):
        xs, ys = series[name]
        key = f"{curve_prefix}.{name}" if curve_prefix else None
        ax.plot(xs, ys, label=_label(name, curves or {}, key), **_style(name))
    _log_bytes_axis(ax, "x")
    _log_seconds_axis(ax, "y")
    bottom = ax.get_ylim()[0]
    for x, text in marks:
        ax.axvline(x, color=MARK_COLOR, linestyle="-.", linewidth=1.2, alpha=0.8)
        ax.text(x, bottom * 1.3, " " + text, rotation=90, va="bottom", ha="right", fontsize=8, color=MARK_COLOR,
                bbox={"facecolor": "white", "alpha": 0.75, "edgecolor": "none", "pad": 1})
    ax.set_xlabel("payload size (bytes, log scale)")
    ax.set_ylabel("median latency per handoff (log scale)")
    ax.legend(fontsize=8, loc="upper left", framealpha=0.9)
    _finish(fig, ax, title, "dashed: memcpy floor (np.copyto, one process); dotted: bare gRPC round trip. "
            + _machine(report))
    return fig


def plot_transport(plt, report: dict) -> dict[str, Any]:
    rows = [r for r in report["rows"] if "nbytes" in r.get("params", {}) and "size" in r.get("params", {})]
    series = _series(rows, "nbytes")
    if not series:
        return plot_generic(plt, report)
    return {"latency_vs_size": _latency_vs_size(
        plt, report, series, "transport: one handoff between two processes, latency vs payload size")}


def plot_scale(plt, report: dict) -> dict[str, Any]:
    rows, curves = report["rows"], report.get("curves", {})
    figs: dict[str, Any] = {}

    def of(curve: str) -> list[dict]:
        return [r for r in rows if r.get("curve") == curve]

    size_rows = of("latency_vs_size")
    if size_rows:
        marks = []
        ratios = report.get("ratios", {})
        for key, text in (("inline_crossover_nbytes_standalone", "inline crossover (standalone)"),
                          ("inline_crossover_nbytes_marginal", "inline crossover (marginal)")):
            if key in ratios:
                marks.append((ratios[key], f"{text}: {fmt_bytes(ratios[key])}"))
        sizes = sorted({r["params"]["nbytes"] for r in size_rows})
        figs["latency_vs_size"] = _latency_vs_size(
            plt, report, _series(size_rows, "nbytes"),
            f"scale: handoff latency vs payload size ({fmt_bytes(sizes[0])} - {fmt_bytes(sizes[-1])})",
            curves, "latency_vs_size", marks)

    pair_rows = of("throughput_vs_pairs")
    if pair_rows:
        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 5.6))
        for name, (xs, ys) in _series(pair_rows, "pairs", "lifecycles_per_s").items():
            ax1.plot(xs, ys, label=_label(name, curves, f"throughput_vs_pairs.{name}"), **_style(name))
        for name, (xs, ys) in _series(pair_rows, "pairs", "gbps").items():
            ax2.plot(xs, ys, label=name, **_style(name))
        shape = pair_rows[0]["params"]
        for ax, ylabel in ((ax1, "request lifecycles per second (all pairs)"), (ax2, "payload GB/s (all pairs)")):
            ax.set_xscale("log", base=2)
            ax.set_xticks(sorted({r["params"]["pairs"] for r in pair_rows}))
            ax.get_xaxis().set_major_formatter(_formatter(lambda v, _p: f"{v:g}"))
            ax.set_xlabel("concurrent producer/consumer process pairs")
            ax.set_ylabel(ylabel)
            ax.set_ylim(bottom=0)
            ax.legend(fontsize=8)
        _finish(fig, [ax1, ax2], f"scale: throughput vs concurrent pairs "
                f"({shape.get('tensors')} x {fmt_bytes(shape.get('nbytes', 0))} per request)",
                "each pair = 2 processes; lifecycles_shm: put_many -> acquire_many -> digest check -> release; "
                "lifecycles_grpc_inline: the bytes inline in one unary call. " + _machine(report))
        figs["throughput_vs_pairs"] = fig

    alloc_rows = of("alloc_vs_occupancy")
    if alloc_rows:
        fig, axes = plt.subplots(1, 3, figsize=(15, 5.4))
        ax1, ax2, ax3 = axes
        for name in _order({r["name"] for r in alloc_rows}, ("allocator_alloc",)):
            sel = [r for r in alloc_rows if r["name"] == name]
            xs = [r["params"]["occupancy_pct"] for r in sel]
            label = "allocator in-process" if name == "allocator_alloc" else "Loan RPC via the client (daemon)"
            marker = "o" if name == "allocator_alloc" else "s"
            line = ax1.plot(xs, [r["median_s"] for r in sel], marker=marker, label=f"{label}: median")[0]
            ax1.plot(xs, [r["p99_s"] for r in sel], marker=marker, linestyle="--", color=line.get_color(),
                     alpha=0.6, label=f"{label}: p99")
            ax2.plot(xs, [100 * r.get("failure_rate", 0) for r in sel], marker=marker, label=label)
            ax3.plot(xs, [r.get("largest_free_over_free") or 0 for r in sel], marker=marker, label=label)
        _log_seconds_axis(ax1, "y")
        ax1.set_ylabel("allocation latency (log scale)")
        ax2.set_ylabel("probe allocations that failed (%)")
        ax3.set_ylabel("largest free extent / free bytes")
        ax2.set_ylim(bottom=0)
        ax3.set_ylim(0, 1.05)
        for ax in axes:
            ax.set_xlabel("arena occupancy (%)")
            ax.legend(fontsize=8)
        _finish(fig, list(axes), "scale: allocation latency and failures vs arena occupancy",
                "sizes log-uniform 4 KiB - 16 MiB (daemon: 4 MiB), random alloc/free churn at each occupancy; "
                "each probe freed at once. " + _machine(report))
        figs["alloc_vs_occupancy"] = fig

    lease_rows = of("daemon_vs_leases")
    if lease_rows:
        fig, axes = plt.subplots(2, 2, figsize=(12, 8.4))
        life = [r for r in lease_rows if r["name"].startswith("leases_lifecycle")]
        stat = [r for r in lease_rows if r["name"].startswith("leases_stat")]
        panels = (
            (axes[0][0], life, lambda r: r["median_s"], lambda r: r["p99_s"], "4 KiB put -> acquire -> release",
             "daemon_vs_leases.lifecycle", True),
            (axes[0][1], stat, lambda r: r["median_s"], lambda r: r["p99_s"], "Stat RPC", "daemon_vs_leases.stat",
             True),
            (axes[1][0], life, lambda r: r.get("daemon_rss_mb"), None, "daemon RSS (MB)",
             "daemon_vs_leases.daemon_rss", False),
            (axes[1][1], life, lambda r: r.get("daemon_cpu_us_per_lifecycle"), None,
             "daemon CPU per lifecycle (µs)", "daemon_vs_leases.daemon_cpu_per_lifecycle", False),
        )
        for ax, sel, ymed, yp99, ylabel, key, _seconds in panels:
            xs = [r["params"]["leases"] for r in sel]
            ax.plot(xs, [ymed(r) for r in sel], marker="o", linewidth=2, label=_label("median" if yp99 else
                                                                                      ylabel, curves, key))
            if yp99:
                ax.plot(xs, [yp99(r) for r in sel], marker=".", linestyle="--", alpha=0.6, label="p99")
                _log_seconds_axis(ax, "y")
                ax.set_ylabel(f"{ylabel} latency (log scale)")
            else:
                ax.set_ylabel(ylabel)
                values = [ymed(r) for r in sel if ymed(r) is not None]
                ax.set_ylim(0, max(values, default=1) * 1.2)  # headroom above the line for the legend
            ax.set_xscale("log")
            ax.get_xaxis().set_major_formatter(_formatter(fmt_count))
            ax.set_xlabel("live objects held, one lease each")
            ax.legend(fontsize=8)
        _finish(fig, [a for row in axes for a in row], "scale: daemon cost vs number of live leases",
                "one client holds N objects and another N leases; a third pair runs the measured calls. "
                + _machine(report))
        figs["daemon_vs_leases"] = fig

    kernel_rows = of("kernels_vs_size")
    if kernel_rows:
        fig, ax = plt.subplots(figsize=FIGSIZE)
        series = _series(kernel_rows, "nbytes", "gbps")
        for name in _order(series, ("memcpy_numpy_copyto",)):
            xs, ys = series[name]
            ax.plot(xs, ys, label=_label(name, curves, f"kernels_vs_size.{name}"), **_style(name))
        _log_bytes_axis(ax, "x")
        ax.set_ylim(bottom=0)
        ax.set_xlabel("buffer size (bytes, log scale)")
        ax.set_ylabel("throughput (GB/s, median)")
        ax.legend(fontsize=8)
        _finish(fig, ax, "scale: C kernels' throughput vs size",
                "dashed: np.copyto into a pre-faulted buffer (the memcpy floor); slopes are of time vs size. "
                + _machine(report))
        figs["kernels_vs_size"] = fig

    mask_rows = of("masks_vs_bits")
    if mask_rows:
        fig, ax = plt.subplots(figsize=FIGSIZE)
        series = _series(mask_rows, "nbits")
        for name in _order(series):
            xs, ys = series[name]
            style = {"linestyle": "--", "marker": "."} if name.endswith("numpy") else {"marker": "o", "linewidth": 2}
            ax.plot(xs, ys, label=_label(name, curves, f"masks_vs_bits.{name}"), **style)
        _log_bytes_axis(ax, "x", fmt_bits)
        _log_seconds_axis(ax, "y")
        ax.set_xlabel("mask length (bits, log scale)")
        ax.set_ylabel("median time per call (log scale)")
        ax.legend(fontsize=8)
        _finish(fig, ax, "scale: is_embed mask kernels vs number of bits",
                "~30 % set, in runs; dashed: the numpy idiom the C kernel replaces. " + _machine(report))
        figs["masks_vs_bits"] = fig
    return figs


def _formatter(fn):
    from matplotlib.ticker import FuncFormatter

    return FuncFormatter(fn)


def plot_kernels(plt, report: dict) -> dict[str, Any]:
    figs: dict[str, Any] = {}
    rows = [r for r in report["rows"] if r.get("gbps") is not None]
    if rows:
        labels = []
        for r in rows:
            extra = {k: v for k, v in r["params"].items() if k not in ("nbytes", "size", "nbytes_per_thread")}
            size = r["params"].get("nbytes") or r["params"].get("nbytes_per_thread")
            tag = ", ".join(f"{k}={v}" for k, v in extra.items())
            labels.append(f"{r['name']}" + (f" ({tag})" if tag else "") + (f" @ {fmt_bytes(size)}" if size else ""))
        fig, ax = plt.subplots(figsize=(11, 0.34 * len(rows) + 1.8))
        colors = ["black" if r["name"] in FLOORS else ("tab:gray" if any(p in r["name"] for p in PEER_MARKERS)
                                                        else "tab:blue") for r in rows]
        ypos = list(range(len(rows)))[::-1]
        ax.barh(ypos, [r["gbps"] for r in rows], color=colors)
        for y, r in zip(ypos, rows):
            ax.text(r["gbps"], y, f" {r['gbps']:.1f}", va="center", fontsize=8)
        floor = next((r["gbps"] for r in rows if r["name"] in FLOORS), None)
        if floor:
            ax.axvline(floor, color="black", linestyle="--", linewidth=1.2, label=f"memcpy floor {floor:.1f} GB/s")
            ax.legend(fontsize=8, loc="lower right")
        ax.set_yticks(ypos)
        ax.set_yticklabels(labels, fontsize=8)
        ax.set_xlabel("throughput (GB/s, median; higher is better)")
        _finish(fig, ax, "kernels: GB/s per candidate",
                "blue: our C kernels; gray: peers; black: np.copyto (memcpy floor). " + _machine(report))
        figs["gbps"] = fig
    masks = defaultdict(dict)
    for r in report["rows"]:
        name = r["name"]
        if name.startswith("mask_") and name.endswith(("_c", "_numpy")):
            kernel, _, impl = name[5:].rpartition("_")
            masks[kernel][impl] = r["median_s"]
    if masks:
        kernels = [k for k in masks if {"c", "numpy"} <= set(masks[k])]
        fig, ax = plt.subplots(figsize=FIGSIZE)
        width = 0.38
        xs = list(range(len(kernels)))
        ax.bar([x - width / 2 for x in xs], [masks[k]["c"] for k in kernels], width, label="C kernel", color="tab:blue")
        ax.bar([x + width / 2 for x in xs], [masks[k]["numpy"] for k in kernels], width, label="numpy idiom",
               color="tab:gray")
        for x, k in zip(xs, kernels):
            ax.text(x, max(masks[k].values()) * 1.15, f"{masks[k]['numpy'] / masks[k]['c']:.1f}x", ha="center",
                    fontsize=9, fontweight="bold")
        nbits = next((r["params"].get("nbits") for r in report["rows"] if r["name"].startswith("mask_")), None)
        ax.set_xticks(xs)
        ax.set_xticklabels(kernels)
        _log_seconds_axis(ax, "y")
        ax.set_ylim(top=max(max(masks[k].values()) for k in kernels) * 3)  # room for the speedup labels
        ax.set_ylabel("median time per call (log scale; lower is better)")
        ax.set_xlabel("mask kernel" + (f" ({nbits:,} bits)" if nbits else ""))
        ax.legend(fontsize=9)
        _finish(fig, ax, "kernels: is_embed mask kernels, C vs numpy (speedup above each pair)", _machine(report))
        figs["masks"] = fig
    return figs


def _bars_by_kind(plt, rows: list, colors: dict, ylabel: str, title: str, note: str):
    """Grouped bars: one group per request kind, one bar per path (median, log scale)."""
    kinds = list(dict.fromkeys(r["params"]["kind"] for r in rows))
    paths = list(dict.fromkeys(r["params"]["path"] for r in rows))
    value = {(r["params"]["kind"], r["params"]["path"]): r["median_s"] for r in rows}
    nbytes = {r["params"]["kind"]: r["params"].get("nbytes") for r in rows}
    fig, ax = plt.subplots(figsize=(12, 6.2))
    width = 0.8 / len(paths)
    for j, path in enumerate(paths):
        xs = [i - 0.4 + width * (j + 0.5) for i in range(len(kinds))]
        ys = [value.get((k, path)) for k in kinds]
        ax.bar([x for x, y in zip(xs, ys) if y], [y for y in ys if y], width, label=path, color=colors.get(path))
    ax.set_xticks(range(len(kinds)))
    ax.set_xticklabels([f"{k}\n({fmt_bytes(nbytes[k])})" if nbytes.get(k) else k for k in kinds])
    _log_seconds_axis(ax, "y")
    ax.set_ylabel(ylabel)
    ax.set_xlabel("request kind (tensor bytes per request)")
    ax.legend(fontsize=9, title="path")
    _finish(fig, ax, title, note)
    return fig


def plot_pipeline(plt, report: dict) -> dict[str, Any]:
    rows = [r for r in report["rows"] if r["name"] == "handoff"]
    if not rows:
        return plot_generic(plt, report)
    colors = {"inline": "tab:gray", "segment_pread": "tab:orange", "shm": "tab:blue", "shm_loan": "tab:green",
              "shm_noverify": "tab:cyan"}
    return {"handoff": _bars_by_kind(
        plt, rows, colors, "median handoff: frontend done -> worker has the tensors (log scale)",
        "pipeline: frontend -> worker handoff per request kind",
        "inline: tensors in the gRPC request; segment_pread: a /dev/shm file per tensor; shm: put; shm_loan: "
        "the renderer writes into a loan. " + _machine(report))}


def plot_engine(plt, report: dict) -> dict[str, Any]:
    colors = {"ours": "tab:green", "stock-shm": "tab:orange", "stock-inline": "tab:gray",
              "vllm-direct": "tab:blue", "vllm-shm-cache": "tab:purple", "vllm-torch-shm": "tab:cyan"}
    what = {"first_token": "new pixels (vLLM runs its vision encoder)",
            "first_token_repeat": "repeated pixels (vLLM's encoder cache answers: transport + text prefill)"}
    figs = {}
    for name, label in what.items():
        for tp in sorted({r["params"].get("tp", 1) for r in report["rows"] if r["name"] == name}):
            rows = [r for r in report["rows"] if r["name"] == name and r["params"].get("tp", 1) == tp]
            figs[name if tp == 1 else f"{name}_tp{tp}"] = _bars_by_kind(
                plt, rows, colors, "median: renderer output -> first token (log scale)",
                f"engine (TP={tp}): vLLM's real engine, {label}",
                "ours: shmtransport vllm-worker, handles all the way to the model; vllm-direct / vllm-shm-cache / "
                "vllm-torch-shm: vLLM's default path, --mm-processor-cache-type shm, --mm-tensor-ipc torch_shm, "
                "each fed the same views; stock-shm / stock-inline: vLLM's stock gRPC server (SMG servicer) with "
                "ShmHandles / inline bytes. " + _machine(report))
    return figs or plot_generic(plt, report)


def plot_remote(plt, report: dict) -> dict[str, Any]:
    series = _series(report["rows"], "nbytes")
    if not series:
        return plot_generic(plt, report)
    fig, ax = plt.subplots(figsize=FIGSIZE)
    for name in _order(series):
        xs, ys = series[name]
        ax.plot(xs, ys, label=name, **_style(name))
    _log_bytes_axis(ax, "x")
    _log_seconds_axis(ax, "y")
    ax.set_xlabel("tensor size (bytes, log scale)")
    ax.set_ylabel("median latency per read (log scale)")
    ax.legend(fontsize=9)
    _finish(fig, ax, "remote: NIXL read of a remote arena vs inline gRPC bytes over TCP", _machine(report))
    return {"latency_vs_size": fig}


def plot_generic(plt, report: dict) -> dict[str, Any]:
    rows = report["rows"]
    series = _series(rows, "nbytes")
    if series and any(len(xs) > 1 for xs, _ in series.values()):
        return {"latency_vs_size": _latency_vs_size(plt, report, series, f"{report['suite']}: latency vs size")}
    labels = [r["name"] + "".join(f" {k}={v}" for k, v in r.get("params", {}).items()) for r in rows]
    fig, ax = plt.subplots(figsize=(11, 0.32 * len(rows) + 1.8))
    ypos = list(range(len(rows)))[::-1]
    ax.barh(ypos, [r["median_s"] for r in rows], color=["tab:blue" if r.get("correct") else "tab:red" for r in rows])
    ax.set_yticks(ypos)
    ax.set_yticklabels(labels, fontsize=8)
    ax.set_xscale("log")
    ax.get_xaxis().set_major_formatter(_formatter(fmt_seconds))
    ax.set_xlabel("median time (log scale)")
    _finish(fig, ax, f"{report['suite']}: median per row", _machine(report))
    return {"rows": fig}


PLOTTERS = {"transport": plot_transport, "scale": plot_scale, "kernels": plot_kernels, "pipeline": plot_pipeline,
            "remote": plot_remote, "engine": plot_engine}


def write_plots(report_json: dict, out_dir: pathlib.Path) -> list[pathlib.Path]:
    """Write ``<suite>_<curve>.png`` files for one report into ``out_dir``; returns their paths.
    Raises ImportError when matplotlib is missing."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir = pathlib.Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    suite = report_json.get("suite", "report")
    figs = PLOTTERS.get(suite, plot_generic)(plt, report_json)
    written = []
    for curve, fig in figs.items():
        path = out_dir / f"{suite}_{curve}.png"
        fig.savefig(path, dpi=DPI)
        plt.close(fig)
        written.append(path)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("reports", nargs="+", type=pathlib.Path, help="report JSON files (run.py --json)")
    parser.add_argument("--out", type=pathlib.Path, help="directory for the PNGs (default: next to each JSON)")
    args = parser.parse_args(argv)
    for path in args.reports:
        report = json.loads(path.read_text())
        for png in write_plots(report, args.out or path.parent):
            print(f"wrote {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
