"""Resume of a long run after a real crash: time from the resume call to the first new step.

A child process drives one run of the instant workload (benchmarks/_workload.py: an instant
model, a no-op tool; a step is one model call plus one tool call) for ``--steps`` steps, and
is SIGKILLed by its own tool inside the tool call of step ``steps + 1``: the log then holds
``steps`` finished steps, the model intent, model result and action intent of the next one,
and no result for it. Each repeat copies those files to a fresh place, opens the store, and
times ``treadle.open_run`` resuming the run until the step record of step ``steps + 1`` is
handed to the store (the first new step). The run then finishes (one more step, the answer).

Checked on every repeat: the model was called once (for the final answer, never for a
stored step), and the tool once, as a replay of the interrupted call (the no-op tool's replay
policy is ``safe``); nothing else ran again.

    python benchmarks/bench_resume.py [--steps 1000] [--repeat 5] [--stores sqlite,jsonl]
                                      [--profile sqlite]

``--profile KIND`` prints the functions a resume on that store spends its time in (cProfile,
cumulative time, one extra resume).
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path

import attrs
import trio
from rich.console import Console
from rich.table import Table

import treadle
from _args import at_least, listed, one_of
from treadle.ports import DeltaCallback, RunStore
from treadle.testing._intercept import InterceptingStore
from treadle.types import Attempt, ModelReply, ModelRequest, Record, StoreOp, ToolCall

RUN_ID = "bench-run-0001"
OWNER = "bench:resume:owner"
"""The lease owner of the crashed process and of every resume: a process restarted under the
owner id of one that died continues its lease at once (no wait for the lease to expire)."""

KILL_ENV = "TREADLE_BENCH_KILL_AT_CALL"


@attrs.define
class Counts:
    model_calls: int = 0
    tool_calls: int = 0


COUNTS = Counts()


class InstantModel:
    """Calls ``noop`` until the run has ``steps`` steps, then answers (as _workload's)."""

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
        COUNTS.model_calls += 1
        turn = (len(request.messages) - 1) // 2
        if turn >= self.steps - 1:
            return ModelReply(text="done", finish_reason="stop")
        call = ToolCall(id=f"c{turn}", name="noop", arguments={})
        return ModelReply(tool_calls=(call,), finish_reason="tool_calls")


@treadle.tool(replay=treadle.ReplayPolicy.SAFE)
async def noop() -> str:
    """Do nothing."""
    COUNTS.tool_calls += 1
    kill_at = os.environ.get(KILL_ENV)
    if kill_at is not None and COUNTS.tool_calls == int(kill_at):
        os.kill(os.getpid(), signal.SIGKILL)  # the crash, inside the tool call
    return "ok"


def make_agent(steps: int) -> treadle.Agent:
    """``steps`` steps with a tool call each, then the final answer (one more step)."""
    return treadle.Agent(
        model=InstantModel(steps + 2),
        executor=treadle.Toolbox([noop]),
        parser=treadle.NativeToolCallParser(),
        budgets=treadle.Budgets(max_steps=steps + 3, max_model_attempts=None),
    )


KINDS = ("sqlite", "jsonl")
"""The store kinds a crashed log is made and resumed on (files in a folder, copied per resume)."""


@asynccontextmanager
async def open_store(kind: str, where: str) -> AsyncIterator[RunStore]:
    """The store of ``kind`` (one of `KINDS`) whose files are in the folder ``where``."""
    if kind == "sqlite":
        async with treadle.open_sqlite_store(os.path.join(where, "bench.db")) as store:
            yield store
    else:
        async with treadle.open_jsonl_store(os.path.join(where, "runs")) as store:
            yield store


# --------------------------------------------------------------------------- the crashed log


async def child(kind: str, where: str, steps: int) -> None:
    """Drive the run until its own tool kills this process (step ``steps + 1``)."""
    async with open_store(kind, where) as store:
        await treadle.run(make_agent(steps), "go", store=store, run_id=RUN_ID, owner=OWNER)
    raise SystemExit("the run finished: the tool did not kill the process")


def crashed_log(kind: str, steps: int, where: str) -> None:
    """Make the crashed process's files in ``where``."""
    env = {**os.environ, KILL_ENV: str(steps + 1)}
    argv = [sys.executable, __file__, "--child", kind, where, str(steps)]
    done = subprocess.run(argv, env=env, check=False, capture_output=True, text=True)
    if done.returncode != -signal.SIGKILL:
        raise SystemExit(f"the child did not die by SIGKILL ({done.returncode}):\n{done.stderr}")


# --------------------------------------------------------------------------- one resume


class StepWatch(InterceptingStore):
    """Notes when the first step record is handed to the store."""

    def __init__(self, inner: RunStore) -> None:
        super().__init__(inner)
        self.first_step_at: float | None = None
        self.first_step: int | None = None

    def after_write(self, act: bool, op: StoreOp, records: tuple[Record, ...], seq: int) -> None:
        if op is StoreOp.STEP and self.first_step_at is None:
            self.first_step_at = time.perf_counter()
            self.first_step = getattr(records[-1], "step", None)


@attrs.frozen
class Resumed:
    ms_to_first_step: float
    ms_read_log: float
    first_step: int | None
    counts: Counts


async def resume_once(
    kind: str, where: str, steps: int, profiler: cProfile.Profile | None = None
) -> Resumed:
    async with open_store(kind, where) as inner:
        # the log's read alone, on a store of its own (so no cache helps the resume)
        t0 = time.perf_counter()
        log = await inner.read_log(RUN_ID)
        read_ms = (time.perf_counter() - t0) * 1e3
        assert len(log.steps) == steps, (len(log.steps), steps)
    async with open_store(kind, where) as inner:
        store = StepWatch(inner)
        COUNTS.model_calls = COUNTS.tool_calls = 0
        agent = make_agent(steps)
        if profiler is not None:
            profiler.enable()
        start = time.perf_counter()
        result = await treadle.run(agent, store=store, run_id=RUN_ID, owner=OWNER)
        if profiler is not None:
            profiler.disable()
        assert result.state is treadle.RunState.SUCCEEDED, result
        assert store.first_step_at is not None
    return Resumed(
        ms_to_first_step=(store.first_step_at - start) * 1e3,
        ms_read_log=read_ms,
        first_step=store.first_step,
        counts=attrs.evolve(COUNTS),
    )


def fresh_copy(source: str, parent: str) -> str:
    target = tempfile.mkdtemp(dir=parent)
    shutil.copytree(source, target, dirs_exist_ok=True, ignore=shutil.ignore_patterns("*-shm"))
    return target


def log_bytes(where: str) -> int:
    return sum(p.stat().st_size for p in Path(where).rglob("*") if p.is_file())


# --------------------------------------------------------------------------- main


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--steps", type=at_least(0), default=1000, help="finished steps before the crash"
    )
    parser.add_argument("--repeat", type=at_least(1), default=5, help="resumes per store (median)")
    parser.add_argument(
        "--stores",
        type=listed(one_of(*KINDS, what="store kind")),
        default=",".join(KINDS),
        help=f"store kinds, a,b,... of {', '.join(KINDS)}",
    )
    parser.add_argument(
        "--profile",
        type=one_of(*KINDS, what="store kind"),
        help="profile one more resume on this store (one of --stores)",
    )
    parser.add_argument(
        "--child", nargs=3, metavar=("KIND", "DIR", "STEPS"), help=argparse.SUPPRESS
    )
    args = parser.parse_args(argv)
    if args.profile is not None and args.profile not in args.stores:
        parser.error(f"--profile {args.profile}: not among --stores {','.join(args.stores)}")
    if args.child:
        kind, where, steps = args.child
        trio.run(child, kind, where, int(steps))
        return
    console = Console(width=120)
    table = Table(title=f"treadle resume: a {args.steps:,}-step run killed inside a tool call")
    for column in (
        "store",
        "log bytes",
        "read log ms",
        "resume → first new step ms",
        "min",
        "max",
        "model calls",
        "tool calls",
    ):
        table.add_column(column, justify="right")
    with tempfile.TemporaryDirectory() as tmp:
        for kind in args.stores:
            crashed = os.path.join(tmp, f"crashed-{kind}")
            os.mkdir(crashed)
            crashed_log(kind, args.steps, crashed)
            samples = []
            for _ in range(args.repeat):
                where = fresh_copy(crashed, tmp)
                samples.append(trio.run(resume_once, kind, where, args.steps))
                shutil.rmtree(where)
            check(samples, args.steps)
            times = [s.ms_to_first_step for s in samples]
            counts = samples[-1].counts
            table.add_row(
                kind,
                f"{log_bytes(crashed):,}",
                f"{statistics.median(s.ms_read_log for s in samples):.1f}",
                f"{statistics.median(times):.1f}",
                f"{min(times):.1f}",
                f"{max(times):.1f}",
                str(counts.model_calls),
                str(counts.tool_calls),
            )
            if args.profile == kind:
                where = fresh_copy(crashed, tmp)
                profile(kind, where, args.steps)
    console.print(table)
    console.print(
        f"Medians of {args.repeat} resumes, each a fresh copy of the crashed files and a freshly "
        "opened store; 'read log' is read_log alone on another store object. " + load_note()
    )


def check(samples: list[Resumed], steps: int) -> None:
    for s in samples:
        if s.first_step != steps + 1:
            raise SystemExit(f"the first new step was {s.first_step}, not {steps + 1}")
        # one model call (the final answer), one tool call (the interrupted one, replayed)
        if s.counts.model_calls != 1 or s.counts.tool_calls != 1:
            raise SystemExit(f"the resume ran more than the interrupted call: {s.counts}")


def profile(kind: str, where: str, steps: int) -> None:
    profiler = cProfile.Profile()
    trio.run(resume_once, kind, where, steps, profiler)
    pstats.Stats(profiler).sort_stats("cumulative").print_stats(45)


def load_note() -> str:
    one, five, _ = os.getloadavg()
    return f"Load average {one:.1f} (1 min), {five:.1f} (5 min) on {os.cpu_count()} cores."


if __name__ == "__main__":
    main()
