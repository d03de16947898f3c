"""A fleet on PostgreSQL: steps/s of 1, 2 and 4 ``treadle worker`` processes, and takeover time.

Throughput: ``treadle worker`` processes (the CLI, serving ``_workload:agent_from_env``, the
instant workload of bench_runtime.py) on one fresh database's ``public`` schema; once they are
up, --runs runs of --steps steps are submitted to the queue, and the time from the first
submission to the last run-finished record gives the total durable steps/s. Every run must
have succeeded with --steps steps. CPU is the workers' (from /proc), over the same interval.

Takeover: a worker with --lease-ttl T drives three long runs; it is killed with SIGKILL at a
random moment of its renewal cycle, another worker is started at once, and the time from the
kill to the first record the new owner writes (seen by polling ``records`` every 10 ms) is
measured. Its ``records.gen`` must be the old lease generation + 1, and no record of the old
generation may follow it. --kills kills, each on a fresh database; the median is shown beside
the target of T + 2 s (--kills 0 leaves the takeover out). Worker options other than
--max-running and --lease-ttl are the CLI's defaults (claim poll 1 s, backoff 1 s). Run with:

    python benchmarks/bench_fleet.py [--dsn DSN] [--runs 200] [--steps 20] [--repeat 3]
                                     [--max-running 16] [--lease-ttl 3] [--kills 5]

The DSN defaults to ``$TREADLE_BENCH_POSTGRES``, else the local test server; the benchmark
creates and drops one database per pass on that server.
"""

from __future__ import annotations

import argparse
import os
import random
import select
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

import attrs
import psycopg
import trio
from rich.console import Console
from rich.table import Table

import treadle
from _args import at_least, seconds
from _stores import fresh_database, postgres_dsn
from _workload import STEPS_ENV, load_note
from treadle.stores import redact_dsn
from treadle.types import Message

T = TypeVar("T")
HERE = Path(__file__).resolve().parent
AGENT = "instant"
READY_TIMEOUT_S = 60.0
TAKEOVER_RUNS = 3
LONG_RUN_STEPS = 1_000_000
EARLY_S = 0.1
"""A takeover this much before the lease's expiry (the server's clock) is a failure."""
LEASE_TTL_MIN_S, LEASE_TTL_MAX_S = 0.1, 3600.0
"""The --lease-ttl values ``treadle worker`` takes (seconds)."""


class Misbehaved(Exception):
    """treadle did something the benchmark does not expect (the message says what)."""


@attrs.define
class Worker:
    """A ``treadle worker`` process; its stderr goes to a file."""

    process: subprocess.Popen[str]
    stderr: Path
    owner: str = ""

    @classmethod
    def start(cls, dsn: str, logs: Path, *, steps: int, max_running: int, ttl_s: float) -> Worker:
        stderr = logs / f"worker-{time.monotonic_ns()}.err"
        command = [sys.executable, "-m", "treadle", "worker"]
        command += ["--agent", f"{AGENT}=_workload:agent_from_env"]
        command += ["--max-running", str(max_running), "--lease-ttl", str(ttl_s)]
        env = {**os.environ, "TREADLE_STORE": dsn, STEPS_ENV: str(steps)}
        with stderr.open("w") as err:
            process = subprocess.Popen(
                command, cwd=HERE, env=env, stdout=subprocess.PIPE, stderr=err, text=True
            )
        return cls(process, stderr)

    def wait_ready(self) -> None:
        """Until it printed ``worker OWNER serves ...``."""
        assert self.process.stdout is not None
        ready, _, _ = select.select([self.process.stdout], [], [], READY_TIMEOUT_S)
        line = self.process.stdout.readline() if ready else ""
        if not line.startswith("worker "):
            self.process.kill()
            raise Misbehaved(f"a worker did not start: {line!r} {self.errors()}")
        self.owner = line.split()[1]

    def cpu_s(self) -> float:
        stat = Path(f"/proc/{self.process.pid}/stat").read_text()
        fields = stat[stat.rindex(")") + 2 :].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def stop(self) -> None:
        """SIGTERM (a drain), then check it exited 0."""
        self.process.send_signal(signal.SIGTERM)
        try:
            code = self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            raise Misbehaved(f"worker {self.owner} did not exit after SIGTERM") from None
        if code != 0:
            raise Misbehaved(f"worker {self.owner} exited {code} after SIGTERM {self.errors()}")

    def kill(self) -> None:
        self.process.kill()
        self.process.wait()

    def errors(self) -> str:
        text = self.stderr.read_text().strip() if self.stderr.exists() else ""
        return f"(stderr: {text.splitlines()[-1]})" if text else ""


