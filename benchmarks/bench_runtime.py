"""Durable steps per second and CPU per step of the whole runtime (docs/concepts.md, "Actors").

Workload (benchmarks/_workload.py): a model that answers instantly with one tool call per
step and a final answer at the end, and a tool that does nothing. A step is one model call
plus one tool call, with the full write protocol (two barriers per step). Run with:

    python benchmarks/bench_runtime.py [--steps 200] [--runs 100]

See also bench_postgres.py (PostgreSQL, beside DBOS), bench_fleet.py (worker processes) and
bench_stores_before_after.py (SQLite and JSONL before and after the store rewrite).
"""

from __future__ import annotations

import argparse
import os
import tempfile
from collections.abc import Sequence

import trio
from rich.console import Console
from rich.table import Table

import treadle
from _args import at_least
from _workload import timed


async def measure(kind: str, runs: int, steps: int) -> tuple[float, float, float]:
    """Return (steps/s, CPU µs/step, log bytes/step or nan)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "bench.db")
        if kind == "memory":
            timing = await timed(treadle.MemoryStore(), runs, steps)
            return timing.steps_per_s, timing.cpu_us_per_step, float("nan")
        async with treadle.open_sqlite_store(path) as store:
            timing = await timed(store, runs, steps)
        size = _dir_size(tmp)
        return timing.steps_per_s, timing.cpu_us_per_step, size / timing.steps


def _dir_size(path: str) -> int:
    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=at_least(1), default=200, help="steps per run")
    parser.add_argument("--runs", type=at_least(1), default=100, help="concurrent runs")
    args = parser.parse_args(argv)
    table = Table(title="treadle runtime: durable steps (model call + tool call)")
    for column in ("store", "runs", "steps/run", "steps/s", "CPU µs/step", "bytes/step*"):
        table.add_column(column, justify="right")
    for kind in ("memory", "sqlite"):
        for runs, steps in ((1, args.steps * 5), (args.runs, args.steps)):
            rate, cpu, size = trio.run(measure, kind, runs, steps)
            table.add_row(
                kind,
                str(runs),
                str(steps),
                f"{rate:,.0f}",
                f"{cpu:,.0f}",
                "" if size != size else f"{size:,.0f}",
            )
    Console().print(table)
    Console().print("* SQLite file size (db + WAL) divided by steps; SQLite synchronous=FULL.")


if __name__ == "__main__":
    main()
