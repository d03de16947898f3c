"""What every ``treadle`` command does about its terminal (`treadle._terminal`): output on a
terminal whose encoding is not Unicode, Ctrl-C, and a runs table narrower than its cells."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import trio
from click.testing import CliRunner

import treadle
from treadle import cli
from treadle.cli import main
from treadle.testing.scripted import ScriptedModel, call, say

SRC = str(Path(treadle.__file__).resolve().parent.parent)

ANSWER = "答え: 3 " + "x" * 120
"""A final answer Latin-1 cannot encode, long enough for `clip` to cut it."""


@treadle.tool
async def add(a: int, b: int) -> int:
    """Add."""
    return a + b


def _agent(answer: str) -> treadle.Agent:
    return treadle.Agent(
        model=ScriptedModel(turns=[call("add", a=1, b=2), say(answer)]),
        executor=treadle.Toolbox([add]),
        parser=treadle.NativeToolCallParser(),
    )


def make_store(path: Path, run_ids: tuple[str, ...] = ("cli-run",)) -> None:
    async def go() -> None:
        async with treadle.open_sqlite_store(path) as store:
            for run_id in run_ids:
                await treadle.run(_agent(ANSWER), "1+2?", store=store, run_id=run_id)

    trio.run(go)


# -- output on a terminal that is not Unicode -------------------------------------------------


@pytest.mark.parametrize("command", ["show", "tail"])
def test_show_and_tail_print_on_a_latin1_terminal(tmp_path: Path, command: str) -> None:
    # Both ended in a UnicodeEncodeError traceback on "→" under de_DE.ISO-8859-1, even for a
    # run of ASCII text only.
    db = tmp_path / "runs.db"
    make_store(db)
    wide = {"COLUMNS": "160"}  # the answer on one line of the table, whatever the terminal
    done = CliRunner(charset="latin-1", env=wide).invoke(
        main, [command, "cli-run", "--store", str(db)]
    )
    assert done.exit_code == 0, done.output
    assert done.exception is None, done.exception
    assert "-> add" in done.output  # treadle's marks in ASCII
    assert "\\u7b54\\u3048: 3 xxx" in done.output  # what Latin-1 lacks, escaped
    assert "x..." in done.output  # the ellipsis of a clipped text
    assert "→" not in done.output and "…" not in done.output
    if command == "show":
        table = [line for line in done.output.splitlines() if line[:1] in "+|"]
        assert table and table[0].startswith("+---"), done.output  # an ASCII box
        assert len({len(line) for line in table}) == 1, done.output  # escapes measured


def test_show_json_on_a_latin1_terminal_is_json_of_the_same_text(tmp_path: Path) -> None:
    db = tmp_path / "runs.db"
    make_store(db)
    done = CliRunner(charset="latin-1").invoke(
        main, ["show", "cli-run", "--store", str(db), "--json"]
    )
    assert done.exit_code == 0, done.output
    events = [json.loads(line) for line in done.output.splitlines()]
    assert events[-1]["final_answer"] == ANSWER


def test_a_process_with_a_latin1_stdout_prints_show_and_runs(tmp_path: Path) -> None:
    db = tmp_path / "runs.db"
    make_store(db)
    env = {**os.environ, "PYTHONIOENCODING": "latin-1", "PYTHONPATH": SRC, "COLUMNS": "100"}
    for command in (["show", "cli-run"], ["runs"]):
        done = subprocess.run(
            [sys.executable, "-m", "treadle", *command, "--store", str(db)],
            env=env,
            capture_output=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stderr.decode("latin-1")
        assert b"cli-run" in done.stdout and b"Traceback" not in done.stderr


@pytest.mark.parametrize("json_flag", [[], ["--json"]], ids=["table", "json"])
def test_an_ascii_stdout_gets_escapes_from_every_path(tmp_path: Path, json_flag: list[str]) -> None:
    """click takes an ASCII stream for a misconfigured locale and writes UTF-8 past it; the
    escapes reach its lines too (``--json`` goes through ``click.echo``, the table through rich)."""
    db = tmp_path / "runs.db"
    make_store(db)
    env = {**os.environ, "PYTHONIOENCODING": "ascii", "PYTHONPATH": SRC, "COLUMNS": "200"}
    done = subprocess.run(
        [sys.executable, "-m", "treadle", "show", "cli-run", "--store", str(db), *json_flag],
        env=env,
        capture_output=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr.decode("ascii", "backslashreplace")
    assert done.stdout.isascii(), done.stdout[:200]
    assert b"\\u7b54" in done.stdout
    if json_flag:
        answers = [json.loads(line).get("final_answer") for line in done.stdout.splitlines()]
        assert ANSWER in answers


# -- Ctrl-C -----------------------------------------------------------------------------------


def _interrupting(*args: object, **kwargs: object) -> object:
    raise KeyboardInterrupt


COMMANDS_WAITING = [
    (["runs"], "interrupted\n"),
    (["show", "r"], "interrupted\n"),
    (["tail", "r"], "interrupted: stopped following run r, which is left as it was\n"),
    (["wait", "r"], "interrupted: stopped waiting for run r, which is left as it was\n"),
    (["approve", "r"], "interrupted\n"),
    (["cancel", "r"], "interrupted\n"),
    (["submit", "--agent", "a", "hi"], "interrupted\n"),
    (["unquarantine", "r"], "interrupted\n"),
    (["repair", "r"], "interrupted\n"),
    (
        ["resume", "r", "--agent", "json:dumps"],
        "interrupted: r is left unfinished and resumable; nothing it finished is repeated "
        "when it is resumed again\n",
    ),
]


@pytest.mark.parametrize(("command", "said"), COMMANDS_WAITING, ids=lambda c: str(c))
def test_ctrl_c_ends_every_command_with_status_130_and_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, command: list[str], said: str
) -> None:
    # Click printed "Aborted!" and exited 1, which `treadle wait` says means the run did not
    # succeed; `treadle tail` exited 0 without a word.
    monkeypatch.setattr(trio, "run", _interrupting)  # Ctrl-C while the command waits
    store = ["--store", str(tmp_path / "runs.db")]
    done = CliRunner().invoke(main, [*command, *store])
    assert done.exit_code == 130, (done.output, done.exception)
    assert done.stderr == said
    assert done.stdout == ""


def test_ctrl_c_while_a_command_loads_is_status_130(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "slow").mkdir()
    (tmp_path / "slow" / "__init__.py").write_text("")
    (tmp_path / "slow" / "command.py").write_text("raise KeyboardInterrupt  # as it loads\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(cli.COMMANDS, "slow", cli.Entry("slow.command", "command", "Slow."))
    done = CliRunner().invoke(main, ["slow"])
    assert (done.exit_code, done.stderr) == (130, "interrupted\n"), done.output


def test_ctrl_c_as_resume_starts_says_the_run_is_left_resumable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from treadle import _cli_store

    monkeypatch.setattr(_cli_store, "import_spec", _interrupting)  # loading the agent
    done = CliRunner().invoke(
        main, ["resume", "r", "--store", str(tmp_path / "runs.db"), "--agent", "json:dumps"]
    )
    assert done.exit_code == 130, done.output
    assert done.stderr.startswith("interrupted: r is left unfinished and resumable")


@pytest.mark.parametrize("as_json", [False, True])
def test_ctrl_c_in_simulate_reports_the_seeds_simulated(
    monkeypatch: pytest.MonkeyPatch, as_json: bool
) -> None:
    # It exited 1 ("a seed failed") and the seeds already simulated were not reported.
    from treadle.testing import simulation

    real = simulation.simulate
    calls: list[int] = []

    def two_then_ctrl_c(seed: int, **kwargs: object) -> simulation.SimulationResult:
        calls.append(seed)
        if len(calls) > 2:
            raise KeyboardInterrupt
        return real(seed, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(simulation, "simulate", two_then_ctrl_c)
    args = ["simulate", "--from", "7", "--seeds", "5", "--steps", "2", "--faults", "none"]
    done = CliRunner(env={"COLUMNS": "80"}).invoke(main, args + ["--json"] * as_json)
    assert done.exit_code == 130, (done.output, done.exception)
    assert re.search(r"│\s+2 │\s+\d+ │\s+0 │", done.stderr), done.stderr  # seeds, steps, failing
    assert done.stderr.endswith(
        "interrupted: seeds 7 to 8 simulated, 2 of 5; to go on from the next: --from 9 --seeds 3\n"
    )
    lines = done.stdout.splitlines()
    assert [json.loads(line)["seed"] for line in lines] == ([7, 8] if as_json else [])


def test_sigint_stops_tail_following_a_queued_run(tmp_path: Path) -> None:
    db = tmp_path / "runs.db"
    env = {**os.environ, "PYTHONPATH": SRC, "PYTHONUNBUFFERED": "1"}
    base = [sys.executable, "-m", "treadle"]
    submit = [*base, "submit", "--store", str(db), "--agent", "nobody", "--run-id", "q", "hi"]
    subprocess.run(submit, env=env, check=True, capture_output=True, timeout=120)
    child = subprocess.Popen(
        [*base, "tail", "q", "--store", str(db)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        assert child.stdout is not None
        first = child.stdout.readline()  # it says nobody drives the run: it follows it now
        assert b"nobody drives run q" in first, first
        child.send_signal(signal.SIGINT)
        out, err = child.communicate(timeout=60)
    finally:
        if child.poll() is None:
            child.kill()
    assert child.returncode == 130, (out, err)
    assert err == b"interrupted: stopped following run q, which is left as it was\n"


# -- the runs table on a narrow terminal ------------------------------------------------------


@pytest.mark.parametrize("width", [20, 40, 60, 80, 100, 160])
def test_the_runs_table_never_cuts_run_ids_states_or_start_times(
    tmp_path: Path, width: int
) -> None:
    # rich shrank the no-wrap columns anyway: at 40 columns "cli-run" showed as "cli", the
    # start times as "2026-" and the states not at all.
    db = tmp_path / "runs.db"
    make_store(db, ("cli-run", "a-much-longer-run-identifier-01"))
    runner = CliRunner(env={"COLUMNS": str(width)})
    submitted = runner.invoke(
        main, ["submit", "--store", str(db), "--agent", "calc", "--run-id", "q", "hi"]
    )
    assert submitted.exit_code == 0, submitted.output
    listed = runner.invoke(main, ["runs", "--store", str(db), "--json"])
    rows = [json.loads(line) for line in listed.output.splitlines()]
    table = runner.invoke(main, ["runs", "--store", str(db)])
    assert table.exit_code == 0, table.output
    lines = table.stdout.splitlines()
    for row in rows:
        (line,) = [line for line in lines if line.startswith(f"│ {row['run_id']} ")]
        assert f"│ {row['state']} " in line, table.stdout
        if row["started"] is not None:
            assert f"│ {row['started'][:19].replace('T', ' ')} │" in line, table.stdout
    header = next(line for line in lines if line.startswith("┃"))
    shown = [name.strip() for name in header.strip("┃").split("┃")]
    hidden = [c for c in ("agent", "stop reason", "steps", "driven by") if c not in shown]
    if hidden:
        caption = " ".join(" ".join(lines).split())
        assert f"not shown in {width} columns: {', '.join(hidden)}" in caption, table.stdout
    else:
        assert "not shown" not in table.stdout
    if width >= 80:  # the run ids, states and start times fit: so does the table
        assert max(len(line) for line in lines) <= width, table.stdout