async def submit(dsn: str, run_ids: Sequence[str]) -> None:
    async with treadle.open_postgres_store(dsn) as store, trio.open_nursery() as nursery:
        for run_id in run_ids:
            nursery.start_soon(
                lambda run_id=run_id: store.submit(
                    run_id, agent=AGENT, input=(Message(role="user", content="go"),)
                )
            )


# --------------------------------------------------------------------------- throughput


@attrs.frozen
class Drained:
    steps_per_s: float
    cpu_us_per_step: float


def throughput_pass(dsn: str, logs: Path, workers: int, args: argparse.Namespace) -> Drained:
    run_ids = [f"fleet-{i}" for i in range(args.runs)]
    with fresh_database(dsn) as db:
        fleet = [
            Worker.start(db, logs, steps=args.steps, max_running=args.max_running, ttl_s=15)
            for _ in range(workers)
        ]
        try:
            for worker in fleet:
                worker.wait_ready()
            cpu0 = sum(w.cpu_s() for w in fleet)
            began = time.perf_counter()
            trio.run(submit, db, run_ids)
            with psycopg.connect(db, autocommit=True) as conn:
                while _finished(conn) < args.runs:
                    if any(w.process.poll() is not None for w in fleet):
                        raise Misbehaved(f"a worker died while draining the queue {_errors(fleet)}")
                    time.sleep(0.01)
                wall = time.perf_counter() - began
                cpu = sum(w.cpu_s() for w in fleet) - cpu0
                _check_results(conn, args.runs, args.steps)
        finally:
            for worker in fleet:
                if worker.process.poll() is None:
                    worker.stop()
    total = args.runs * args.steps
    return Drained(total / wall, cpu / total * 1e6)


def _finished(conn: psycopg.Connection) -> int:
    row = conn.execute(
        "SELECT count(*) FROM runs WHERE state IN ('succeeded', 'failed', 'cancelled')"
    ).fetchone()
    return int(row[0]) if row else 0


def _check_results(conn: psycopg.Connection, runs: int, steps: int) -> None:
    rows = conn.execute("SELECT state, steps, count(*) FROM runs GROUP BY state, steps").fetchall()
    if rows != [("succeeded", steps, runs)]:
        raise Misbehaved(f"expected {runs} runs succeeded with {steps} steps, got {rows}")


def _errors(fleet: Sequence[Worker]) -> str:
    return " ".join(w.errors() for w in fleet)


# --------------------------------------------------------------------------- takeover


@attrs.frozen
class Takeover:
    first_s: float
    """Kill -> the first record of the new owner (any run)."""
    all_s: float
    """Kill -> every run has a record of the new owner."""
    left_s: float
    """Kill -> the first of the killed worker's leases expires (the server's clock)."""


def takeover_pass(dsn: str, logs: Path, args: argparse.Namespace, rng: random.Random) -> Takeover:
    run_ids = [f"long-{i}" for i in range(TAKEOVER_RUNS)]
    start = {"steps": LONG_RUN_STEPS, "max_running": args.max_running, "ttl_s": args.lease_ttl}
    with fresh_database(dsn) as db, psycopg.connect(db, autocommit=True) as conn:
        first = Worker.start(db, logs, **start)
        second: Worker | None = None
        try:
            first.wait_ready()
            trio.run(submit, db, run_ids)
            _wait_driven(conn, run_ids, first)
            time.sleep(rng.uniform(0.5, 0.5 + args.lease_ttl / 3))  # any phase of the renewals
            old = dict(conn.execute("SELECT run_id, lease_generation FROM runs").fetchall())
            first.kill()
            killed = time.perf_counter()
            second = Worker.start(db, logs, **start)
            left = dict(
                conn.execute(
                    "SELECT run_id, lease_expires - extract(epoch FROM clock_timestamp()) FROM runs"
                ).fetchall()
            )
            left = {run_id: s + (time.perf_counter() - killed) for run_id, s in left.items()}
            seen = _wait_new_generation(conn, old, killed, deadline_s=args.lease_ttl + 30)
            second.wait_ready()
            _check_takeover(conn, old, second.owner)
            for run_id, after_s in seen.items():
                if after_s < left[run_id] - EARLY_S:
                    raise Misbehaved(
                        f"{run_id} was taken over {after_s:.2f} s after the kill, its lease "
                        f"had {left[run_id]:.2f} s left"
                    )
        finally:
            if first.process.poll() is None:
                first.kill()
            if second is not None and second.process.poll() is None:
                second.stop()
    return Takeover(min(seen.values()), max(seen.values()), min(left.values()))


