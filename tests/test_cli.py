from __future__ import annotations

import contextlib
import json
import re
import sqlite3
import subprocess
import sys
import types
from collections.abc import Iterator
from pathlib import Path

import attrs
import click
import pytest
import trio
from click.testing import CliRunner
from rich.console import Console
from rich.table import Table

import treadle
from treadle import _cli_store
from treadle.cli import main
from treadle.testing.loopback import CannedResponse, canned, open_loopback_server
from treadle.testing.scripted import ScriptedModel, call, say

CASES = Path(__file__).resolve().parent / "fixtures" / "cases"


@treadle.tool
async def add(a: int, b: int) -> int:
    """Add."""
    return a + b


def make_store(path: Path) -> None:
    async def go():
        agent = treadle.Agent(
            model=ScriptedModel(turns=[call("add", a=1, b=2), say("3")]),
            executor=treadle.Toolbox([add]),
            parser=treadle.NativeToolCallParser(),
        )
        async with treadle.open_sqlite_store(path) as store:
            await treadle.run(agent, "1+2?", store=store, run_id="cli-run")

    trio.run(go)


def test_runs_and_show(tmp_path):
    db = tmp_path / "runs.db"
    make_store(db)
    runner = CliRunner()
    listed = runner.invoke(main, ["runs", "--store", str(db), "--json"])
    assert listed.exit_code == 0, listed.output
    (row,) = [json.loads(line) for line in listed.output.splitlines()]
    assert row["run_id"] == "cli-run" and row["state"] == "succeeded" and row["steps"] == 2
    shown = runner.invoke(main, ["show", "cli-run", "--store", str(db)])
    assert shown.exit_code == 0, shown.output
    assert "run finished" in shown.output and "add" in shown.output
    records = runner.invoke(main, ["show", "cli-run", "--store", str(db), "--json"])
    kinds = [json.loads(line)["kind"] for line in records.output.splitlines()]
    assert kinds[0] == "run_started" and kinds[-1] == "run_finished"


def test_a_late_result_is_shown_as_one_the_run_stopped_waiting_for():
    """Every late result was shown "(late, not applied)", also one abandoned at its timeout
    whose observation the model was given before the run went on."""
    from treadle._cli_common import describe
    from treadle.types import ActionOutcome, ActionResult, ActionStatus

    abandoned = ActionResult(
        run_id="r",
        step=1,
        intent_id="r/s1/a1",
        call_id="c1",
        tool="slow",
        outcome=ActionOutcome(status=ActionStatus.UNKNOWN, observation="abandoned"),
        ts="2025-01-01T00:00:00+00:00",
        late=True,
    )
    assert describe(abandoned) == (
        "action finished",
        "slow unknown (late: the run stopped waiting for it): abandoned",
    )
    assert describe(attrs.evolve(abandoned, late=False))[1] == "slow unknown: abandoned"


def shown_seqs(output: str) -> list[int]:
    """The seq of each table row ``treadle show`` printed, in order."""
    cells = [line.strip("│ ").split(" ", 1)[0] for line in output.splitlines()]
    return [int(cell) for cell in cells if cell.isdigit()]


