"""The one entry point for every performance claim.

    python benchmarks/run.py SUITE [--quick] [--json PATH]

Each suite is a module ``benchmarks/suites/<name>.py`` with ``run(quick: bool) -> Report``. With
``--json`` the report's plots (``benchmarks/plots.py``) are written next to it as ``<suite>_<curve>.png``.
"""
from __future__ import annotations

import argparse
import importlib
import json
import pathlib
import sys
import traceback

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from harness import print_report


def available_suites() -> list[str]:
    return sorted(p.stem for p in (HERE / "suites").glob("*.py") if not p.stem.startswith("_"))


def _plots(data: dict, out_dir: pathlib.Path) -> None:
    """PNGs next to the JSON; a missing matplotlib (or a broken plot) is a note, not a failed run."""
    try:
        from plots import write_plots

        for path in write_plots(data, out_dir):
            print(f"wrote {path}")
    except ImportError as exc:
        print(f"note: no plots written ({exc}); install matplotlib (the dev extra) to get them")
    except Exception:  # noqa: BLE001 — the measurements are written; a plot must not fail the run
        print("note: plotting failed; the JSON is written:\n" + traceback.format_exc(limit=4))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("suite", choices=available_suites())
    parser.add_argument("--quick", action="store_true", help="same measurements, fewer repetitions (<60 s)")
    parser.add_argument("--json", type=pathlib.Path, help="write the report as JSON here")
    args = parser.parse_args(argv)

    suite = importlib.import_module(f"suites.{args.suite}")
    report = suite.run(quick=args.quick)
    print_report(report)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        data = report.to_json()
        args.json.write_text(json.dumps(data, indent=2, sort_keys=False) + "\n")
        print(f"wrote {args.json}")
        _plots(data, args.json.parent)
    return 0 if all(row["correct"] for row in report.rows) else 1


if __name__ == "__main__":
    sys.exit(main())