def _wait_driven(conn: psycopg.Connection, run_ids: Sequence[str], worker: Worker) -> None:
    """Until every run has records (its driver is mid-run)."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        row = conn.execute(
            "SELECT count(DISTINCT run_id) FROM records WHERE run_id = ANY(%s)", (list(run_ids),)
        ).fetchone()
        if row and row[0] == len(run_ids):
            return
        time.sleep(0.01)
    raise Misbehaved(f"worker {worker.owner} did not start the submitted runs {worker.errors()}")


def _wait_new_generation(
    conn: psycopg.Connection, old: dict[str, int], killed: float, deadline_s: float
) -> dict[str, float]:
    """Kill -> each run's first record of a newer generation (seconds)."""
    seen: dict[str, float] = {}
    while len(seen) < len(old):
        now = time.perf_counter()
        if now - killed > deadline_s:
            raise Misbehaved(f"no takeover within {deadline_s:g} s of the kill (runs {old})")
        for run_id, generation in old.items():
            if (
                run_id not in seen
                and conn.execute(
                    "SELECT 1 FROM records WHERE run_id = %s AND gen > %s LIMIT 1",
                    (run_id, generation),
                ).fetchone()
            ):
                seen[run_id] = now - killed
        time.sleep(0.01)
    return seen


def _check_takeover(conn: psycopg.Connection, old: dict[str, int], owner: str) -> None:
    """The new owner holds generation old + 1, and no old-generation record follows its own."""
    for run_id, generation in old.items():
        gens = [
            int(g)
            for (g,) in conn.execute(
                "SELECT DISTINCT gen FROM records WHERE run_id = %s AND gen > %s",
                (run_id, generation),
            ).fetchall()
        ]
        if gens != [generation + 1]:
            raise Misbehaved(f"{run_id}: old generation {generation}, new records have {gens}")
        held = conn.execute("SELECT lease_owner FROM runs WHERE run_id = %s", (run_id,)).fetchone()
        if held is None or held[0] != owner:
            raise Misbehaved(f"{run_id}: leased by {held}, not the new worker {owner}")
        stale = conn.execute(
            "SELECT count(*) FROM records WHERE run_id = %s AND gen = %s AND seq > "
            "(SELECT min(seq) FROM records WHERE run_id = %s AND gen = %s)",
            (run_id, generation, run_id, generation + 1),
        ).fetchone()
        if stale and stale[0]:
            raise Misbehaved(f"{run_id}: {stale[0]} old-generation records after the takeover")


