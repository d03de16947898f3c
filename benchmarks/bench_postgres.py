"""Durable steps per second of treadle on PostgreSQL, beside DBOS and treadle on SQLite.

Workload: the peer benchmark (benchmarks/_workload.py), an instant model and a no-op tool;
one step is one model call plus one tool call, two durable commits. treadle runs it on
`treadle.open_postgres_store` (a fresh schema per pass, dropped after) and on SQLite
(synchronous=FULL); DBOS runs it on the same PostgreSQL server as a workflow whose every
iteration is two ``@DBOS.step()`` calls (benchmarks/_dbos_peer.py, run in a subprocess with
the Python of a virtualenv that has ``dbos``; it is made with ``pip install dbos`` when
missing). Each system runs at C=1 (one run of 5 x --steps steps) and C=--runs (that many
concurrent runs of --steps steps), --repeat rounds, interleaved; the table shows medians,
and each ratio is the median of the rounds' ratios. PostgreSQL keeps its settings (the
defaults: fsync=on, synchronous_commit=on). Run with:

    python benchmarks/bench_postgres.py [--dsn DSN] [--steps 100] [--runs 100] [--repeat 3]

The DSN defaults to ``$TREADLE_BENCH_POSTGRES``, else the local test server.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import attrs
import trio
from rich.console import Console
from rich.table import Table

from _args import at_least
from _stores import DSN_ENV, open_store, postgres_dsn
from _workload import load_note, timed
from treadle.stores import redact_dsn

HERE = Path(__file__).resolve().parent
DBOS_VENV = Path("/tmp/dbos-venv")
DBOS_TIMEOUT_S = 600


@attrs.frozen
class Pass:
    steps_per_s: float
    cpu_us_per_step: float
    commits_per_step: float | None


@attrs.frozen
class Failed:
    reason: str


def treadle_pass(kind: str, dsn: str, runs: int, steps: int) -> Pass | Failed:
    async def go() -> Pass:
        async with open_store(kind, dsn=dsn) as store:
            t = await timed(store, runs, steps)
        return Pass(t.steps_per_s, t.cpu_us_per_step, t.commits_per_step)

    try:
        return trio.run(go)
    except Exception as exc:  # shown under the table: a failing run is a finding
        return Failed(f"treadle failed: {describe_error(exc)}")


def describe_error(exc: BaseException) -> str:
    """The first leaf error of ``exc`` and how many there were."""
    leaves: list[BaseException] = []
    stack = [exc]
    while stack:
        error = stack.pop(0)
        if isinstance(error, BaseExceptionGroup):
            stack[:0] = error.exceptions
        else:
            leaves.append(error)
    first = f"{type(leaves[0]).__name__}: {leaves[0]}"
    return first if len(leaves) == 1 else f"{len(leaves)} errors, the first {first}"


def dbos_pass(python: Path, dsn: str, runs: int, steps: int) -> Pass | Failed:
    command = [str(python), str(HERE / "_dbos_peer.py"), "--runs", str(runs), "--steps", str(steps)]
    env = {**os.environ, DSN_ENV: dsn}  # not on the command line: it may hold a password
    try:
        done = subprocess.run(
            command, env=env, capture_output=True, text=True, timeout=DBOS_TIMEOUT_S, check=False
        )
    except subprocess.TimeoutExpired:
        return Failed(f"DBOS did not finish in {DBOS_TIMEOUT_S} s")
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
        return Failed(f"DBOS failed (exit {done.returncode}): {redact_dsn(last)}")
    out = json.loads(done.stdout.strip().splitlines()[-1])
    return Pass(
        out["steps"] / out["wall_s"],
        out["cpu_s"] / out["steps"] * 1e6,
        out["xact_commits"] / out["steps"],
    )


def dbos_python(given: str | None) -> Path | Failed:
    """The Python that has ``dbos``; the default virtualenv is made when missing."""
    python = Path(given) if given else DBOS_VENV / "bin" / "python"
    if given is None and not python.exists():
        Console(stderr=True).print(f"making {DBOS_VENV} with pip install dbos ...")
        for command in (
            [sys.executable, "-m", "venv", str(DBOS_VENV)],
            [str(python), "-m", "pip", "install", "-q", "dbos"],
        ):
            made = subprocess.run(command, capture_output=True, text=True, check=False)
            if made.returncode != 0:
                last = (made.stderr.strip() or "?").splitlines()[-1]
                return Failed(f"cannot install dbos ({' '.join(command)}): {last}")
    if not python.exists():
        return Failed(f"no DBOS Python at {python}")
    probe = subprocess.run(
        [str(python), "-c", "import dbos, psycopg"], capture_output=True, text=True, check=False
    )
    if probe.returncode != 0:
        return Failed(f"{python} cannot import dbos: {probe.stderr.strip().splitlines()[-1]}")
    return python


SYSTEMS = ("treadle PG", "treadle SQLite", "DBOS PG")


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dsn", default=None, help="PostgreSQL DSN (or $TREADLE_BENCH_POSTGRES)")
    parser.add_argument("--steps", type=at_least(1), default=100, help="steps per run at C=--runs")
    parser.add_argument("--runs", type=at_least(1), default=100, help="concurrent runs")
    parser.add_argument("--repeat", type=at_least(1), default=3, help="rounds (medians are shown)")
    parser.add_argument("--dbos-python", default=os.environ.get("TREADLE_BENCH_DBOS_PYTHON"))
    args = parser.parse_args(argv)
    dsn = postgres_dsn(args.dsn)
    python = dbos_python(args.dbos_python)
    load_before = load_note()
    shapes = ((1, args.steps * 5), (args.runs, args.steps))
    results: dict[tuple[str, int], list[Pass | Failed]] = {}
    for _ in range(args.repeat):
        for runs, steps in shapes:
            for system in SYSTEMS:
                if system == "treadle PG":
                    done = treadle_pass("postgres", dsn, runs, steps)
                elif system == "treadle SQLite":
                    done = treadle_pass("sqlite", dsn, runs, steps)
                elif isinstance(python, Path):
                    done = dbos_pass(python, dsn, runs, steps)
                else:
                    done = python
                results.setdefault((system, runs), []).append(done)
    console = Console()
    console.print(figures_table(results, shapes, args.repeat))
    console.print(ratios_table(results, args.runs))
    console.print(
        f"PostgreSQL: {redact_dsn(dsn)}, server defaults (fsync=on, synchronous_commit=on). "
        "CPU: the benchmark process's (all its threads), the server's not included.\n"
        "commits/step: treadle: store.statistics().commits (group commits) / steps. DBOS: "
        "pg_stat_database.xact_commit delta of its own database / steps: every server "
        "transaction, the read-only ones (step-result look-ups, its background polling) "
        "included.\n"
        f"C=1: one run of {args.steps * 5} steps; C={args.runs}: {args.runs} runs of "
        f"{args.steps} steps. Medians of {args.repeat} interleaved rounds (of those that "
        "succeeded).\n"
        f"Machine: {load_before} before, {load_note()} after."
    )
    for line in failures(results):
        console.print(line, style="bold red")


def failures(results: dict[tuple[str, int], list[Pass | Failed]]) -> list[str]:
    """One line per failing system, concurrency and reason, with its rounds."""
    rounds: dict[tuple[str, int, str], list[int]] = {}
    for (system, runs), passes in results.items():
        for number, done in enumerate(passes, 1):
            if isinstance(done, Failed):
                rounds.setdefault((system, runs, done.reason), []).append(number)
    return [
        f"FAILED {system} C={runs}, round {', '.join(map(str, numbers))}: {reason}"
        for (system, runs, reason), numbers in rounds.items()
    ]


def figures_table(
    results: dict[tuple[str, int], list[Pass | Failed]],
    shapes: Sequence[tuple[int, int]],
    repeat: int,
) -> Table:
    table = Table(title=f"durable steps (model call + tool call), median of {repeat}")
    for column in ("system", "C", "steps/s", "min-max", "CPU µs/step", "commits/step"):
        table.add_column(column, justify="left" if column == "system" else "right")
    for system in SYSTEMS:
        for runs, _ in shapes:
            passes = results[(system, runs)]
            done = [p for p in passes if isinstance(p, Pass)]
            if not done:
                reason = next(p.reason for p in passes if isinstance(p, Failed))
                table.add_row(system, str(runs), reason, "", "", "")
                continue
            rates = [p.steps_per_s for p in done]
            commits = [p.commits_per_step for p in done if p.commits_per_step is not None]
            table.add_row(
                system,
                str(runs),
                f"{statistics.median(rates):,.0f}",
                f"{min(rates):,.0f}-{max(rates):,.0f}",
                f"{statistics.median(p.cpu_us_per_step for p in done):,.0f}",
                f"{statistics.median(commits):.3f}" if commits else "",
            )
    return table


def ratios_table(results: dict[tuple[str, int], list[Pass | Failed]], runs: int) -> Table:
    table = Table(title="ratios (median of the rounds' ratios of steps/s)")
    for column in ("ratio", "value", "target", "met", "rounds"):
        table.add_column(column, justify="left" if column == "ratio" else "right")
    for label, top, bottom, target in (
        ("treadle PG C=1 / DBOS C=1", ("treadle PG", 1), ("DBOS PG", 1), 3.0),
        (
            f"treadle PG / SQLite, C={runs}",
            ("treadle PG", runs),
            ("treadle SQLite", runs),
            0.8,
        ),
    ):
        ratios = [
            a.steps_per_s / b.steps_per_s
            for a, b in zip(results[top], results[bottom], strict=True)
            if isinstance(a, Pass) and isinstance(b, Pass)
        ]
        if not ratios:
            table.add_row(label, "none (failed)", f">= {target:g}x", "", "")
            continue
        ratio = statistics.median(ratios)
        rounds = " ".join(f"{r:.2f}" for r in ratios)
        table.add_row(
            label, f"{ratio:.2f}x", f">= {target:g}x", "yes" if ratio >= target else "NO", rounds
        )
    return table


if __name__ == "__main__":
    main()
