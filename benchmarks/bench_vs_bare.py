"""treadle per durable step beside a bare loop that makes the same two commits per step.

Workload (benchmarks/_workload.py): an instant model, a no-op tool; a step is one model call
plus one tool call. treadle runs it on SQLite (WAL, ``synchronous=FULL``), on JSONL and on the
memory store. The reference is the few lines of plain Python and ``sqlite3`` in `bare_loop`:
per step, an intent row and a commit, then a result row and a commit, on the same pragmas
(WAL, ``synchronous=FULL``). With C runs at once it is C such loops, each on its own
connection in its own thread (no commit covers another run's rows); treadle's group commit
is what may beat it there. Both are measured in one process run, interleaved, medians of
``--repeat``; CPU is the process's (all threads). Targets (issue "the runtime's insides ...
three to eight times faster per step"): SQLite C=1 >= 0.8x the bare loop, C=100 >= 2.5x;
memory-store CPU <= 250 µs per step. Run with:

    python benchmarks/bench_vs_bare.py [--steps 200] [--runs 100] [--repeat 3]
"""

from __future__ import annotations

import argparse
import os
import sqlite3
import statistics
import tempfile
import threading
import time
from collections.abc import Callable, Sequence

import trio
from rich.console import Console
from rich.table import Table

import treadle
from _args import at_least
from _workload import Timing, load_note, timed


def bare_loop(path: str, runs: int, steps: int) -> Timing:
    """``runs`` runs of ``steps`` steps as plain sqlite3: two FULL commits per step.

    Each run is its own loop on its own connection in its own thread, as independent loops
    are written without a framework: no commit covers another run's rows.
    """
    setup = sqlite3.connect(path, isolation_level=None)
    setup.execute("PRAGMA journal_mode = WAL")
    setup.execute("CREATE TABLE IF NOT EXISTS log (run TEXT, seq INTEGER, body TEXT)")
    setup.close()
    start = threading.Barrier(runs + 1)

    def one_run(run: str) -> None:
        conn = sqlite3.connect(path, isolation_level=None, timeout=60)
        conn.execute("PRAGMA synchronous = FULL")
        start.wait()
        for step in range(steps):
            conn.execute("INSERT INTO log VALUES (?, ?, ?)", (run, 2 * step, '{"intent":"noop"}'))
            # (autocommit: the insert is its own transaction, committed with an fsync)
            # the tool runs here, and does nothing
            conn.execute("INSERT INTO log VALUES (?, ?, ?)", (run, 2 * step + 1, '{"result":"ok"}'))
        conn.close()

    threads = [threading.Thread(target=one_run, args=(f"r{i}",)) for i in range(runs)]
    for thread in threads:
        thread.start()
    start.wait()
    wall0, cpu0 = time.perf_counter(), time.process_time()
    for thread in threads:
        thread.join()
    wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
    return Timing(runs * steps, wall, cpu, commits=2 * runs * steps)


async def _treadle(kind: str, path: str, runs: int, steps: int) -> Timing:
    if kind == "memory":
        return await timed(treadle.MemoryStore(), runs, steps)
    opener = treadle.open_sqlite_store if kind == "sqlite" else treadle.open_jsonl_store
    async with opener(path) as store:
        return await timed(store, runs, steps)


def measure(kind: str, runs: int, steps: int) -> Timing:
    """One timing of ``kind`` (``bare``, ``sqlite``, ``jsonl`` or ``memory``) in a fresh dir."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "bench.db" if kind != "jsonl" else "runs")
        if kind == "bare":
            return bare_loop(path, runs, steps)
        return trio.run(_treadle, kind, path, runs, steps)


def _median(timings: Sequence[Timing], value: Callable[[Timing], float]) -> float:
    return statistics.median(value(t) for t in timings)


def main(argv: Sequence[str] | None = None) -> None:
    """Measure and print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=at_least(1), default=200, help="steps per run")
    parser.add_argument(
        "--runs", type=at_least(1), default=100, help="concurrent runs (the C=N rows)"
    )
    parser.add_argument("--repeat", type=at_least(1), default=3, help="measurements of each row")
    args = parser.parse_args(argv)
    kinds = ("bare", "sqlite", "jsonl", "memory")
    table = Table(title="per durable step: treadle beside a bare two-commit loop (medians)")
    for column in ("system", "C", "steps/s", "x bare", "CPU µs/step", "commits/step"):
        table.add_column(column, justify="right")
    for runs, steps in ((1, args.steps * 5), (args.runs, args.steps)):
        samples: dict[str, list[Timing]] = {kind: [] for kind in kinds}
        for _ in range(args.repeat):
            for kind in kinds:  # interleaved, so a busy moment hits every row alike
                samples[kind].append(measure(kind, runs, steps))
        bare = _median(samples["bare"], lambda t: t.steps_per_s)
        for kind in kinds:
            rate = _median(samples[kind], lambda t: t.steps_per_s)
            commits = [t.commits_per_step for t in samples[kind] if t.commits_per_step is not None]
            table.add_row(
                "bare loop (sqlite3)" if kind == "bare" else f"treadle, {kind}",
                str(runs),
                f"{rate:,.0f}",
                f"{rate / bare:.2f}x",
                f"{_median(samples[kind], lambda t: t.cpu_us_per_step):,.0f}",
                f"{statistics.median(commits):.2f}" if commits else "",
            )
    console = Console()
    console.print(table)
    console.print(f"Machine: {load_note()}.")


if __name__ == "__main__":
    main()
