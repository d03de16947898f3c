"""Logs written before the compact encoding are read as they are, and driven on.

The fixtures in tests/fixtures/old_logs were written by treadle with SQLite layout 2 and JSONL
format 2, whose records are JSON objects naming their run and kind (make_logs.py there says
how). docs/decisions/0085-compact-log-records.md: opening such a store writes no record; a
layout-2 database is marked with today's layout (so that an older treadle refuses it); a
version-2 JSONL file keeps its format, appends included, written as a version-2 treadle
reads it (docs/crash-safety.md, "Versions").
"""

from __future__ import annotations

import contextlib
import json
import shutil
import sqlite3
from pathlib import Path
from typing import Any

import attrs
import pytest
import trio
from tests.fixtures.old_logs.agent import RUN_IDS, agent

import treadle
from treadle.stores import _sql, open_jsonl_store, open_sqlite_store
from treadle.stores._codec import (
    CLASS_OF_TAG,
    KIND_OF,
    decode,
    record_from_dict,
    record_to_dict,
    unpack,
)
from treadle.stores._jsonl_files import FORMAT_VERSION, read_run_file, records_frame
from treadle.testing.invariants import check_invariants
from treadle.types import (
    ActionResult,
    ActionStatus,
    ApprovalDecided,
    RunFinished,
    RunState,
    StepRecord,
)

FIXTURES = Path(__file__).parent.parent / "fixtures" / "old_logs"
EXPECTED: dict[str, dict[str, list[dict[str, Any]]]] = json.loads(
    (FIXTURES / "expected.json").read_text(encoding="utf-8")
)


def expected(kind: str, run_id: str) -> tuple[Any, ...]:
    return tuple(record_from_dict(data) for data in EXPECTED[kind][run_id])


def rows(path: Path) -> list[tuple[Any, ...]]:
    with contextlib.closing(sqlite3.connect(path)) as conn:
        return conn.execute(
            "SELECT run_id, seq, gen, kind, body, crc FROM records ORDER BY run_id, seq"
        ).fetchall()


def layout(path: Path) -> str:
    with contextlib.closing(sqlite3.connect(path)) as conn:
        return str(conn.execute("SELECT value FROM meta WHERE key = 'layout'").fetchone()[0])


def run_files(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in directory.glob("*.jsonl")}


@pytest.fixture
def old_sqlite(tmp_path: Path) -> Path:
    path = tmp_path / "layout2.db"
    shutil.copyfile(FIXTURES / "layout2.db", path)
    return path


@pytest.fixture
def old_jsonl(tmp_path: Path) -> Path:
    shutil.copytree(FIXTURES / "jsonl2", tmp_path / "jsonl2")
    return tmp_path / "jsonl2"


def test_the_fixtures_are_of_the_old_formats() -> None:
    path = FIXTURES / "layout2.db"
    assert layout(path) == "2"
    stored = rows(path)
    assert {kind for *_, kind, _, _ in stored} <= set(KIND_OF.values())
    for run_id, _, _, kind, body, _ in stored:  # JSON objects naming run and kind
        data = json.loads(body)
        assert (data["run_id"], data["kind"]) == (run_id, kind)
    for run_id in RUN_IDS:
        found = read_run_file(str(FIXTURES / "jsonl2" / f"{run_id}.jsonl"))
        assert found.version == 2 and found.records == expected("jsonl", run_id)


async def test_an_old_sqlite_store_is_read_as_written_and_marked_with_todays_layout(
    old_sqlite: Path,
) -> None:
    before = rows(old_sqlite)
    async with open_sqlite_store(old_sqlite) as store:
        for run_id in RUN_IDS:
            assert (await store.read_log(run_id)).records == expected("sqlite", run_id)
        summaries = {s.run_id: s for s in await store.list_summaries()}
        assert summaries["old-done"].state is RunState.SUCCEEDED
        assert summaries["old-cancelled"].state is RunState.CANCELLED
        assert summaries["old-open"].steps == 1
    assert rows(old_sqlite) == before  # not one row rewritten
    assert layout(old_sqlite) == str(_sql.LAYOUT_VERSION) == "4"
    async with open_sqlite_store(old_sqlite) as store:  # a second open changes nothing more
        assert (await store.read_log("old-done")).records == expected("sqlite", "old-done")
    assert rows(old_sqlite) == before