# --------------------------------------------------------------------------- main


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dsn", default=None, help="PostgreSQL DSN (or $TREADLE_BENCH_POSTGRES)")
    parser.add_argument("--runs", type=at_least(1), default=200, help="runs submitted per pass")
    parser.add_argument("--steps", type=at_least(1), default=20, help="steps per run")
    parser.add_argument("--repeat", type=at_least(1), default=3, help="rounds (medians are shown)")
    parser.add_argument(
        "--max-running", type=at_least(1), default=16, help="runs per worker at once"
    )
    parser.add_argument(
        "--lease-ttl",
        type=seconds(LEASE_TTL_MIN_S, LEASE_TTL_MAX_S),  # what treadle worker --lease-ttl takes
        default=3.0,
        help="takeover: lease TTL (s)",
    )
    parser.add_argument(
        "--kills", type=at_least(0), default=5, help="takeover: kills measured (0: no takeover)"
    )
    args = parser.parse_args(argv)
    dsn = postgres_dsn(args.dsn)
    console = Console()
    load_before = load_note()
    failures: list[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        logs = Path(tmp)
        drained: dict[int, list[Drained | None]] = {}
        for number in range(1, args.repeat + 1):
            for workers in (1, 2, 4):
                done = attempt(
                    failures,
                    f"{workers} workers, round {number}",
                    throughput_pass,
                    dsn,
                    logs,
                    workers,
                    args,
                )
                drained.setdefault(workers, []).append(done)
        rng = random.Random(1)
        takeovers = [
            attempt(failures, f"kill {number}", takeover_pass, dsn, logs, args, rng)
            for number in range(1, args.kills + 1)
        ]
        complaints = _worker_stderr(logs)
    console.print(throughput_table(drained, args))
    if args.kills:
        console.print(takeover_table([t for t in takeovers if t is not None], args.lease_ttl))
    console.print(
        f"PostgreSQL: {redact_dsn(dsn)} (a fresh database per pass), server defaults. "
        f"Workers: treadle worker --max-running {args.max_running}, other options default. "
        f"Throughput: median of {args.repeat} interleaved rounds; ratios are "
        "medians of each round's ratio to its 1-worker pass. Takeover: "
        f"{TAKEOVER_RUNS} runs per kill, medians of the kills; all resumed: kill -> each run has "
        "a record of the new owner; lease left: kill -> the first lease expires (server clock, "
        "last renewal + TTL).\n"
        f"Machine: {load_before} before, {load_note()} after.\n"
        f"Workers' stderr: {complaints}"
    )
    for line in failures:
        console.print(line, style="bold red")


def attempt(failures: list[str], label: str, fn: Callable[..., T], *args: object) -> T | None:
    """``fn(*args)``, or ``None`` with what went wrong added to ``failures``."""
    try:
        return fn(*args)
    except Misbehaved as exc:
        failures.append(f"FAILED {label}: {exc}")
        return None


def _worker_stderr(logs: Path) -> str:
    """What the workers printed on stderr (warnings of treadle's loggers included)."""
    lines = [line for f in sorted(logs.glob("*.err")) for line in f.read_text().splitlines()]
    if not lines:
        return "empty."
    return f"{len(lines)} lines, the first: {lines[0]!r}"


def throughput_table(drained: dict[int, list[Drained | None]], args: argparse.Namespace) -> Table:
    table = Table(title=f"fleet: {args.runs} runs x {args.steps} steps drained from the queue")
    for column in ("workers", "steps/s", "min-max", "x 1 worker", "CPU µs/step"):
        table.add_column(column, justify="right")
    for workers, passes in drained.items():
        done = [p for p in passes if p is not None]
        ratios = [
            p.steps_per_s / one.steps_per_s
            for p, one in zip(passes, drained[1], strict=True)
            if p is not None and one is not None
        ]
        if not done:
            table.add_row(str(workers), "failed", "", "", "")
            continue
        rates = [p.steps_per_s for p in done]
        table.add_row(
            str(workers),
            f"{statistics.median(rates):,.0f}",
            f"{min(rates):,.0f}-{max(rates):,.0f}",
            f"{statistics.median(ratios):.2f}x" if ratios else "",
            f"{statistics.median(p.cpu_us_per_step for p in done):,.0f}",
        )
    return table


def takeover_table(takeovers: Sequence[Takeover], ttl_s: float) -> Table:
    table = Table(title=f"takeover after SIGKILL, lease TTL {ttl_s:g} s ({len(takeovers)} kills)")
    columns = ("kill -> first record", "min-max", "target", "met", "all resumed", "lease left")
    for column in columns:
        table.add_column(column, justify="right")
    target = ttl_s + 2
    if not takeovers:
        table.add_row("failed", "", f"<= {target:g} s", "", "", "")
        return table
    firsts = [t.first_s for t in takeovers]
    median = statistics.median(firsts)
    table.add_row(
        f"{median:.2f} s",
        f"{min(firsts):.2f}-{max(firsts):.2f} s",
        f"<= {target:g} s",
        "yes" if median <= target else "NO",
        f"{statistics.median(t.all_s for t in takeovers):.2f} s",
        f"{statistics.median(t.left_s for t in takeovers):.2f} s",
    )
    return table


if __name__ == "__main__":
    main()
