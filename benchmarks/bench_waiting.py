"""Memory per run while it awaits a human approval (issue on events and approvals).

Workload: ``--runs`` runs (default 10,000) in one process, each asks for approval of its
first tool call and waits. Runs start in waves of 500. Once every run is parked (its actors
stopped after ``park_after_s``, see docs/decisions/0010), the memory grown since before the
runs started is divided by the number of runs: the Python heap still allocated (tracemalloc,
one pass) and the resident set size (another pass, untraced). The same is done with parking
switched off, for comparison. Then every run is approved and finishes. The store is SQLite
(synchronous=FULL); the handle of each run stays in memory, as an application holding it would
keep it. Run with:

    python benchmarks/bench_waiting.py [--runs 10000] [--store sqlite|memory]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import time
import tracemalloc
from collections.abc import Sequence

import trio
from rich.console import Console
from rich.table import Table

import treadle
from _args import at_least
from _stores import open_store
from treadle.testing.scripted import ScriptedModel, call, say


@treadle.tool(requires_approval=True)
async def transfer(amount: int) -> str:
    """Move ``amount`` (waits for a human first)."""
    return "moved"


def rss_bytes() -> int:
    """The resident set size of this process now."""
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


async def measure(
    kind: str, runs: int, park_after_s: float | None, traced: bool
) -> tuple[float, float]:
    """Return (bytes per waiting run, seconds until all were waiting).

    Runs start in waves of `WAVE`, each wave waiting before the next starts, as runs that
    arrive over time would. ``traced`` measures the Python heap still allocated
    (tracemalloc), else the resident set size.
    """
    agent = treadle.Agent(
        model=ScriptedModel(turns=[call("transfer", amount=5, call_id="c1"), say("done")]),
        executor=treadle.Toolbox([transfer]),
        parser=treadle.NativeToolCallParser(),
    )
    handles: list[treadle.RunHandle] = []

    async def one(index: int, store: treadle.ports.RunStore) -> None:
        async with treadle.open_run(
            agent, "go", store=store, run_id=f"r{index}", park_after_s=park_after_s
        ) as handle:
            handles.append(handle)

    async with open_store(kind) as store:
        gc.collect()
        if traced:
            tracemalloc.start()
        before = _used(traced)
        began = time.perf_counter()
        async with trio.open_nursery() as nursery:
            for first in range(0, runs, WAVE):
                wave = range(first, min(runs, first + WAVE))
                for index in wave:
                    nursery.start_soon(one, index, store)
                while len(handles) < wave.stop:  # noqa: ASYNC110 (a plain list)
                    await trio.sleep(0.05)
                await _all_waiting(handles[first:], parked=park_after_s is not None)
            ready_s = time.perf_counter() - began
            await trio.sleep(2)  # the last wave's actors are told to stop when it parks
            gc.collect()
            per_run = (_used(traced) - before) / runs
            if traced:
                tracemalloc.stop()
            for handle in handles:
                handle.approve()
        assert all(h.result is not None for h in handles)
    return per_run, ready_s


WAVE = 500
"""Runs started before waiting for them all to wait."""


def _used(traced: bool) -> int:
    return tracemalloc.get_traced_memory()[0] if traced else rss_bytes()


async def _all_waiting(handles: list[treadle.RunHandle], *, parked: bool) -> None:
    """Wait until every handle awaits its approval (parked, when parking is on)."""
    while not all(  # noqa: ASYNC110 (polling plain properties of many handles)
        h.pending_approval is not None and (not parked or h._parking is not None) for h in handles
    ):
        await trio.sleep(0.1)


def main(argv: Sequence[str] | None = None) -> None:
    """Measure with and without parking (each pass in a fresh process) and print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=at_least(1), default=10_000, help="runs waiting at once")
    parser.add_argument("--store", choices=("sqlite", "memory"), default="sqlite")
    parser.add_argument("--pass", dest="one", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:  # one measurement, in this fresh process
        label, traced = args.one.split(",")
        park_after_s = PASSES[label]
        print(json.dumps(trio.run(measure, args.store, args.runs, park_after_s, traced == "1")))
        return
    table = Table(title=f"memory per run awaiting approval ({args.runs:,} runs, {args.store})")
    for column in ("waiting runs", "heap KiB/run", "RSS KiB/run", "all waiting after s"):
        table.add_column(column, justify="right")
    for label in PASSES:
        heap, ready_s = _pass(args, label, traced=True)
        rss, _ = _pass(args, label, traced=False)
        table.add_row(label, f"{heap / 1024:.1f}", f"{rss / 1024:.1f}", f"{ready_s:.1f}")
    Console().print(table)
    Console().print(
        "Target: <= 20 KB per waiting run. Runs park after 1 s here (default 5 s). Heap: "
        "Python memory still allocated (tracemalloc); RSS: resident set growth (untraced)."
    )


PASSES = {"parked": 1.0, "actors kept": None}
"""Label -> ``park_after_s`` of each pass."""


def _pass(args: argparse.Namespace, label: str, *, traced: bool) -> tuple[float, float]:
    command = [sys.executable, __file__, "--runs", str(args.runs), "--store", args.store]
    command += ["--pass", f"{label},{int(traced)}"]
    done = subprocess.run(command, capture_output=True, text=True, check=True)
    per_run, ready_s = json.loads(done.stdout.strip().splitlines()[-1])
    return float(per_run), float(ready_s)


if __name__ == "__main__":
    main()
