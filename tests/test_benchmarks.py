"""Every benchmark command runs, on tiny inputs, and prints its table.

The figures are not checked here (they are benchmarks' business, docs/performance.md): only
that each command still works with the library as it is, so none rots unnoticed.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).parent.parent / "benchmarks"
ROOT = BENCHMARKS.parent

SMALL = {
    "bench_events.py": ["--runs", "3", "--steps", "3", "--fragments", "2", "--interval", "0.001"],
    "bench_gateway.py": ["--calls", "3", "--tokens", "50"],
    "bench_handoff.py": ["--barriers", "200", "--repeat", "1"],
    "bench_import.py": ["--repeat", "1"],
    "bench_log_size.py": ["--total", "100", "--lengths", "20", "--repeat", "1"],
    "bench_memory.py": ["--runs", "3", "--steps", "3", "--repeat", "1"],
    "bench_resume.py": ["--steps", "30", "--repeat", "1"],
    "bench_runtime.py": ["--steps", "5", "--runs", "3"],
    "bench_simulation.py": ["--seeds", "2"],
    "bench_store.py": ["--steps", "20", "--runs", "3", "--run-steps", "5"],
    "bench_vs_bare.py": ["--steps", "4", "--runs", "3", "--repeat", "1"],
    "bench_waiting.py": ["--runs", "5", "--store", "memory"],
}
"""Each benchmark command and tiny arguments for it. Not here: those that need a PostgreSQL
server (bench_fleet.py, bench_postgres.py: below), a git revision to compare with
(bench_stores_before_after.py) or a browser (ui_screenshots.py)."""

NEEDS_POSTGRES = {
    "bench_fleet.py": ["--runs", "3", "--steps", "2", "--repeat", "1", "--kills", "1"],
    "bench_postgres.py": ["--steps", "3", "--runs", "3", "--repeat", "1"],
}


def _run(script: str, args: list[str]) -> None:
    done = subprocess.run(
        [sys.executable, script, *args],
        cwd=BENCHMARKS,
        env={**os.environ, "PYTHONPATH": str(ROOT / "src")},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "┃" in done.stdout, done.stdout[-2000:]  # the table's header row


def test_every_benchmark_command_is_listed() -> None:
    found = {p.name for p in BENCHMARKS.glob("bench_*.py")}
    assert found == set(SMALL) | set(NEEDS_POSTGRES) | {"bench_stores_before_after.py"}


@pytest.mark.parametrize("script", sorted(SMALL))
def test_a_benchmark_runs_on_tiny_inputs(script: str) -> None:
    _run(script, SMALL[script])


@pytest.mark.parametrize("script", sorted(NEEDS_POSTGRES))
def test_a_postgres_benchmark_runs_on_tiny_inputs(script: str, postgres_dsn: str) -> None:
    _run(script, [*NEEDS_POSTGRES[script], "--dsn", postgres_dsn])
