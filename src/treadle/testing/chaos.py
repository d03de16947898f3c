"""Chaos for a fleet: real worker processes over one store, SIGKILLed at random and restarted.

`run_chaos` submits the crash scenario's run (`treadle.testing.crashes`) many times to a store
with a queue (SQLite or PostgreSQL), starts ``workers`` processes of ``treadle worker``
serving it, and, until every run has finished, SIGKILLs a random worker every few seconds
(seeded; only once the store holds more records than at the last kill, so the runs progress
however slowly the workers start) and starts a new one in its place. Then it checks every
run as the real-crash tests do (`treadle.testing.crashes.check_recovered_run`): each reached a
terminal state with the uninterrupted run's trajectory where no outcome became unknown, its log
keeps every invariant of `treadle.testing.invariants`, no ``never``-policy action ran twice and
nothing ran before its intent was durable (the tools keep their own ledger, outside the store),
and each log's records carry non-decreasing lease generations: no write of an older driver
after a takeover.

The test suite runs it small; ``python -m treadle.testing.chaos --store DSN --runs 200`` runs
the full size (and prints the figures)::

    python -m treadle.testing.chaos --store postgresql://... --workers 4 --runs 200
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs
import trio

from treadle.stores import is_dsn
from treadle.stores.memory import MemoryStore
from treadle.supervisors import run
from treadle.testing.crashes import (
    LATENCY_ENV,
    LEDGER_ENV,
    RUN_INPUT,
    check_recovered_run,
    make_agent,
    read_ledger,
)
from treadle.types import Message, RunLog, RunSummary

AGENT = "scenario"
"""The agent name the chaos workers serve."""


@attrs.frozen(kw_only=True)
class ChaosReport:
    """What `run_chaos` did and found.

    Attributes:
        runs: runs submitted.
        finished: runs that reached a terminal state.
        kills: workers SIGKILLed.
        takeovers: claims of runs whose driver had died (from the run index).
        executions: tool executions the ledger recorded.
        seconds: wall time from the first submit to the last run finished.
        problems: one sentence per violation found (empty when everything held).
        worker_exits: exit status of each worker stopped with SIGTERM at the end (0 each).
    """

    runs: int
    finished: int
    kills: int
    takeovers: int
    executions: int
    seconds: float
    problems: tuple[str, ...]
    worker_exits: tuple[int, ...]


@attrs.define(eq=False)
class _Workers:
    command: list[str]
    env: dict[str, str]
    cwd: str
    log_dir: Path
    processes: list[subprocess.Popen[bytes]] = attrs.Factory(list)
    logs: dict[int, Path] = attrs.Factory(dict)
    started: int = 0

    def start(self) -> subprocess.Popen[bytes]:
        self.started += 1
        log = self.log_dir / f"worker-{self.started}.log"
        with open(log, "wb") as out:
            process = subprocess.Popen(
                self.command, env=self.env, cwd=self.cwd, stdout=out, stderr=subprocess.STDOUT
            )
        self.processes.append(process)
        self.logs[process.pid] = log
        return process

    def kill_one(self, rng: random.Random) -> None:
        alive = [p for p in self.processes if p.poll() is None]
        if not alive:
            return
        victim = rng.choice(alive)
        victim.send_signal(signal.SIGKILL)
        victim.wait(timeout=30)
        self.processes.remove(victim)
        self.start()

    def stop(self) -> list[int]:
        """SIGTERM every worker once it is up (a signal before that kills it outright)."""
        deadline = time.monotonic() + 60
        for process in self.processes:
            log = self.logs[process.pid]
            while process.poll() is None and time.monotonic() < deadline:
                if b" serves " in log.read_bytes():
                    break
                time.sleep(0.02)
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        codes = []
        for process in self.processes:
            try:
                codes.append(process.wait(timeout=60))
            except subprocess.TimeoutExpired:
                process.kill()
                codes.append(process.wait(timeout=30))
        return codes


async def _baseline(workdir: Path) -> RunLog:
    store = MemoryStore()
    await run(make_agent(workdir / "baseline.ledger"), RUN_INPUT, store=store, run_id="baseline")
    return await store.read_log("baseline")


async def run_chaos(
    store: str,
    *,
    workdir: str | os.PathLike[str],
    workers: int = 4,
    runs: int = 200,
    max_running: int = 8,
    lease_ttl_s: float = 1.0,
    kill_every_s: tuple[float, float] = (1.0, 3.0),
    latency_s: float = 0.05,
    seed: int = 0,
    timeout_s: float = 600.0,
) -> ChaosReport:
    """Run the chaos described in the module docstring and check what it left.

    Args:
        store: a SQLite file or a PostgreSQL DSN (a fresh one: it is filled with these runs).
            A relative path is taken from the current directory, for the workers too (they
            run in ``workdir``).
        workdir: a directory for the ledger and the workers' output (made if missing); the
            workers' current directory.
        workers: worker processes at any time.
        runs: runs submitted.
        max_running: each worker's concurrency.
        lease_ttl_s: the workers' lease TTL.
        kill_every_s: ``(low, high)``: seconds between two kills, drawn uniformly (seeded); a
            kill waits, too, until a record was written since the last one.
        latency_s: seconds each model call of the scenario takes.
        seed: the kills' random seed.
        timeout_s: give up (and report it) after this long.

    Returns:
        The report; ``problems`` lists every violation.
    """
    from treadle._cli_common import open_store

    # The workers run in ``workdir``: a relative path would name another file there.
    store = store if is_dsn(store) else str(await trio.Path(store).absolute())
    root = Path(await trio.Path(workdir).absolute())
    await trio.Path(root).mkdir(parents=True, exist_ok=True)
    ledger = root / "ledger.jsonl"
    baseline = await _baseline(root)
    rng = random.Random(seed)
    ids = [f"chaos-{n:04d}" for n in range(runs)]
    pool = _Workers(
        command=_worker_command(store, max_running, lease_ttl_s),
        env={**os.environ, LEDGER_ENV: str(ledger), LATENCY_ENV: str(latency_s)},
        cwd=str(root),
        log_dir=root,
    )
    kills = 0
    problems: list[str] = []
    async with open_store(store, create=True) as opened:
        for run_id in ids:
            await opened.submit(  # type: ignore[attr-defined]
                run_id, agent=AGENT, input=(Message(role="user", content=RUN_INPUT),)
            )
        began = time.monotonic()
        for _ in range(workers):
            pool.start()
        try:
            with trio.move_on_after(timeout_s) as scope:
                done, killed_at = await _progress(opened, ids)
                while not done:
                    await trio.sleep(rng.uniform(*kill_every_s))
                    done, written = await _progress(opened, ids)
                    # Kill only once something was written since the last kill: on a loaded
                    # machine, workers killed faster than they start would never finish.
                    if not done and written > killed_at:
                        pool.kill_one(rng)
                        kills += 1
                        killed_at = written
            if scope.cancelled_caught:
                problems.append(f"not every run finished within {timeout_s:g} s")
        finally:
            seconds = time.monotonic() - began
            codes = pool.stop()
        summaries = {s.run_id: s for s in await opened.list_summaries()}  # type: ignore[attr-defined]
        finished = 0
        for run_id in ids:
            done, found = await _check_run(opened, run_id, summaries.get(run_id), ledger, baseline)
            finished += done
            problems += found
    problems += [f"a worker exited {code} on SIGTERM" for code in codes if code != 0]
    return ChaosReport(
        runs=runs,
        finished=finished,
        kills=kills,
        takeovers=sum(s.takeovers for s in summaries.values()),
        executions=len(read_ledger(ledger)),
        seconds=round(seconds, 2),
        problems=tuple(problems),
        worker_exits=tuple(codes),
    )


def _worker_command(store: str, max_running: int, lease_ttl_s: float) -> list[str]:
    return [
        sys.executable, "-m", "treadle", "worker", "--store", store,
        "--agent", f"{AGENT}=treadle.testing.crashes:agent_from_environment",
        "--max-running", str(max_running), "--lease-ttl", str(lease_ttl_s),
        "--claim-poll", "0.05", "--backoff", "0", "--max-takeovers", "1000", "--drain", "10",
    ]  # fmt: skip


async def _progress(store: Any, ids: Sequence[str]) -> tuple[bool, int]:
    """``(whether every run of ids finished, records the store holds in all)``."""
    summaries: tuple[RunSummary, ...] = await store.list_summaries()
    done = {s.run_id for s in summaries if s.state is not None and s.state.is_terminal}
    written = sum(s.records or 0 for s in summaries)
    return all(run_id in done for run_id in ids), written


async def _check_run(
    store: Any, run_id: str, summary: RunSummary | None, ledger: Path, baseline: RunLog
) -> tuple[bool, list[str]]:
    """Whether the run finished, and what is wrong with it."""
    log: RunLog = await store.read_log(run_id)
    done = log.finished is not None and log.finished.state.is_terminal
    if summary is not None and summary.quarantined:
        return done, [f"{run_id}: quarantined ({summary.quarantined})"]
    problems = check_recovered_run(log, read_ledger(ledger, run_id=run_id), baseline)
    generations: tuple[int, ...] = await store.read_generations(run_id)
    if list(generations) != sorted(generations):
        problems.append(f"{run_id}: a write of an older lease generation came after a newer one")
    return done, problems


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m treadle.testing.chaos``: run the chaos and print the report as JSON."""
    parser = argparse.ArgumentParser(prog="python -m treadle.testing.chaos")
    parser.add_argument("--store", required=True, help="SQLite file or PostgreSQL DSN")
    parser.add_argument("--workdir", default=None, help="ledger and worker logs (default: temp)")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument("--max-running", type=int, default=8)
    parser.add_argument("--lease-ttl", type=float, default=1.0)
    parser.add_argument("--kill-every", type=float, nargs=2, default=(1.0, 3.0))
    parser.add_argument("--latency", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        report = trio.run(
            lambda: run_chaos(
                args.store,
                workdir=args.workdir or tmp,
                workers=args.workers,
                runs=args.runs,
                max_running=args.max_running,
                lease_ttl_s=args.lease_ttl,
                kill_every_s=tuple(args.kill_every),
                latency_s=args.latency,
                seed=args.seed,
            )
        )
    print(json.dumps(attrs.asdict(report), indent=2))
    return 0 if not report.problems else 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
