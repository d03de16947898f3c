"""Every benchmark command runs, on tiny inputs, and prints its table; and refuses a bad
argument (a count below its least, a store kind it does not measure) before measuring.

The figures are not checked here (they are benchmarks' business, docs/performance.md): only
that each command still works with the library as it is, so none rots unnoticed.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import importlib.util
import json
import logging
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest

BENCHMARKS = Path(__file__).parent.parent / "benchmarks"
ROOT = BENCHMARKS.parent

_spec = importlib.util.spec_from_file_location("_args", BENCHMARKS / "_args.py")
assert _spec is not None and _spec.loader is not None
_args = importlib.util.module_from_spec(_spec)  # the benchmarks' argument types
_spec.loader.exec_module(_args)

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


# --------------------------------------------------------------------------- arguments

REFUSED = {
    "bench_events": {"--runs": "0", "--steps": "0", "--fragments": "0", "--interval": "-1"},
    "bench_fleet": {
        "--runs": "0",
        "--steps": "0",
        "--repeat": "0",
        "--max-running": "0",
        "--lease-ttl": "0.05",
        "--kills": "-1",
    },
    "bench_gateway": {"--tokens": "0", "--calls": "0"},
    "bench_handoff": {"--barriers": "0", "--repeat": "0"},
    "bench_import": {"--repeat": "0"},
    "bench_log_size": {
        "--total": "0",
        "--lengths": "50,0",
        "--stores": "bogus,postgres",
        "--repeat": "0",
    },
    "bench_memory": {"--runs": "0", "--steps": "0", "--repeat": "0"},
    "bench_postgres": {"--steps": "0", "--runs": "0", "--repeat": "0"},
    "bench_resume": {
        "--steps": "-1",
        "--repeat": "0",
        "--stores": "sqlite,memory",
        "--profile": "memory",
    },
    "bench_runtime": {"--steps": "0", "--runs": "-1"},
    "bench_simulation": {"--seeds": "-3"},
    "bench_store": {"--steps": "0", "--runs": "0", "--run-steps": "-1"},
    "bench_stores_before_after": {"--steps": "0", "--runs": "0", "--repeat": "0"},
    "bench_vs_bare": {"--steps": "0", "--runs": "-1", "--repeat": "0"},
    "bench_waiting": {"--runs": "0"},
}
"""Per benchmark command, a value each of its checked options refuses (the first below its
least, or a store kind it does not measure). Not here: _dbos_peer.py, which imports dbos (it
runs in a virtualenv of its own, given what bench_postgres.py checked)."""

CHECKED_TYPES = {"at_least", "seconds", "one_of", "listed"}
"""The argument types of benchmarks/_args.py."""


def _options(script: Path) -> tuple[set[str], set[str]]:
    """The options of ``script`` with a type of `CHECKED_TYPES`, and those typed int or float."""
    checked, unchecked = set(), set()
    for node in ast.walk(ast.parse(script.read_text())):
        if not (isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_argument"):
            continue
        option = node.args[0].value if isinstance(node.args[0], ast.Constant) else "?"
        for keyword in node.keywords:
            if keyword.arg != "type":
                continue
            if isinstance(keyword.value, ast.Name) and keyword.value.id in ("int", "float"):
                unchecked.add(option)
            if isinstance(keyword.value, ast.Call) and getattr(keyword.value.func, "id", "") in (
                CHECKED_TYPES
            ):
                checked.add(option)
    return checked, unchecked


def _command(name: str, monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """The benchmark command ``name`` (a module of benchmarks/), imported in this process."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    return importlib.import_module(name)


