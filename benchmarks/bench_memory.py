"""Resident memory of 100 concurrent SQLite runs, above what importing treadle takes.

Each row runs in a fresh process: it imports treadle (and the benchmark's workload), then the
modules a run needs that ``import treadle`` leaves to first use (the stores, actors and
supervisors: their size is its own column), reads its resident set size (the baseline), runs
C runs of the instant workload at once on SQLite
(``synchronous=FULL``, benchmarks/_workload.py), and reads the peak resident set size
(Linux ``VmHWM``) and the size at the end. The reference is the bare two-commit loop of
benchmarks/bench_vs_bare.py in the same process setup (C threads, one connection each).
Target (issue "the runtime's insides ... three to eight times faster per step"): growth
above the post-import baseline <= 20 MB with 100 concurrent SQLite runs. Run with:

    python benchmarks/bench_memory.py [--runs 100] [--steps 200] [--repeat 3]
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import statistics
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from rich.console import Console
from rich.table import Table

from _args import at_least
from _workload import load_note

MB = 1024 * 1024


def _status_kib(field: str) -> int:
    """A ``/proc/self/status`` field in KiB (``VmRSS``, ``VmHWM``)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def child(kind: str, runs: int, steps: int) -> None:
    """In a fresh process: baseline, one measurement of ``kind``, peak; JSON on stdout."""
    import bench_vs_bare  # imports treadle, trio, sqlite3 and the workload

    gc.collect()
    imported = _status_kib("VmRSS")
    importlib.import_module("treadle.stores")  # what the first run would import
    importlib.import_module("treadle.supervisors")
    gc.collect()
    baseline = _status_kib("VmRSS")
    timing = bench_vs_bare.measure(kind, runs, steps)
    peak, end = _status_kib("VmHWM"), _status_kib("VmRSS")
    lazy = baseline - imported
    print(
        json.dumps(
            {"baseline": baseline, "lazy": lazy, "peak": peak, "end": end, "steps": timing.steps}
        )
    )


def _one(kind: str, runs: int, steps: int) -> dict[str, int]:
    here = Path(__file__).parent
    out = subprocess.run(
        [sys.executable, __file__, "--child", kind, "--runs", str(runs), "--steps", str(steps)],
        check=True,
        capture_output=True,
        text=True,
        cwd=here,
    ).stdout
    return json.loads(out.splitlines()[-1])  # type: ignore[no-any-return]


def main(argv: Sequence[str] | None = None) -> None:
    """Measure and print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=at_least(1), default=100, help="concurrent runs")
    parser.add_argument("--steps", type=at_least(1), default=200, help="steps per run")
    parser.add_argument("--repeat", type=at_least(1), default=3, help="processes per row")
    parser.add_argument("--child", choices=("bare", "sqlite", "jsonl", "memory"))
    args = parser.parse_args(argv)
    if args.child:
        child(args.child, args.runs, args.steps)
        return
    table = Table(title=f"resident memory, {args.runs} concurrent runs (medians)")
    columns = ("system", "C", "baseline MB", "imports MB", "peak growth MB", "end growth MB")
    for column in columns:
        table.add_column(column, justify="right")
    for kind in ("bare", "sqlite", "jsonl"):
        rows = [_one(kind, args.runs, args.steps) for _ in range(args.repeat)]

        def med(key: str, rows: list[dict[str, int]] = rows) -> float:
            return statistics.median(r[key] - r["baseline"] for r in rows) * 1024 / MB

        baseline = statistics.median(r["baseline"] for r in rows) * 1024 / MB
        table.add_row(
            "bare loop (sqlite3)" if kind == "bare" else f"treadle, {kind}",
            str(args.runs),
            f"{baseline:.1f}",
            f"{statistics.median(r['lazy'] for r in rows) * 1024 / MB:.1f}",
            f"{med('peak'):.1f}",
            f"{med('end'):.1f}",
        )
    console = Console()
    console.print(table)
    console.print(f"Machine: {load_note()}.")


if __name__ == "__main__":
    main()
