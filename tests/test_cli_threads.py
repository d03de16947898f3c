"""``treadle runs --threads`` and ``treadle show`` on a thread and a fork."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import trio
from click.testing import CliRunner

import treadle
from treadle.cli import main
from treadle.testing.scripted import ScriptedModel, call, say


@treadle.tool
async def add(a: int, b: int) -> int:
    """Add."""
    return a + b


TURNS = [call("add", a=1, b=2, call_id="c1"), say("3"), say("you are welcome")]


def make_thread(path: Path) -> None:
    def agent(turns: list) -> treadle.Agent:
        return treadle.Agent(
            model=ScriptedModel(turns=turns),
            executor=treadle.Toolbox([add]),
            parser=treadle.NativeToolCallParser(),
        )

    async def go() -> None:
        async with treadle.open_sqlite_store(path) as store:
            await treadle.run(agent(TURNS), "1+2?", store=store, run_id="t")
            await treadle.run(agent(TURNS), "thanks", store=store, thread_id="t")
            await treadle.run(
                agent([TURNS[0], say("three")]), store=store, run_id="f", fork_of="t", at_step=2
            )

    trio.run(go)


def test_runs_lists_threads_and_forks(tmp_path: Path) -> None:
    db = tmp_path / "runs.db"
    make_thread(db)
    runner = CliRunner()
    listed = runner.invoke(main, ["runs", "--store", str(db), "--json", "--threads"])
    assert listed.exit_code == 0, listed.output
    rows = {row["run_id"]: row for row in map(json.loads, listed.output.splitlines())}
    picked = {
        run_id: (row["thread"], row["continues"], row["fork_step"]) for run_id, row in rows.items()
    }
    assert picked == {"t": ("t", None, None), "t.2": ("t", "t", None), "f": ("f", "t", 2)}
    plain = runner.invoke(main, ["runs", "--store", str(db), "--json"])
    assert all("thread" not in json.loads(line) for line in plain.output.splitlines())
    table = runner.invoke(main, ["runs", "--store", str(db), "--threads"], env={"COLUMNS": "250"})
    assert table.exit_code == 0, table.output
    assert "thread t, continues t" in table.output and "fork of t at step 2" in table.output


def test_show_says_what_a_run_continues(tmp_path: Path) -> None:
    db = tmp_path / "runs.db"
    make_thread(db)
    runner = CliRunner()
    shown = runner.invoke(main, ["show", "t.2", "--store", str(db)])
    assert shown.exit_code == 0, shown.output
    assert "run t.2 (thread t, continues t)" in shown.output
    assert "thread t, continues t · thanks" in shown.output
    assert "(treadle show t)" in shown.output
    fork = runner.invoke(main, ["show", "f", "--store", str(db)])
    assert "run f (fork of t at step 2)" in fork.output
    root = runner.invoke(main, ["show", "t", "--store", str(db)])
    assert "continues" not in root.output
    events = runner.invoke(main, ["show", "t.2", "--store", str(db), "--json"])
    first = json.loads(events.output.splitlines()[0])
    assert first["kind"] == "run_started"
    assert (first["thread"], first["continues"]) == ("t", "t")


def test_runs_threads_lists_a_damaged_run_with_its_error_among_the_others(tmp_path: Path) -> None:
    """docs/crash-safety.md, "Torn tails and damage": a damaged run never blocks the others."""
    db = tmp_path / "runs.db"
    make_thread(db)
    con = sqlite3.connect(db)  # flip a bit of t's third record: its checksum fails
    (body,) = con.execute("SELECT body FROM records WHERE run_id = 't' AND seq = 3").fetchone()
    damaged = bytearray(body)
    damaged[5] ^= 1
    con.execute("UPDATE records SET body = ? WHERE run_id = 't' AND seq = 3", (bytes(damaged),))
    con.commit()
    con.close()
    runner = CliRunner()
    listed = runner.invoke(main, ["runs", "--store", str(db), "--json", "--threads"])
    assert listed.exit_code == 1
    rows = {row["run_id"]: row for row in map(json.loads, listed.stdout.splitlines())}
    assert list(rows) == ["t", "t.2", "f"]
    assert rows["t"]["state"] is None and "record 3 fails its checksum" in rows["t"]["error"]
    assert (rows["t.2"]["state"], rows["t.2"]["continues"], rows["t.2"]["error"]) == (
        "succeeded",
        "t",
        None,
    )
    assert (rows["f"]["continues"], rows["f"]["fork_step"]) == ("t", 2)
    assert "unreadable run t (SQLite store" in listed.stderr
    table = runner.invoke(main, ["runs", "--store", str(db), "--threads"], env={"COLUMNS": "250"})
    assert table.exit_code == 1
    assert "unreadable" in table.stdout and "fork of t at step 2" in table.stdout
