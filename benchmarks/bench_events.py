"""Event delivery latency: a model delta produced -> a subscriber receives it (issue on events).

Workload: ``--runs`` concurrent runs (default 100), each of ``--steps`` steps (default 5).
Every model call streams ``--fragments`` text fragments (default 100), ``--interval`` apart on
average (default 10 ms, a fast provider's pace; each gap is drawn uniformly from half to one and
a half times that, with a fixed seed, so the runs are not in lockstep), then calls a tool. Each
run has one live subscriber (`RunHandle.events`) that timestamps every text delta on receipt;
one more subscriber on the first run is slow (it sleeps 20 ms per event) and is cut off when
its 256-event buffer overflows, without slowing anyone else (docs/events.md, "Sinks and
subscribers never stall a run").

Two rows:

- ``delivery``: fragments of 1 KiB, so the gateway's coalescer hands each one to the event
  writer at once; the figure is the runtime's own delivery latency (target p99 <= 5 ms).
- ``coalesced``: fragments of 40 characters, coalesced to about 30 ms by design; the figure
  includes that wait (measured from the first fragment of each delta).

Each fragment starts with the `time.perf_counter_ns` of its emission. A model call thus lasts
about a second, as real ones do; with much faster fake models (``--fragments 10``) the loop is
busy with the steps themselves (about 0.8 ms of CPU each) and the p99 grows to about 10 ms.
Run with:

    python benchmarks/bench_events.py [--runs 100] [--steps 5] [--fragments 100]
                                      [--interval 0.01] [--store memory|sqlite]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Sequence

import trio
from rich.console import Console
from rich.table import Table

import treadle
from _args import at_least, seconds
from _stores import open_store
from treadle.ports import DeltaCallback
from treadle.types import Attempt, EventKind, ModelReply, ModelRequest, ToolCall

STAMP = 20
"""Characters of the emission timestamp at the start of each fragment."""


class StreamingModel:
    """Streams ``fragments`` stamped fragments per call, then calls ``noop`` (or answers)."""

    def __init__(self, steps: int, fragments: int, size: int, interval_s: float) -> None:
        self.steps, self.fragments, self.size = steps, fragments, size
        self.interval_s = interval_s
        self.rng = random.Random(7)

    async def complete(
        self,
        request: ModelRequest,
        *,
        on_delta: DeltaCallback | None = None,
        attempt: Attempt = Attempt.STANDALONE,
    ) -> ModelReply:
        for _ in range(self.fragments):
            if on_delta is not None:
                on_delta("text", f"{time.perf_counter_ns():0{STAMP}d}".ljust(self.size, "."))
            await trio.sleep(self.interval_s * self.rng.uniform(0.5, 1.5))
        turn = (len(request.messages) - 1) // 2
        if turn >= self.steps - 1:
            return ModelReply(text="done", finish_reason="stop")
        call = ToolCall(id=f"c{turn}", name="noop", arguments={})
        return ModelReply(text="calling", tool_calls=(call,), finish_reason="tool_calls")


@treadle.tool(replay=treadle.ReplayPolicy.SAFE)
async def noop() -> str:
    """Do nothing."""
    return "ok"


async def listen(handle: treadle.RunHandle, size: int, latencies: list[float]) -> None:
    """Record, for each text delta, milliseconds since its first fragment was emitted."""
    async for event in handle.events():
        if event.kind is EventKind.TEXT_DELTA and event.text:
            now = time.perf_counter_ns()
            latencies.append((now - int(event.text[:STAMP])) / 1e6)


async def slow(handle: treadle.RunHandle) -> None:
    """A subscriber that takes 20 ms per event (it is cut off when it falls behind)."""
    async for _event in handle.events():
        await trio.sleep(0.02)


async def measure(
    kind: str, runs: int, steps: int, fragments: int, size: int, interval_s: float
) -> list[float]:
    """Drive the runs; return every delta's latency in milliseconds."""
    agent = treadle.Agent(
        model=StreamingModel(steps, fragments, size, interval_s),
        executor=treadle.Toolbox([noop]),
        parser=treadle.NativeToolCallParser(),
        budgets=treadle.Budgets(max_steps=steps + 1),
    )
    latencies: list[float] = []

    async def one(index: int, store: treadle.ports.RunStore) -> None:
        run = treadle.open_run(agent, "go", store=store, run_id=f"r{index}")
        async with run as handle, trio.open_nursery() as nursery:
            nursery.start_soon(listen, handle, size, latencies)
            if index == 0:
                nursery.start_soon(slow, handle)

    async with open_store(kind) as store, trio.open_nursery() as nursery:
        for index in range(runs):
            nursery.start_soon(one, index, store)
    return latencies


def p99(latencies: list[float]) -> float:
    """The 99th percentile of ``latencies`` (the one latency, when there is one)."""
    if len(latencies) == 1:
        return latencies[0]
    return statistics.quantiles(latencies, n=100)[98]


def main(argv: Sequence[str] | None = None) -> None:
    """Run both rows and print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=at_least(1), default=100, help="concurrent runs")
    parser.add_argument("--steps", type=at_least(1), default=5, help="steps per run")
    parser.add_argument(
        "--fragments", type=at_least(1), default=100, help="fragments per model call"
    )
    parser.add_argument(
        "--interval", type=seconds(), default=0.01, help="seconds between fragments"
    )
    parser.add_argument("--store", choices=("memory", "sqlite"), default="memory")
    args = parser.parse_args(argv)
    table = Table(title=f"event delivery: {args.runs} runs, one slow subscriber, {args.store}")
    for column in ("row", "fragment chars", "deltas", "median ms", "p99 ms", "max ms"):
        table.add_column(column, justify="right")
    for row, size in (("delivery", 1024), ("coalesced", 40)):
        latencies = trio.run(
            measure, args.store, args.runs, args.steps, args.fragments, size, args.interval
        )
        table.add_row(
            row,
            str(size),
            f"{len(latencies):,}",
            f"{statistics.median(latencies):.2f}",
            f"{p99(latencies):.2f}",
            f"{max(latencies):.2f}",
        )
    Console().print(table)


if __name__ == "__main__":
    main()
