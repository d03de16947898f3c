"""The instant workload the runtime benchmarks share (bench_runtime's).

A model that answers instantly with one tool call per step and a final answer at the end,
and a tool that does nothing: a step is one model call plus one tool call, with the full
write protocol (two barriers per step). The durable cost of a step is then all there is.
"""

from __future__ import annotations

import os
import time

import attrs
import trio

import treadle
from treadle.ports import DeltaCallback
from treadle.types import Attempt, ModelReply, ModelRequest, ToolCall


class InstantModel:
    """Calls ``noop`` until the run has ``steps`` steps, then answers."""

    def __init__(self, steps: int) -> None:
        self.steps = steps

    async def complete(
        self,
        request: ModelRequest,
        *,
        on_delta: DeltaCallback | None = None,
        attempt: Attempt = Attempt.STANDALONE,
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


STEPS_ENV = "TREADLE_BENCH_STEPS"


def agent_from_env() -> treadle.Agent:
    """The agent worker processes serve: runs of ``$TREADLE_BENCH_STEPS`` steps (default 20).

    ``treadle worker --agent instant=_workload:agent_from_env``, run in benchmarks/.
    """
    return make_agent(int(os.environ.get(STEPS_ENV, "20")))


def load_note() -> str:
    one, five, _ = os.getloadavg()
    return f"load average {one:.1f} (1 min), {five:.1f} (5 min) on {os.cpu_count()} cores"


async def drive(store: treadle.ports.RunStore, runs: int, steps: int, tag: str) -> int:
    """Run ``runs`` runs of ``steps`` steps at once; return the steps made."""
    agent = make_agent(steps)
    async with trio.open_nursery() as nursery:
        for i in range(runs):
            nursery.start_soon(
                lambda i=i: treadle.run(agent, "go", store=store, run_id=f"{tag}-{i}")
            )
    return runs * steps


@attrs.frozen
class Timing:
    steps: int
    wall_s: float
    cpu_s: float
    commits: int | None = None
    """Store commits during the timed part (None: the store does not count them)."""

    @property
    def steps_per_s(self) -> float:
        return self.steps / self.wall_s

    @property
    def cpu_us_per_step(self) -> float:
        return self.cpu_s / self.steps * 1e6

    @property
    def commits_per_step(self) -> float | None:
        return None if self.commits is None else self.commits / self.steps


async def timed(store: treadle.ports.RunStore, runs: int, steps: int) -> Timing:
    """A 5-step warm-up run, then ``runs`` concurrent runs of ``steps`` steps, timed.

    CPU is this process's (every thread, the store's committer included).
    """
    await drive(store, 1, 5, "warmup")
    commits0 = _commits(store)
    wall0, cpu0 = time.perf_counter(), time.process_time()
    total = await drive(store, runs, steps, "bench")
    wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
    commits1 = _commits(store)
    commits = None if commits0 is None or commits1 is None else commits1 - commits0
    return Timing(total, wall, cpu, commits)


def _commits(store: treadle.ports.RunStore) -> int | None:
    statistics = getattr(store, "statistics", None)  # not every store (nor version) has one
    commits = getattr(statistics(), "commits", None) if statistics is not None else None
    return None if commits is None else int(commits)
