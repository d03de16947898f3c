"""What a barrier costs in the commit engine alone, on each of its two paths.

A backend that commits nothing (no SQL, no file, no sync) under the real `CommitEngine`: one
task writes barriers one after another, so every figure is the engine's hand-off and nothing
else. "committer" hands each barrier to the committer thread and waits for trio's wake-up
(the path of a busy engine, and of PostgreSQL); "trio thread" commits it where it is, as an
idle engine does (docs/decisions/0093-commit-here-when-idle.md). A trio checkpoint is the
yardstick. Medians of ``--repeat``. Run with:

    python benchmarks/bench_handoff.py [--barriers 20000] [--repeat 3]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Sequence

import trio
from rich.console import Console
from rich.table import Table

from _args import at_least
from _workload import load_note
from treadle.stores._engine import ONE_SYNC, BatchReport, CommitEngine, RunHead, Write
from treadle.types import ActionIntent, Record


class NothingBackend:
    """Commits nothing, at once; ``commits_here`` picks the engine's path."""

    description = "a backend that commits nothing"

    def __init__(self, *, here: bool) -> None:
        self.commits_here = here

    def encode(self, run_id: str, seq: int, generation: int, records: tuple[Record, ...]) -> None:
        return None

    def size(self, payload: object) -> int:
        return 0

    def admit(self, run_id: str, generation: int) -> None:
        return None

    def load(self, run_id: str) -> RunHead:
        return RunHead(next_seq=1)

    def commit_here(self, batch: list[Write]) -> BatchReport | None:
        return ONE_SYNC if self.commits_here else None

    def commit(self, batch: list[Write]) -> BatchReport:
        return ONE_SYNC

    def finish(self) -> BatchReport:
        return ONE_SYNC


async def _barriers(here: bool, count: int) -> tuple[float, float]:
    """Wall and CPU µs per barrier."""
    engine = CommitEngine(NothingBackend(here=here), trio.lowlevel.current_trio_token())
    record = ActionIntent(
        run_id="r", step=1, intent_id="i", call_id="c", tool="t", arguments={}, ts="t"
    )
    try:
        await engine.append("r", 1, (record,), generation=0, barrier=True, closes=False)
        wall0, cpu0 = time.perf_counter(), time.process_time()
        for seq in range(2, count + 2):
            await engine.append("r", seq, (record,), generation=0, barrier=True, closes=False)
        wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
    finally:
        await engine.aclose()
    return wall / count * 1e6, cpu / count * 1e6


async def _checkpoints(count: int) -> tuple[float, float]:
    wall0, cpu0 = time.perf_counter(), time.process_time()
    for _ in range(count):
        await trio.lowlevel.checkpoint()
    wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
    return wall / count * 1e6, cpu / count * 1e6


def main(argv: Sequence[str] | None = None) -> None:
    """Measure and print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--barriers", type=at_least(1), default=20_000, help="barriers per measurement"
    )
    parser.add_argument("--repeat", type=at_least(1), default=3, help="measurements of each row")
    args = parser.parse_args(argv)
    rows: dict[str, list[tuple[float, float]]] = {"committer": [], "trio thread": [], "": []}
    for _ in range(args.repeat):  # interleaved, so a busy moment hits every row alike
        rows["committer"].append(trio.run(_barriers, False, args.barriers))
        rows["trio thread"].append(trio.run(_barriers, True, args.barriers))
        rows[""].append(trio.run(_checkpoints, args.barriers))
    table = Table(title="one barrier through the commit engine, a backend that commits nothing")
    for column in ("path", "wall µs", "CPU µs"):
        table.add_column(column, justify="right")
    for name, samples in rows.items():
        table.add_row(
            name or "(a trio checkpoint)",
            f"{statistics.median(s[0] for s in samples):.1f}",
            f"{statistics.median(s[1] for s in samples):.1f}",
        )
    console = Console()
    console.print(table)
    console.print(f"Machine: {load_note()}.")


if __name__ == "__main__":
    main()