def _every_options() -> dict[str, tuple[set[str], set[str]]]:
    """`_options` of every benchmark, parsed in a fresh interpreter.

    CPython 3.11's ``ast.parse`` can fail with "AST constructor recursion depth mismatch" in
    a process whose earlier tests left its recursion bookkeeping off (seen on a test worker
    after thousands of tests); a new process parses the sources as they are.
    """
    code = (
        "import json\n"
        "from tests.test_benchmarks import BENCHMARKS, _options\n"
        "found = {p.stem: _options(p) for p in sorted(BENCHMARKS.glob('*.py'))}\n"
        "print(json.dumps({k: [sorted(c), sorted(u)] for k, (c, u) in found.items()}))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    parsed = json.loads(done.stdout)
    return {name: (set(checked), set(typed)) for name, (checked, typed) in parsed.items()}


def test_every_numeric_option_of_a_benchmark_is_checked() -> None:
    options = _every_options()
    assert {name: typed for name, (_, typed) in options.items() if typed} == {}
    checked = {name: found for name, (found, _) in options.items() if found}
    assert checked.pop("_dbos_peer") == {"--runs", "--steps"}
    assert checked == {name: set(values) for name, values in REFUSED.items()}


@pytest.mark.parametrize(
    ("name", "option"), [(name, option) for name, values in REFUSED.items() for option in values]
)
def test_a_benchmark_refuses_a_bad_value_before_measuring(
    name: str, option: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        _command(name, monkeypatch).main([option, REFUSED[name][option]])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: "), err
    assert f"error: argument {option}: " in err, err


def test_a_count_below_zero_is_refused_where_it_hung(tmp_path: Path) -> None:
    """``--runs -1`` made a ``threading.Barrier(0)``, which waited forever."""
    done = subprocess.run(
        [sys.executable, "bench_vs_bare.py", "--runs", "-1", "--steps", "5", "--repeat", "1"],
        cwd=BENCHMARKS,
        env={**os.environ, "PYTHONPATH": str(ROOT / "src")},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2, done.stderr
    assert "error: argument --runs: must be at least 1, not -1" in done.stderr
    assert done.stdout == ""


def test_an_unknown_store_kind_is_refused_by_name(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """bench_log_size measured any kind but sqlite as JSONL, labelled with the name given."""
    with pytest.raises(SystemExit):
        _command("bench_log_size", monkeypatch).main(["--stores", "jsonl,postgres"])
    err = capsys.readouterr().err
    assert "unknown store kind 'postgres' (known: sqlite, jsonl)" in err


def test_bench_resume_profiles_only_a_store_it_measures(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        _command("bench_resume", monkeypatch).main(["--stores", "sqlite", "--profile", "jsonl"])
    assert exited.value.code == 2
    assert "--profile jsonl: not among --stores sqlite" in capsys.readouterr().err


def test_the_codec_table_is_filled_from_whichever_store_ran(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """It was filled from SQLite's records only: empty when sqlite was not among --stores."""
    bench = _command("bench_log_size", monkeypatch)
    bench.main(["--total", "10", "--lengths", "5", "--stores", "jsonl", "--repeat", "1"])
    out = capsys.readouterr().out
    for kind in ("run_started", "model_intent", "model_result", "action_intent", "step"):
        assert f" {kind} " in out, out


def test_bench_events_shows_the_latency_of_a_single_delta(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """One run of one step of one fragment: one delta, its p99 itself (was StatisticsError)."""
    bench = _command("bench_events", monkeypatch)
    bench.main(["--runs", "1", "--steps", "1", "--fragments", "1", "--interval", "0"])
    rows = [line for line in capsys.readouterr().out.splitlines() if "│  delivery" in line]
    assert len(rows) == 1
    cells = [cell.strip() for cell in rows[0].split("│")[1:-1]]
    assert cells[:3] == ["delivery", "1024", "1"]
    assert cells[3] == cells[4] == cells[5]  # median, p99 and max of one latency


def test_bench_simulation_quiets_the_late_returns_of_injected_stuck_tools(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A `tool_stuck` fault's late return is the fault itself, as in `treadle simulate`."""
    tools = logging.getLogger("treadle.tools")
    bench = _command("bench_simulation", monkeypatch)

    def simulate(seed: int, *, plan: object) -> SimpleNamespace:
        tools.warning("the call (stuck) ended 60.000 s after it started, abandoned")
        return SimpleNamespace(steps=10, ok=True)

    monkeypatch.setattr(bench, "simulate", simulate)
    level = tools.level
    try:
        bench.main(["--seeds", "1"])
    finally:
        tools.setLevel(level)
    assert [r.getMessage() for r in caplog.records if r.name == "treadle.tools"] == []


@pytest.mark.parametrize(
    ("parse", "text", "why"),
    [
        (_args.at_least(1), "0", "must be at least 1, not 0"),
        (_args.at_least(0), "ten", "not a whole number: 'ten'"),
        (_args.at_least(1), "1.5", "not a whole number: '1.5'"),
        (_args.seconds(), "-1", "must be a finite number of seconds >= 0, not '-1'"),
        (_args.seconds(), "nan", "must be a finite number of seconds >= 0, not 'nan'"),
        (_args.seconds(), "inf", "must be a finite number of seconds >= 0, not 'inf'"),
        (_args.seconds(), "soon", "must be a finite number of seconds >= 0, not 'soon'"),
        (_args.seconds(0.1, 3600), "0", "seconds from 0.1 to 3600, not '0'"),
        (_args.one_of("a", "b", what="store kind"), "c", "unknown store kind 'c' (known: a, b)"),
        (_args.listed(_args.at_least(1)), "5,,7", "not a whole number: ''"),
        (_args.listed(_args.at_least(1)), "", "not a whole number: ''"),
    ],
)
def test_an_argument_type_says_why_it_refuses_a_value(
    parse: Callable[[str], object], text: str, why: str
) -> None:
    with pytest.raises(argparse.ArgumentTypeError) as refused:
        parse(text)
    assert str(refused.value) == why or why in str(refused.value)


def test_an_argument_type_takes_the_least_value_and_lists_in_order() -> None:
    assert _args.at_least(0)("0") == 0
    assert _args.seconds()("0") == 0.0
    assert _args.seconds(0.1, 3600)("3600") == 3600.0
    assert _args.listed(_args.at_least(1))("50, 1000,1") == (50, 1000, 1)
    assert _args.listed(_args.one_of("sqlite", "jsonl", what="store kind"))("jsonl") == ("jsonl",)
