"""Durable steps per second and CPU per step of the whole runtime (DESIGN §10).

Workload: a model that answers instantly with one tool call per step and a final answer at
the end, and a tool that does nothing. A step is one model call plus one tool call, with the
full write protocol (two barriers per step). Run with:

    python benchmarks/bench_runtime.py [--steps 200] [--runs 100]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from collections.abc import Sequence

import trio
from rich.console import Console
from rich.table import Table

import treadle
from treadle.ports import DeltaCallback
from treadle.types import ModelReply, ModelRequest, ToolCall


class InstantModel:
    """Calls ``noop`` until the run has ``steps`` steps, then answers."""

    def __init__(self, steps: int) -> None:
        self.steps = steps

    async def complete(
        self, request: ModelRequest, *, on_delta: DeltaCallback | None = None
    ) -> ModelReply:
        await trio.lowlevel.checkpoint()
        turn = (len(request.messages) - 1) // 2
        if turn >= self.steps - 1:
            return ModelReply(text="done", finish_reason="stop")
        call = ToolCall(id=f"c{turn}", name="noop", arguments={})
        return ModelReply(tool_calls=(call,), finish_reason="tool_calls")


@treadle.tool(replay=treadle.ReplayPolicy.SAFE)
async def noop() -> str:
    """Do nothing."""
    return "ok"


def make_agent(steps: int) -> treadle.Agent:
    return treadle.Agent(
        model=InstantModel(steps),
        executor=treadle.Toolbox([noop]),
        parser=treadle.NativeToolCallParser(),
        budgets=treadle.Budgets(max_steps=steps + 1, max_model_attempts=None),
    )


async def drive(store: treadle.ports.RunStore, runs: int, steps: int, tag: str) -> int:
    agent = make_agent(steps)
    async with trio.open_nursery() as nursery:
        for i in range(runs):
            nursery.start_soon(
                lambda i=i: treadle.run(agent, "go", store=store, run_id=f"{tag}-{i}")
            )
    return runs * steps


async def measure(kind: str, runs: int, steps: int) -> tuple[float, float, float]:
    """Return (steps/s, CPU µs/step, log bytes/step or nan)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "bench.db")
        if kind == "memory":
            store: treadle.ports.RunStore = treadle.MemoryStore()
            total, wall, cpu = await _timed(store, runs, steps)
            return total / wall, cpu / total * 1e6, float("nan")
        async with treadle.open_sqlite_store(path) as store:
            total, wall, cpu = await _timed(store, runs, steps)
        size = _dir_size(tmp)
        return total / wall, cpu / total * 1e6, size / total


def _dir_size(path: str) -> int:
    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))


async def _timed(store: treadle.ports.RunStore, runs: int, steps: int) -> tuple[int, float, float]:
    await drive(store, 1, 5, "warmup")
    wall0, cpu0 = time.perf_counter(), time.process_time()
    total = await drive(store, runs, steps, "bench")
    return total, time.perf_counter() - wall0, time.process_time() - cpu0


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200, help="steps per run")
    parser.add_argument("--runs", type=int, default=100, help="concurrent runs")
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