async def test_an_old_sqlite_run_is_resumed_in_the_compact_encoding(old_sqlite: Path) -> None:
    before = rows(old_sqlite)
    async with open_sqlite_store(old_sqlite) as store:
        result = await treadle.run(agent(), store=store, run_id="old-open")
        log = await store.read_log("old-open")
        summary = await store.read_summary("old-open")
    assert summary is not None and summary.steps == 3  # old and new step rows both counted
    assert result.state is RunState.SUCCEEDED and result.final_answer == "done: 3"
    old = expected("sqlite", "old-open")
    assert log.records[: len(old)] == old  # what was stored stays what it was
    new = log.records[len(old) :]
    (unknown,) = [r for r in new if isinstance(r, ActionResult)]
    assert unknown.outcome.status is ActionStatus.UNKNOWN  # the interrupted call, never rerun
    assert isinstance(new[-1], RunFinished)
    assert [r for r in log.records if isinstance(r, StepRecord)][-1].step == 3
    assert check_invariants(log) == []
    after = rows(old_sqlite)
    assert [r for r in after if r[0] != "old-open" or r[1] <= len(old)] == before
    appended = [r for r in after if r[0] == "old-open" and r[1] > len(old)]
    assert len(appended) == len(new)
    for (run_id, _, _, kind, body, _), record in zip(appended, new, strict=True):
        assert kind in CLASS_OF_TAG and body.startswith(b'["' + kind.encode() + b'"')
        assert b"old-open" not in body  # the run id is the row's
        assert unpack(body, run_id, kind) == record


async def test_an_old_jsonl_store_is_read_and_appended_in_its_own_format(
    old_jsonl: Path,
) -> None:
    files = run_files(old_jsonl)
    async with open_jsonl_store(old_jsonl) as store:
        for run_id in RUN_IDS:
            assert (await store.read_log(run_id)).records == expected("jsonl", run_id)
        result = await treadle.run(agent(), store=store, run_id="old-open")
        log = await store.read_log("old-open")
        # a run started now gets a file of the current format
        async with treadle.open_run(agent(), "add 1 and 2", store=store, run_id="new") as handle:
            while handle.pending_approval is None:  # noqa: ASYNC110
                await trio.sleep(0.01)
            handle.approve()
    assert result.state is RunState.SUCCEEDED
    old = expected("jsonl", "old-open")
    assert log.records[: len(old)] == old
    assert check_invariants(log) == []
    for name, data in files.items():  # old bytes untouched, appended to at most
        assert (old_jsonl / name).read_bytes().startswith(data)
    grown = (old_jsonl / "old-open.jsonl").read_bytes()
    lines = [json.loads(line) for line in grown.splitlines()]
    assert lines[0]["header"]["version"] == 2  # the file keeps its format...
    for line in lines[1:]:  # ...so every frame holds JSON objects naming run and kind
        for item in line["records"]:
            assert item["run_id"] == "old-open"
            assert decode(json.dumps(item)) == record_from_dict(item)
    assert [record_to_dict(r) for r in log.records] == [
        item for line in lines[1:] for item in line["records"]
    ]
    fresh = read_run_file(str(old_jsonl / "new.jsonl"))
    assert fresh.version == FORMAT_VERSION == 4
    assert isinstance(fresh.records[-1], RunFinished)


def decision(run_id: str) -> ApprovalDecided:
    return ApprovalDecided(
        run_id=run_id,
        step=2,
        call_id="c1",
        arguments_digest="d",
        decision="approve",
        ts="2026-12-01T10:00:00+00:00",
        tool="add",
    )


async def test_a_decision_in_an_old_jsonl_store_is_written_as_its_treadle_reads_it(
    old_jsonl: Path,
) -> None:
    """A version-2 treadle refuses an object with a field it does not know: a decision's
    tool, which it never wrote, made the run file and the control stream of a run approved
    by a newer treadle read as damage to it, though the file still said version 2."""
    async with open_jsonl_store(old_jsonl) as store:
        await store.append_control(decision("old-open"))
        (entry,) = await store.read_control("old-open")
    (line,) = (old_jsonl / ".control" / "old-open.jsonl").read_bytes().splitlines()
    assert json.loads(line)["control"] == {
        k: v for k, v in record_to_dict(decision("old-open")).items() if k != "tool"
    }
    assert entry.record == attrs.evolve(decision("old-open"), tool="")
    for version in (1, 2):  # the records of a run file of that format
        line = records_frame(5, [decision("r")], generation=1, run_id="r", version=version)
        assert "tool" not in json.loads(line)["records"][0]
    compact = json.loads(records_frame(5, [decision("r")], generation=1, run_id="r"))
    assert unpack(json.dumps(compact["records"][0]), "r") == decision("r")  # kept from 3 on