def test_show_prints_a_long_run_as_tables_of_bounded_rows(tmp_path, monkeypatch):
    """``treadle show`` of a 10,000-step run rendered one table of 50,000 rows: 270 MB, and
    nothing printed for minutes. Now each table holds at most `SHOW_TABLE_ROWS` records and
    is printed as soon as it is rendered; a shorter run prints one table, as before."""
    db = tmp_path / "runs.db"
    make_store(db)
    printed: list[int] = []

    class Counting(Console):
        def print(self, *objects, **kwargs):
            printed.extend(o.row_count for o in objects if isinstance(o, Table))
            super().print(*objects, **kwargs)

    monkeypatch.setattr(_cli_store, "table_console", lambda: Counting(width=100))
    whole = CliRunner().invoke(main, ["show", "cli-run", "--store", str(db)])
    assert whole.exit_code == 0, whole.output
    count = len(shown_seqs(whole.output))
    assert printed == [count] and whole.output.count("┃ seq") == 1
    assert shown_seqs(whole.output) == list(range(1, count + 1))
    printed.clear()
    monkeypatch.setattr(_cli_store, "SHOW_TABLE_ROWS", 4, raising=False)
    parts = CliRunner().invoke(main, ["show", "cli-run", "--store", str(db)])
    assert parts.exit_code == 0, parts.output
    assert printed == [4] * (count // 4) + ([count % 4] if count % 4 else [])
    assert shown_seqs(parts.output) == list(range(1, count + 1))
    assert parts.output.count("run cli-run") == 1  # the first table's title only


def test_show_last_and_from_print_part_of_a_run(tmp_path):
    db = tmp_path / "runs.db"
    make_store(db)
    runner = CliRunner()

    async def read_log():
        async with treadle.open_sqlite_store(db) as store:
            return await store.read_log("cli-run")

    log = trio.run(read_log)
    count = len(log.records)
    last = runner.invoke(main, ["show", "cli-run", "--store", str(db), "--last", "3"])
    assert last.exit_code == 0, last.output
    assert shown_seqs(last.output) == [count - 2, count - 1, count]
    assert f"run cli-run (records {count - 2}-{count} of {count})" in last.output
    assert "run finished" in last.output and "run started" not in last.output
    tail = runner.invoke(main, ["show", "cli-run", "--store", str(db), "--from", "5", "--json"])
    assert tail.exit_code == 0, tail.output
    from treadle.actors import stored_events

    expected = [(e.seq, e.kind.value) for e in stored_events(log, 5, count)]
    rows = [json.loads(line) for line in tail.output.splitlines()]
    assert [(r["seq"], r["kind"]) for r in rows] == expected and rows[0]["seq"] == 5
    everything = runner.invoke(main, ["show", "cli-run", "--store", str(db), "--last", "999"])
    assert shown_seqs(everything.output) == list(range(1, count + 1))
    past = runner.invoke(main, ["show", "cli-run", "--store", str(db), "--from", str(count + 1)])
    assert past.exit_code == 1 and f"has {count} records: none from seq {count + 1}" in past.output
    both = runner.invoke(
        main, ["show", "cli-run", "--store", str(db), "--from", "2", "--last", "1"]
    )
    assert both.exit_code == 2 and "--last and --from" in both.output


def test_runs_last_lists_only_the_newest_runs(tmp_path, monkeypatch):
    # A store of 20,000 runs took 72 s to list (the table is drawn row by row) with no way
    # to ask for fewer.
    db = tmp_path / "runs.db"

    async def three() -> None:
        async with treadle.open_sqlite_store(db) as store:
            for number in range(3):
                agent = treadle.Agent(
                    model=ScriptedModel(turns=[say("3")]),
                    executor=treadle.Toolbox([add]),
                    parser=treadle.NativeToolCallParser(),
                )
                await treadle.run(agent, "1+2?", store=store, run_id=f"r{number}")

    trio.run(three)
    runner = CliRunner(env={"COLUMNS": "120"})
    listed = runner.invoke(main, ["runs", "--store", str(db), "--json", "--last", "2"])
    assert listed.exit_code == 0, listed.output
    assert [json.loads(line)["run_id"] for line in listed.output.splitlines()] == ["r1", "r2"]
    table = runner.invoke(main, ["runs", "--store", str(db), "--last", "1"])
    assert table.exit_code == 0, table.output
    assert "r2" in table.output and "r1" not in table.output and "r0" not in table.output
    # beyond any SQL integer: SQLite refused it ("datatype mismatch") as if the store were broken
    every = runner.invoke(main, ["runs", "--store", str(db), "--json", "--last", str(2**64)])
    assert every.exit_code == 0, every.output
    assert [json.loads(line)["run_id"] for line in every.output.splitlines()] == ["r0", "r1", "r2"]
    refused = runner.invoke(main, ["runs", "--store", str(db), "--last", "0"])
    assert refused.exit_code == 2 and "--last" in refused.output
    monkeypatch.setattr(_cli_store, "LONG_TABLE", 2)  # a long table says how to get a short one
    long = runner.invoke(main, ["runs", "--store", str(db)])
    assert "3 runs: drawing the table takes a while (--last N" in long.stderr
    assert (
        "r0" in long.stdout
        and "drawing" not in runner.invoke(main, ["runs", "--store", str(db), "--last", "2"]).stderr
    )


def test_runs_last_reads_only_the_newest_runs_of_a_jsonl_store(tmp_path, monkeypatch):
    # `treadle runs --last 20` probed every run file of a JSONL store (head and tail read and
    # decoded) before keeping the last 20: 30 s for 10,000 runs.
    from treadle.stores import jsonl

    directory = tmp_path / "runs"

    async def four() -> None:
        async with treadle.open_jsonl_store(directory) as store:
            for number in range(4):
                agent = treadle.Agent(
                    model=ScriptedModel(turns=[say("3")]),
                    executor=treadle.Toolbox([add]),
                    parser=treadle.NativeToolCallParser(),
                )
                await treadle.run(agent, "1+2?", store=store, run_id=f"r{number}")

    trio.run(four)
    probed = []
    probe = jsonl.probe_run_file
    monkeypatch.setattr(jsonl, "probe_run_file", lambda path: probed.append(path) or probe(path))
    listed = CliRunner().invoke(main, ["runs", "--store", str(directory), "--json", "--last", "2"])
    assert listed.exit_code == 0, listed.output
    assert [json.loads(line)["run_id"] for line in listed.output.splitlines()] == ["r2", "r3"]
    assert sorted(Path(path).name for path in probed) == ["r2.jsonl", "r3.jsonl"]


def test_the_runs_table_of_finished_runs_fits_80_columns(tmp_path):
    # Finished runs have no driver, and a run not served by a fleet names no agent: the two
    # empty columns made the start time wrap onto a second line at 80 columns.
    db = tmp_path / "runs.db"
    make_store(db)
    table = CliRunner(env={"COLUMNS": "80"}).invoke(main, ["runs", "--store", str(db)])
    assert table.exit_code == 0, table.output
    lines = table.output.splitlines()
    (header,) = [line for line in lines if line.startswith("┃")]
    (row,) = [line for line in lines if line.startswith("│")]  # one line: nothing wrapped
    assert "driven by" not in header and "agent" not in header
    assert "started" in header and "stop reason" in header and "cli-run" in row
    assert re.search(r"│ \d{4}-\d\d-\d\d \d\d:\d\d:\d\d │$", row), table.output


def test_the_runs_tables_title_names_a_store_path_holding_brackets_as_it_is(tmp_path):
    # The title was read as rich markup: `runs in logs[red]/runs[bold].db` was shown as
    # `runs in logs/runs.db`, naming a store that is not the one listed.
    db = tmp_path / "logs[red]" / "runs[bold].db"
    db.parent.mkdir()
    make_store(db)
    table = CliRunner().invoke(main, ["runs", "--store", str(db)])
    assert table.exit_code == 0, table.output
    assert f"runsin{db}" in "".join(table.output.split())  # however the title wraps


def test_reading_commands_refuse_a_folder_or_file_that_holds_no_store(tmp_path):
    # `treadle runs --store .` in a project folder made .control/ and .leases/ in it and
    # listed the project's own .jsonl files as damaged runs, which `treadle repair` would
    # then empty; an empty file got treadle's tables written into it.
    folder = tmp_path / "project"
    folder.mkdir()
    (folder / "ledger.jsonl").write_text('{"a": 1}\n')
    empty = tmp_path / "empty.db"
    empty.touch()
    runner = CliRunner()
    for command in (["runs"], ["show", "ledger"], ["repair", "ledger"]):
        refused = runner.invoke(main, [*command, "--store", str(folder)])
        assert refused.exit_code == 1 and "holds no JSONL store" in refused.output, command
    assert sorted(p.name for p in folder.iterdir()) == ["ledger.jsonl"]
    assert (folder / "ledger.jsonl").read_text() == '{"a": 1}\n'
    refused = runner.invoke(main, ["runs", "--store", str(empty)])
    assert refused.exit_code == 1 and "the file is empty" in refused.output
    assert empty.stat().st_size == 0


@pytest.mark.parametrize("command", [["runs"], ["show", "r1"], ["cancel", "r1"], ["repair", "r1"]])
def test_reading_commands_leave_a_sqlite_database_without_tables_as_it_was(
    tmp_path: Path, command: list[str]
):
    # `treadle runs --store other.db` laid treadle's tables out in a SQLite database of
    # another program that held none yet, and exited 0 with an empty table.
    path = tmp_path / "other.db"
    conn = sqlite3.connect(path)
    conn.execute("PRAGMA user_version = 7")
    conn.close()
    before = path.read_bytes()
    refused = CliRunner().invoke(main, [*command, "--store", str(path)])
    assert refused.exit_code == 1, refused.output
    assert f"no store at {path}: the SQLite database holds no treadle tables" in refused.output
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other.db"]


def answered_once(opener, run_id: str) -> None:
    """Run ``run_id`` to its answer, one model call, in the store ``opener()`` opens."""

    async def go() -> None:
        agent = treadle.Agent(
            model=ScriptedModel(turns=[say("done")]),
            executor=treadle.Toolbox([add]),
            parser=treadle.NativeToolCallParser(),
        )
        async with opener() as store:
            await treadle.run(agent, "go", store=store, run_id=run_id)

    trio.run(go)


def test_a_piped_runs_table_is_not_cut_at_80_columns(tmp_path):
    # Piped (no terminal, no $COLUMNS), rich laid the table out for 80 columns: a long run
    # id and the start time were cut short. A pipe gets the whole row.
    db = tmp_path / "runs.db"
    run_id = "a-run-id-long-enough-to-need-more-than-eighty-columns-in-the-table"

    answered_once(lambda: treadle.open_sqlite_store(db), run_id)
    table = CliRunner(env={"COLUMNS": None}).invoke(main, ["runs", "--store", str(db)])
    assert table.exit_code == 0, table.output
    (row,) = [line for line in table.output.splitlines() if line.startswith("│")]
    assert run_id in row and re.search(r"│ \d{4}-\d\d-\d\d \d\d:\d\d:\d\d │$", row), row


def test_a_damaged_run_listed_by_its_hashed_file_name_can_be_named_by_it(tmp_path):
    # A long run id's JSONL file is named by its hash; with its header damaged, `treadle
    # runs` lists it under that name, which every command refused as an invalid run id.
    directory = tmp_path / "runs"
    run_id = "A" * 150

    answered_once(lambda: treadle.open_jsonl_store(directory), run_id)
    (path,) = directory.glob("~*.jsonl")
    data = bytearray(path.read_bytes())
    data[20] = ord("X")
    path.write_bytes(bytes(data))
    name = path.stem
    listed = CliRunner().invoke(main, ["runs", "--store", str(directory)])
    assert name in listed.output
    for command in (["show", name], ["repair", name]):
        named = CliRunner().invoke(main, [*command, "--store", str(directory)])
        assert named.exit_code == 1 and "invalid run id" not in named.output, named.output
        assert "no treadle header" in named.output or "damaged" in named.output, named.output
    assert bytes(data) == path.read_bytes()  # a refused repair changed nothing


def test_approve_with_both_reject_and_edit_is_a_usage_error(tmp_path):
    # It exited 1, as a refused decision does, while --edit with no JSON object and every
    # other misuse of the options exits 2.
    db = tmp_path / "runs.db"
    make_store(db)
    runner = CliRunner()
    arguments = ["approve", "cli-run", "--store", str(db)]
    both = runner.invoke(main, [*arguments, "--edit", "{}", "--reject", "no"])
    assert both.exit_code == 2 and "--reject or --edit, not both" in both.output, both.output
    not_json = runner.invoke(main, [*arguments, "--edit", "x"])
    assert not_json.exit_code == 2, not_json.output
    finished = runner.invoke(main, [*arguments, "--reject", "no"])  # the run's state refuses
    assert finished.exit_code == 1 and "already finished" in finished.output, finished.output


def test_an_empty_store_option_is_a_usage_error():
    # `--store ''` (or an empty $TREADLE_STORE) ended in a FileNotFoundError traceback.
    refused = CliRunner().invoke(main, ["runs", "--store", ""])
    assert refused.exit_code == 2 and "is empty" in refused.output
    assert refused.exception is None or isinstance(refused.exception, SystemExit)


@pytest.mark.parametrize(
    ("change", "said"),
    [
        ("UPDATE meta SET value = 'abc' WHERE key = 'layout'", "holds the layout 'abc'"),
        ("UPDATE runs SET steps = 'many'", "damaged index row: invalid literal"),
        (
            "UPDATE runs SET lease_generation = 1, lease_owner = 'x', lease_expires = 'soon', "
            "lease_heartbeat = 0",
            "its lease is unreadable",
        ),
    ],
)
def test_index_columns_changed_by_hand_are_named_not_a_traceback(tmp_path, change, said):
    db = tmp_path / "runs.db"
    make_store(db)
    conn = sqlite3.connect(db)
    conn.execute(change)
    conn.commit()
    conn.close()
    listed = CliRunner().invoke(main, ["runs", "--store", str(db)])
    assert listed.exit_code == 1 and said in listed.output
    assert not isinstance(listed.exception, ValueError | TypeError)


def test_show_unknown_run_and_missing_store_are_clear_errors(tmp_path):
    runner = CliRunner()
    missing = runner.invoke(main, ["runs", "--store", str(tmp_path / "nope.db")])
    assert missing.exit_code != 0 and "no store at" in missing.output
    db = tmp_path / "runs.db"
    make_store(db)
    unknown = runner.invoke(main, ["show", "other", "--store", str(db)])
    assert unknown.exit_code != 0 and "no run 'other'" in unknown.output


@pytest.mark.parametrize("kind", ["jsonl", "sqlite"])
def test_a_store_folder_that_cannot_be_searched_is_a_clear_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    """A store folder made mode 000: every command ended in the traceback of a PermissionError
    (Python 3.11's Path.is_dir raises it), and open_sqlite_store raised it raw."""
    import os

    folder = tmp_path / "locked"
    folder.mkdir()
    store = folder / "s.db" if kind == "sqlite" else folder
    if kind == "sqlite":
        make_store(store)
    else:

        async def go() -> None:
            async with treadle.open_jsonl_store(store):
                pass

        trio.run(go)
    stat = os.stat

    def unsearchable(name, *args, **kwargs):  # the folder's entries cannot be looked at
        if str(name).startswith(f"{folder}{os.sep}"):
            raise PermissionError(13, "Permission denied", str(name))
        return stat(name, *args, **kwargs)

    monkeypatch.setattr(os, "stat", unsearchable)
    for command in (["runs"], ["show", "cli-run"], ["cancel", "cli-run"]):
        result = CliRunner().invoke(main, [*command, "--store", str(store)])
        assert result.exit_code == 1 and "Permission denied" in result.output, command
        assert isinstance(result.exception, SystemExit), command  # said, not a traceback

    async def open_it() -> None:
        opener = treadle.open_sqlite_store if kind == "sqlite" else treadle.open_jsonl_store
        async with opener(store):
            pass

    with pytest.raises(treadle.StoreError, match="Permission denied") as info:
        trio.run(open_it)
    assert isinstance(info.value.__cause__, PermissionError)


async def test_probe_prints_the_assembled_reply_with_decision(tmp_path):
    body = (CASES / "08-parallel-toolcalls-interleaved.sse").read_bytes()
    tools = tmp_path / "tools.json"
    tools.write_text(
        json.dumps(
            [
                {
                    "name": "get_weather",
                    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
                },
                {
                    "name": "get_local_time",
                    "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}},
                },
            ]
        )
    )
    response = CannedResponse(headers={"content-type": "text/event-stream"}, chunks=[body])
    async with open_loopback_server(canned(response)) as server:
        done = await trio.run_process(
            [
                sys.executable,
                "-m",
                "treadle",
                "probe",
                "--base-url",
                server.base_url,
                "--model",
                "m",
                "--tools",
                str(tools),
                "--json",
            ],
            capture_stdout=True,
            capture_stderr=True,
            check=False,
        )
        assert done.returncode == 0, done.stderr.decode()
        report = json.loads(done.stdout)
        sent = server.requests[0].json()
    assert [c["name"] for c in report["tool_calls"]] == ["get_weather", "get_local_time"]
    assert report["error"] is None and set(report["usage"].values()) == {None}
    assert report["decision"]["kind"] == "actions"
    assert sent["stream"] is True and sent["tools"][0]["function"]["name"] == "get_weather"


async def test_probe_reports_a_classified_error_and_keeps_the_key_out(tmp_path):
    body = (CASES / "20-http429-retry-after-seconds.body").read_bytes()
    response = CannedResponse(
        status=429, headers={"content-type": "application/json", "retry-after": "0"}, chunks=[body]
    )
    async with open_loopback_server(canned(response)) as server:
        done = await trio.run_process(
            [
                sys.executable,
                "-m",
                "treadle",
                "probe",
                "--base-url",
                server.base_url,
                "--model",
                "m",
                "--api-key-env",
                "PROBE_KEY",
                "--max-attempts",
                "2",
                "--json",
            ],
            capture_stdout=True,
            capture_stderr=True,
            check=False,
            env={**__import__("os").environ, "PROBE_KEY": "sk-secret-123"},
        )
    report = json.loads(done.stdout)
    assert done.returncode == 1  # the endpoint call failed
    assert report["error"]["kind"] == "rate_limited" and report["error"]["retryable"] is True
    assert report["error"]["status"] == 429 and report["error"]["message"]
    assert "sk-secret-123" not in done.stdout.decode() + done.stderr.decode()
    assert len(server.requests) == 2
    assert server.requests[0].header("authorization") == "Bearer sk-secret-123"


def test_module_entry_point_runs():
    done = subprocess.run(
        [sys.executable, "-m", "treadle", "--help"], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0 and "probe" in done.stdout


def _help_texts(command: click.Command, path: tuple[str, ...]) -> Iterator[tuple[str, str]]:
    """``(command path, its --help text)`` for ``command`` and every command under it."""
    context = click.Context(command, info_name=" ".join(path))
    yield " ".join(path), command.get_help(context)
    if isinstance(command, click.Group):
        for name in command.list_commands(context):
            found = command.get_command(context, name)
            assert found is not None
            yield from _help_texts(found, (*path, name))


def test_help_texts_show_no_docstring_markup():
    # A command's help is its docstring: reST's ``literal`` and `reference` marks, which the
    # API docs render, show up raw in a terminal.
    texts = dict(_help_texts(main, ("treadle",)))
    assert len(texts) > 10
    marked = {name: text for name, text in texts.items() if "`" in text}
    assert marked == {}


def test_runs_lists_runs_of_a_jsonl_store_without_control_logs_and_shows_waiting_runs(tmp_path):
    from treadle.approvals import request_cancel

    @treadle.tool(requires_approval=True)
    async def wire(amount: int) -> str:
        """Send money."""
        return "sent"

    directory = tmp_path / "runs"

    async def go():
        agent = treadle.Agent(
            model=ScriptedModel(turns=[call("wire", amount=5), say("done")]),
            executor=treadle.Toolbox([wire]),
            parser=treadle.NativeToolCallParser(),
        )
        async with treadle.open_jsonl_store(directory) as store:
            with trio.CancelScope() as scope:  # the driving process goes away mid-wait
                async with treadle.open_run(agent, "pay", store=store, run_id="waiting") as handle:
                    async with contextlib.aclosing(handle.events()) as events:
                        async for event in events:
                            if event.kind is treadle.EventKind.APPROVAL_REQUESTED:
                                break
                    scope.cancel()
            await request_cancel(store, "waiting", reason="from elsewhere")  # a control log

    trio.run(go)
    listed = CliRunner().invoke(main, ["runs", "--store", str(directory), "--json"])
    assert listed.exit_code == 0, listed.output
    rows = [json.loads(line) for line in listed.output.splitlines()]
    assert [(row["run_id"], row["state"]) for row in rows] == [("waiting", "awaiting_approval")]


class FailingSink:
    async def send(self, event):
        raise RuntimeError("sink is down")


def test_show_reports_the_sink_failures_of_a_finished_run(tmp_path):
    db = tmp_path / "runs.db"

    async def go():
        agent = treadle.Agent(
            model=ScriptedModel(turns=[call("add", a=1, b=2), say("3")]),
            executor=treadle.Toolbox([add]),
            parser=treadle.NativeToolCallParser(),
        )
        async with treadle.open_sqlite_store(db) as store:
            await treadle.run(agent, "1+2?", store=store, run_id="r", sinks=[FailingSink()])
            return (await store.read_log("r")).finished

    finished = trio.run(go)
    # The events handed to the sink before run-finished raised; the sink's own task may
    # not have reached the last of them yet (11 events precede run-finished).
    assert 1 <= finished.sink_failures <= 11 and finished.sink_drops == 0
    shown = CliRunner().invoke(main, ["show", "r", "--store", str(db)], env={"COLUMNS": "200"})
    assert shown.exit_code == 0, shown.output
    one = finished.sink_failures == 1
    assert f"{finished.sink_failures} sink failure{'' if one else 's'}" in shown.output


def test_counts_of_one_are_singular(tmp_path):
    """ "1 steps" read wrong (issue 13 item 6): the run shown took one step."""
    db = tmp_path / "runs.db"

    async def go():
        agent = treadle.Agent(
            model=ScriptedModel(turns=[say("hi")]),
            executor=treadle.Toolbox([add]),
            parser=treadle.NativeToolCallParser(),
        )
        async with treadle.open_sqlite_store(db) as store:
            return await treadle.run(agent, "hello", store=store, run_id="one")

    assert trio.run(go).state.value == "succeeded"
    shown = CliRunner().invoke(main, ["show", "one", "--store", str(db)], env={"COLUMNS": "200"})
    assert shown.exit_code == 0, shown.output
    assert "1 step" in shown.output and "1 steps" not in shown.output


def test_tail_marks_where_each_step_starts(tmp_path):
    db = tmp_path / "runs.db"
    make_store(db)
    tailed = CliRunner().invoke(main, ["tail", "cli-run", "--store", str(db)])
    assert tailed.exit_code == 0, tailed.output
    lines = tailed.output.splitlines()
    starts = [i for i, line in enumerate(lines) if line.split()[1:] == ["step", "started"]]
    assert [lines[i].split()[0] for i in starts] == ["1", "2"]
    assert all("model call" in lines[i + 1] for i in starts)


def test_tail_from_past_the_end_of_a_finished_run_says_so_as_show_does(tmp_path):
    # `tail --from N` past a finished run's last record printed nothing and exited 0, while
    # `show --from N` (which docs/events.md says takes the same --from) said why, exit 1.
    db = tmp_path / "runs.db"
    make_store(db)

    async def records() -> int:
        async with treadle.open_sqlite_store(db) as store:
            return len((await store.read_log("cli-run")).records)

    count = trio.run(records)
    for follow in ("--follow", "--no-follow"):
        past = CliRunner().invoke(
            main, ["tail", "cli-run", "--store", str(db), "--from", str(count + 1), follow]
        )
        assert past.exit_code == 1, past.output
        assert f"run cli-run has {count} records: none from seq {count + 1}" in past.output
    last = CliRunner().invoke(main, ["tail", "cli-run", "--store", str(db), "--from", str(count)])
    assert last.exit_code == 0 and "run finished" in last.output, last.output


def test_show_and_tail_json_speak_the_event_vocabulary(tmp_path):
    """Issue 13 item 4: ``tail --json`` printed record kinds (``model_intent``, ``step``) and no
    ``step_started``; the Python API and docs/events.md use event kinds. Both commands now
    print exactly what ``handle.events()`` yields."""
    db = tmp_path / "runs.db"
    make_store(db)
    runner = CliRunner()

    async def api_events():
        async with treadle.open_sqlite_store(db) as store:
            log = await store.read_log("cli-run")
        from treadle.actors import stored_events

        return [(e.seq, e.kind.value) for e in stored_events(log, 1, len(log.records))]

    expected = trio.run(api_events)
    assert "step_started" in {kind for _, kind in expected}
    for command in (["show", "cli-run"], ["tail", "cli-run", "--no-follow"]):
        out = runner.invoke(main, [*command, "--store", str(db), "--json"])
        assert out.exit_code == 0, out.output
        rows = [json.loads(line) for line in out.output.splitlines()]
        assert [(r["seq"], r["kind"]) for r in rows] == expected, command
        assert {r["run_id"] for r in rows} == {"cli-run"}  # step-started events' too
        kinds = {r["kind"] for r in rows}
        assert not kinds & {"model_intent", "model_result", "step", "action_intent"}
        assert kinds <= {k.value for k in treadle.EventKind}


def test_tail_json_keeps_its_notes_off_stdout(tmp_path):
    """``tail --json`` printed "nobody drives run ..." and approval hints among the events on
    stdout: a JSON-lines reader broke on them. They go to stderr with --json."""
    from treadle.types import RunStarted

    db = tmp_path / "runs.db"

    async def orphan():
        async with treadle.open_sqlite_store(db) as store:
            lease = await store.acquire_lease("orphan", owner="gone", ttl_s=60)
            started = RunStarted(
                run_id="orphan", ts="2026-01-01T00:00:00+00:00", input=(), snapshot={}
            )
            await store.write_run_started(started, seq=1, generation=lease.generation)
            await store.release_lease(lease)

    trio.run(orphan)
    out = CliRunner().invoke(main, ["tail", "orphan", "--store", str(db), "--json", "--no-follow"])
    assert out.exit_code == 0, out.output
    assert [json.loads(line)["kind"] for line in out.stdout.splitlines()] == ["run_started"]
    assert "nobody drives run orphan: it is orphaned" in out.stderr
    plain = CliRunner().invoke(main, ["tail", "orphan", "--store", str(db), "--no-follow"])
    assert "nobody drives run orphan" in plain.stdout  # without --json, one readable stream


@pytest.mark.parametrize(
    ("option", "content", "said"),
    [
        ("--tools", "not json", "not JSON"),
        ("--tools", "{}", "expected a non-empty JSON list of tools"),
        ("--tools", "[]", "expected a non-empty JSON list of tools"),
        ("--tools", '[{"description": "no name"}]', "tool 0: 'name' must be a non-empty string"),
        ("--tools", '[{"name": "f", "parameters": []}]', "'parameters' must be a JSON-schema"),
        ("--tools", '[{"name": "f", "paramters": {}}]', "tool 0: unknown keys paramters"),
        ("--messages", "[1", "not JSON"),
        ("--messages", '{"role": "user"}', "expected a non-empty JSON list of messages"),
        ("--messages", '[{"role": "robot", "content": "x"}]', "'role' must be one of"),
        ("--messages", '[{"role": "tool", "content": "x"}]', "needs 'tool_call_id'"),
        (
            "--messages",
            '[{"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "f", '
            '"arguments": "{x"}}]}]',
            "message 0: tool call 0: 'arguments' is not JSON",
        ),
        ("--messages", '[{"role": "user"}]', "a user message needs 'content'"),
        ("--messages", '[{"role": "user", "content": [{"type": "image_url"}]}]', "text parts"),
        ("--tools", '[{"type": "function"}]', 'tool 0: a {"type": "function"} tool needs'),
    ],
)
def test_probe_refuses_input_files_it_cannot_use_naming_the_file(tmp_path, option, content, said):
    path = tmp_path / "input.json"
    path.write_text(content)
    done = CliRunner().invoke(
        main, ["probe", "--base-url", "http://127.0.0.1:9/v1", "--model", "m", option, str(path)]
    )
    assert done.exit_code == 2, done.output
    assert str(path) in done.output and said in done.output
    assert "Traceback" not in done.output


async def test_probe_sends_tool_calls_and_tool_call_ids_from_the_messages_file(tmp_path):
    messages = tmp_path / "messages.json"
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
    messages.write_text(
        json.dumps(
            [
                {"role": "user", "content": "call f"},
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "c1", "content": "2"},
            ]
        )
    )
    pong = b'data: {"choices": [{"index": 0, "delta": {"content": "2"}, "finish_reason": "stop"}]}'
    response = CannedResponse(
        headers={"content-type": "text/event-stream"}, chunks=[pong + b"\n\ndata: [DONE]\n\n"]
    )
    async with open_loopback_server(canned(response)) as server:
        done = await trio.run_process(
            [
                *(sys.executable, "-m", "treadle", "probe", "--base-url", server.base_url),
                *("--model", "m", "--messages", str(messages), "--json"),
            ],
            capture_stdout=True,
            capture_stderr=True,
            check=False,
        )
        assert done.returncode == 0, done.stderr.decode()
        sent = server.requests[0].json()["messages"]
    assert sent[1]["tool_calls"][0]["id"] == "c1"
    assert json.loads(sent[1]["tool_calls"][0]["function"]["arguments"]) == {"a": 1}
    assert sent[2] == {"role": "tool", "tool_call_id": "c1", "content": "2"}
    assert json.loads(done.stdout)["text"] == "2"


def test_probe_takes_openai_shaped_messages_and_refuses_a_base_url_that_is_no_url(tmp_path):
    from treadle._cli_probe import load_messages

    path = tmp_path / "messages.json"
    parts = [{"type": "text", "text": "Hel"}, {"type": "text", "text": "lo"}]
    path.write_text(json.dumps({"messages": [{"role": "user", "content": parts}]}))
    (message,) = load_messages(str(path))
    assert (message.role, message.content) == ("user", "Hello")
    done = CliRunner().invoke(main, ["probe", "--base-url", "notaurl", "--model", "m"])
    assert done.exit_code == 2 and "must start with http:// or https://" in done.output


@pytest.mark.parametrize(
    ("base_url", "said"),
    [
        ("htps://bob:PW-s3cret@127.0.0.1:9/v1?key=K-s3cret", "must start with http://"),
        ("http://bob:PW-s3cret@[::1:9/v1?key=K-s3cret", "is not a valid URL"),
    ],
)
def test_probe_refuses_a_bad_base_url_without_quoting_its_credentials(base_url, said):
    # A mistyped base URL was echoed whole, password and ?key= included; one urllib could
    # not parse ended the command with a ValueError traceback.
    done = CliRunner().invoke(main, ["probe", "--base-url", base_url, "--model", "m"])
    assert done.exit_code == 2, done.output
    assert said in done.output and "bob:***@" in done.output
    assert "s3cret" not in done.output and "Traceback" not in done.output


def test_show_and_tail_never_pass_terminal_controls_through(tmp_path):
    """What a model or tool wrote went to the terminal raw: an escape sequence set the
    window title and colours, a carriage return overwrote the line."""
    hostile = "\x1b]0;PWNED\x07\x1b[31mred\x1b[0m\rover\u202eevil\x9b2J"

    @treadle.tool
    async def fetch_page() -> str:
        """Fetch the page."""
        return hostile

    async def go():
        agent = treadle.Agent(
            model=ScriptedModel(turns=[call("fetch_page"), say(f"the page says {hostile}")]),
            executor=treadle.Toolbox([fetch_page]),
            parser=treadle.NativeToolCallParser(),
        )
        async with treadle.open_sqlite_store(tmp_path / "runs.db") as store:
            await treadle.run(agent, f"read {hostile}", store=store, run_id="r")

    trio.run(go)
    for command in ("show", "tail"):
        out = CliRunner().invoke(main, [command, "r", "--store", str(tmp_path / "runs.db")])
        assert out.exit_code == 0, out.output
        controls = [
            ch for ch in out.output if (ord(ch) < 32 and ch != "\n") or 0x7F <= ord(ch) < 0xA0
        ]
        assert controls == [] and "\u202e" not in out.output, (command, out.output)
        assert "\\x1b]0;PWNED\\x07" in out.output  # shown, as escapes


class _FailingImport(types.ModuleType):
    """A stand-in for ``treadle._ui._app`` whose names fail to import, as if ``name`` were
    missing: no real console module is imported, so nothing can start serving."""

    def __init__(self, name: str | None) -> None:
        super().__init__("treadle._ui._app")
        self.missing = name

    def __getattr__(self, attribute: str) -> object:
        raise ImportError(f"No module named {self.missing!r}", name=self.missing)


@pytest.mark.parametrize(
    ("missing", "extra"),
    [("starlette", True), ("markupsafe", True), ("treadle._ui._views", False), (None, False)],
)
def test_ui_says_the_extra_is_missing_only_when_a_package_is(tmp_path, monkeypatch, missing, extra):
    """Any ImportError at the console's start was reported as a missing ``ui`` extra, one
    raised by treadle's own code too (which pip cannot fix)."""
    make_store(tmp_path / "runs.db")
    monkeypatch.setitem(sys.modules, "treadle._ui._app", _FailingImport(missing))
    out = CliRunner().invoke(main, ["ui", "--store", str(tmp_path / "runs.db")])
    assert out.exit_code != 0
    if extra:
        assert f"treadle ui needs the ui extra ({missing} is missing)" in out.output
    else:
        assert isinstance(out.exception, ImportError) and out.exception.name == missing
        assert "ui extra" not in out.output
