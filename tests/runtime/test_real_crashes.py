"""Real crashes: driver processes SIGKILLed at seeded random points, resumed by new processes.

Each chain runs four runs of the scripted scenario (`treadle.testing.crashes`) concurrently in
one driver process on a real store (SQLite or JSONL), kills the process (it kills itself
after a random number of store writes, or the test kills it from outside after a random
delay), starts a new process that resumes, and so on until a process finishes every run.
Then every run must have reached a terminal state with the uninterrupted run's trajectory
(where no outcome became unknown), and the tools' own ledger, kept outside the store, must
show that no ``never``-policy action ran twice and that nothing ran before its intent was
durable. After every kill that happened right after a barrier returned, that barrier must
be readable by the next process.

Driver processes come from a forkserver that imported treadle once, so a kill and a resume
cost tens of milliseconds; one test runs the driver as ``python -m`` in fresh interpreters.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import random
import signal
import subprocess
import sys
import time
from multiprocessing.context import ForkServerContext
from pathlib import Path
from typing import Literal

import attrs
import pytest
import trio

from treadle.stores.memory import MemoryStore
from treadle.supervisors import run
from treadle.testing.crashdriver import DriverSpec, child_main, open_store, read_kill_note
from treadle.testing.crashes import (
    LEDGER_ENV,
    RUN_INPUT,
    check_recovered_run,
    make_agent,
    read_ledger,
)
from treadle.types import ActionResult, RunLog, StepRecord

SEED = 20261130
RUNS = tuple(f"run-{n}" for n in range(4))
MAX_INCARNATIONS = 40
KILLED = -signal.SIGKILL


@pytest.fixture(scope="module")
def forkserver() -> ForkServerContext:
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["treadle.testing.crashdriver"])
    return context


@pytest.fixture(scope="module")
def baseline(tmp_path_factory: pytest.TempPathFactory) -> RunLog:
    ledger = tmp_path_factory.mktemp("baseline") / "ledger"

    async def uninterrupted() -> RunLog:
        store = MemoryStore()
        await run(make_agent(ledger), RUN_INPUT, store=store, run_id="baseline")
        return await store.read_log("baseline")

    return trio.run(uninterrupted)


@attrs.define
class Chain:
    """One store, four runs, and the processes that drove them to the end."""

    context: ForkServerContext
    kind: Literal["sqlite", "jsonl"]
    root: Path
    rng: random.Random
    kills: int = 0
    barrier_checks: int = 0

    @property
    def store(self) -> Path:
        return self.root / ("runs.db" if self.kind == "sqlite" else "runs")

    @property
    def ledger(self) -> Path:
        return self.root / "ledger.jsonl"

    def spec(self, incarnation: int, kill_after_writes: int | None) -> DriverSpec:
        return DriverSpec(
            kind=self.kind,
            store=str(self.store),
            ledger=str(self.ledger),
            run_ids=RUNS,
            kill_after_writes=kill_after_writes,
            kill_when=self.rng.choice(["before", "after"]),
            note=str(self.root / f"note-{incarnation}.json"),
        )

    def incarnation(self, spec: DriverSpec, kill_after_s: float | None) -> int:
        ready = self.context.Event()
        process = self.context.Process(target=child_main, args=(spec, ready))
        process.start()
        try:
            if kill_after_s is not None:
                assert ready.wait(60), "the driver never opened its store"
                time.sleep(kill_after_s)
                process.kill()
            process.join(120)
        finally:
            if process.exitcode is None:
                process.kill()
                process.join()
        assert process.exitcode in (0, KILLED), process.exitcode
        return process.exitcode

    def drive(self, choose: str, max_kills: int) -> None:
        """Kill and resume until a process finishes every run."""
        self.root.mkdir(parents=True)
        for incarnation in range(MAX_INCARNATIONS):
            plan = choose if self.kills < max_kills else "none"
            writes = self.rng.randint(1, 30) if plan == "self" else None
            delay = self.rng.uniform(0.0, 0.06) if plan == "outside" else None
            spec = self.spec(incarnation, writes)
            if self.incarnation(spec, delay) == 0:
                return
            self.kills += 1
            self.check_barrier(spec)
        pytest.fail(f"no process finished the runs in {MAX_INCARNATIONS} incarnations")

    def check_barrier(self, spec: DriverSpec) -> None:
        """A barrier that returned before the kill is readable by the next process."""
        note = read_kill_note(spec.note or "")
        if note is None or note.when != "after" or not note.barrier:
            return

        async def read() -> RunLog:
            async with open_store(self.kind, self.store) as store:
                return await store.read_log(note.run_id)

        log = trio.run(read)
        assert len(log.records) >= note.seq + note.records - 1, (note, len(log.records))
        self.barrier_checks += 1

    def verify(self, baseline: RunLog) -> None:
        async def read() -> list[RunLog]:
            async with open_store(self.kind, self.store) as store:
                assert sorted(await store.list_runs()) == sorted(RUNS)
                return [await store.read_log(run_id) for run_id in RUNS]

        for log in trio.run(read):
            ledger = read_ledger(self.ledger, run_id=log.run_id)
            assert check_recovered_run(log, ledger, baseline) == []
            for i, record in enumerate(log.records):  # a result never without its step record
                if isinstance(record, ActionResult):
                    assert isinstance(log.records[i + 1], ActionResult | StepRecord)


def run_chains(
    context: ForkServerContext,
    baseline: RunLog,
    tmp_path: Path,
    kind: Literal["sqlite", "jsonl"],
    choose: str,
    chains: int,
    max_kills: int,
) -> tuple[int, int]:
    rng = random.Random(f"{SEED}-{kind}-{choose}")
    kills = checks = 0
    for number in range(chains):
        chain = Chain(context, kind, tmp_path / f"chain-{number}", rng)
        chain.drive(choose, max_kills)
        chain.verify(baseline)
        kills += chain.kills
        checks += chain.barrier_checks
    return kills, checks


@pytest.mark.parametrize("kind", ["sqlite", "jsonl"])
def test_processes_that_kill_themselves_after_random_writes(
    forkserver: ForkServerContext,
    baseline: RunLog,
    tmp_path: Path,
    kind: Literal["sqlite", "jsonl"],
) -> None:
    kills, checks = run_chains(forkserver, baseline, tmp_path, kind, "self", 16, 12)
    print(f"{kind}: {kills} self-kills, {checks} acknowledged barriers checked")
    assert kills >= 70
    assert checks >= 10


@pytest.mark.parametrize("kind", ["sqlite", "jsonl"])
def test_processes_killed_from_outside_after_random_delays(
    forkserver: ForkServerContext,
    baseline: RunLog,
    tmp_path: Path,
    kind: Literal["sqlite", "jsonl"],
) -> None:
    kills, _ = run_chains(forkserver, baseline, tmp_path, kind, "outside", 10, 4)
    print(f"{kind}: {kills} kills from outside")
    assert kills >= 20


@pytest.mark.parametrize("kind", ["sqlite", "jsonl"])
def test_killed_driver_resumed_by_the_cli_in_a_fresh_interpreter(
    baseline: RunLog, tmp_path: Path, kind: Literal["sqlite", "jsonl"]
) -> None:
    ledger = tmp_path / "ledger.jsonl"
    store = tmp_path / ("runs.db" if kind == "sqlite" else "runs")
    driver = [
        sys.executable, "-m", "treadle.testing.crashdriver", "--kind", kind,
        "--store", str(store), "--ledger", str(ledger), "--runs", ",".join(RUNS),
        "--kill-after-writes", "23", "--kill-when", "after",
    ]  # fmt: skip
    killed = subprocess.run(driver, capture_output=True, text=True, timeout=120, check=False)
    assert killed.returncode == KILLED, killed.stderr
    assert killed.stdout.splitlines() == ["ready"]
    resume = [
        sys.executable, "-m", "treadle", "resume", "--all", "--wait", "--json", "--store",
        str(store), "--agent", "treadle.testing.crashes:agent_from_environment",
    ]  # fmt: skip
    env = {**os.environ, LEDGER_ENV: str(ledger)}

    async def present() -> list[str]:
        async with open_store(kind, store) as opened:
            return sorted(await opened.list_runs())

    # A run whose first barrier never committed before the kill does not exist yet.
    started = trio.run(present)
    assert started
    resumed = subprocess.run(resume, capture_output=True, text=True, timeout=120, env=env)
    assert resumed.returncode == 0, resumed.stderr
    rows = [json.loads(line) for line in resumed.stdout.splitlines()]
    assert sorted(row["run_id"] for row in rows) == started  # all were unfinished
    assert all(row["state"] in ("succeeded", "failed") for row in rows)

    async def read() -> list[RunLog]:
        async with open_store(kind, store) as opened:
            return [await opened.read_log(run_id) for run_id in started]

    for log in trio.run(read):
        entries = read_ledger(ledger, run_id=log.run_id)
        assert check_recovered_run(log, entries, baseline) == []
