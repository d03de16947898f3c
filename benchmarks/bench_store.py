"""Raw run store throughput: memory vs SQLite, 1 run and 100 concurrent runs.

A simulated step writes what the loop writes (docs/crash-safety.md, "The write protocol"):
model intent (barrier), model result, action intent (barrier), action result + step record
(one atomic write); 5 records, 2 barriers. Each run takes its lease first and writes with its
generation. SQLite runs in WAL mode with synchronous=FULL. Targets: >= 1,500 durable steps/s
for 1 run, >= 6,000 steps/s for 100 concurrent runs.

    python benchmarks/bench_store.py [--steps 3000] [--runs 100] [--run-steps 100]
"""

from __future__ import annotations

import argparse
import contextlib
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AbstractAsyncContextManager
from pathlib import Path

import attrs
import trio
from rich.console import Console
from rich.table import Table

from _args import at_least
from treadle.ports import RunStore
from treadle.stores import MemoryStore, SqliteStore, open_sqlite_store
from treadle.testing.contracts import lease_generation
from treadle.types import (
    ActionIntent,
    ActionOutcome,
    ActionResult,
    ActionStatus,
    DecisionKind,
    ModelIntent,
    ModelReply,
    ModelResult,
    RunStarted,
    StepRecord,
    ToolCall,
    Usage,
)

TS = "2025-01-01T00:00:00.000000+00:00"
RECORDS_PER_STEP = 5


@attrs.frozen(kw_only=True)
class Result:
    store: str
    runs: int
    steps: int
    wall_s: float
    cpu_s: float
    commits: int | None
    max_batch: int | None

    @property
    def steps_per_s(self) -> float:
        return self.steps / self.wall_s

    @property
    def records_per_s(self) -> float:
        return self.steps * RECORDS_PER_STEP / self.wall_s

    @property
    def cpu_us_per_step(self) -> float:
        return self.cpu_s / self.steps * 1e6


async def write_run(store: RunStore, run_id: str, steps: int) -> None:
    gen = await lease_generation(store, run_id)
    started = RunStarted(run_id=run_id, ts=TS, input=(), snapshot={"model": "m"})
    await store.write_run_started(started, seq=1, generation=gen)
    seq = 2
    for step in range(1, steps + 1):
        await write_step(store, run_id, step, seq, gen)
        seq += RECORDS_PER_STEP


async def write_step(store: RunStore, run_id: str, step: int, seq: int, gen: int) -> None:
    mid, aid, call = f"{run_id}/m{step}", f"{run_id}/a{step}", f"call_{step}"
    await store.write_intent(
        ModelIntent(run_id=run_id, step=step, intent_id=mid, attempt=1, ts=TS),
        seq=seq,
        generation=gen,
    )
    reply = ModelReply(
        tool_calls=(ToolCall(id=call, name="noop", arguments={"n": step}),),
        finish_reason="tool_calls",
        usage=Usage(input_tokens=120, output_tokens=12),
    )
    await store.write_model_result(
        ModelResult(run_id=run_id, step=step, intent_id=mid, ts=TS, reply=reply, latency_s=0.0),
        seq=seq + 1,
        generation=gen,
    )
    await store.write_intent(
        ActionIntent(
            run_id=run_id,
            step=step,
            intent_id=aid,
            call_id=call,
            tool="noop",
            arguments={"n": step},
            ts=TS,
        ),
        seq=seq + 2,
        generation=gen,
    )
    outcome = ActionOutcome(status=ActionStatus.EXECUTED, observation="ok")
    result = ActionResult(
        run_id=run_id, step=step, intent_id=aid, call_id=call, tool="noop", outcome=outcome, ts=TS
    )
    record = StepRecord(
        run_id=run_id,
        step=step,
        ts=TS,
        model_intent_id=mid,
        decision=DecisionKind.ACTIONS,
        observations=("ok",),
        action_result_ids=(aid,),
    )
    await store.write_step([result], record, seq=seq + 3, generation=gen)


@contextlib.asynccontextmanager
async def open_memory() -> AsyncIterator[RunStore]:
    store = MemoryStore()
    try:
        yield store
    finally:
        await store.aclose()


def sqlite_opener(directory: Path) -> Callable[[], AbstractAsyncContextManager[SqliteStore]]:
    counter = iter(range(1_000_000))
    return lambda: open_sqlite_store(directory / f"bench-{next(counter)}.db")


async def measure(
    name: str, opener: Callable[[], AbstractAsyncContextManager[RunStore]], runs: int, steps: int
) -> Result:
    async with opener() as store:
        wall, cpu = time.perf_counter(), time.process_time()
        async with trio.open_nursery() as nursery:
            for n in range(runs):
                nursery.start_soon(write_run, store, f"run-{n:04}", steps)
        await store.list_runs()  # the last non-barrier writes are committed too
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        stats = store.statistics() if isinstance(store, SqliteStore) else None
    return Result(
        store=name,
        runs=runs,
        steps=runs * steps,
        wall_s=wall,
        cpu_s=cpu,
        commits=stats.commits if stats else None,
        max_batch=stats.max_batch if stats else None,
    )


def render(results: list[Result]) -> Table:
    table = Table(title="run store throughput (step = 2 barriers + 2 non-barrier writes)")
    for column in ("store", "runs", "steps", "seconds", "steps/s", "records/s", "CPU µs/step"):
        table.add_column(column, justify="right" if column != "store" else "left")
    table.add_column("commits", justify="right")
    table.add_column("steps/commit", justify="right")
    table.add_column("max batch", justify="right")
    for r in results:
        per_commit = f"{r.steps / r.commits:.1f}" if r.commits else "-"
        table.add_row(
            r.store,
            str(r.runs),
            str(r.steps),
            f"{r.wall_s:.2f}",
            f"{r.steps_per_s:,.0f}",
            f"{r.records_per_s:,.0f}",
            f"{r.cpu_us_per_step:,.0f}",
            "-" if r.commits is None else f"{r.commits:,}",
            per_commit,
            "-" if r.max_batch is None else str(r.max_batch),
        )
    return table


async def measure_all(args: argparse.Namespace) -> None:
    results = []
    with tempfile.TemporaryDirectory(prefix="treadle-bench-") as tmp:
        stores = [("memory", open_memory), ("sqlite FULL", sqlite_opener(Path(tmp)))]
        for name, opener in stores:
            results.append(await measure(name, opener, 1, args.steps))
            results.append(await measure(name, opener, args.runs, args.run_steps))
    Console(width=150).print(render(results))


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=at_least(1), default=3000, help="steps of the single run")
    parser.add_argument("--runs", type=at_least(1), default=100, help="concurrent runs")
    parser.add_argument(
        "--run-steps", type=at_least(1), default=100, help="steps of each of those runs"
    )
    trio.run(measure_all, parser.parse_args(argv))


if __name__ == "__main__":
    main()
