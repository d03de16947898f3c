"""The JSONL store: the run store contract, its file format, torn tails, corruption, faults."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import attrs
import pytest
import trio
import trio.testing

from treadle._exceptions import ConflictError, LogCorrupted, SchemaTooNew, StoreError, UsageError
from treadle.ports import RunStore
from treadle.stores import _jsonl_commit
from treadle.stores._lines import FrameError, frame, scan_lines, strict_utf8
from treadle.stores.jsonl import (
    FORMAT_VERSION,
    JsonlStatistics,
    JsonlStore,
    TornTail,
    open_jsonl_store,
    read_run_file,
    run_file_name,
)
from treadle.testing.contracts import RUN_STORE_CHECKS, StoreCheck, StoreOpener, check_run_store
from treadle.testing.faults import FailingFileOps
from treadle.types import (
    SCHEMA_VERSION,
    ActionIntent,
    ActionOutcome,
    ActionResult,
    ActionStatus,
    DecisionKind,
    Message,
    ModelIntent,
    ModelResult,
    Record,
    RunStarted,
    StepRecord,
)

CASES = Path(__file__).resolve().parent.parent / "fixtures" / "cases"
TS = "2025-01-01T00:00:00+00:00"


def jsonl_opener(directory: Path) -> StoreOpener:
    @contextlib.asynccontextmanager
    async def open_store() -> AsyncIterator[RunStore]:
        store = await JsonlStore.open(directory)
        try:
            yield store
        finally:
            await store.aclose()

    return open_store


# --------------------------------------------------------------------------- the contract


@pytest.mark.parametrize("check", RUN_STORE_CHECKS, ids=lambda c: c.name)
async def test_contract(check: StoreCheck, tmp_path: Path) -> None:
    await check(jsonl_opener(tmp_path / "runs"))


async def test_whole_suite_runs_through_the_public_runner(tmp_path: Path) -> None:
    await check_run_store(jsonl_opener(tmp_path / "runs"), persistent=True)


# --------------------------------------------------------------------------- helpers


def started(run_id: str, text: str = "hi") -> RunStarted:
    return RunStarted(
        run_id=run_id, ts=TS, input=(Message(role="user", content=text),), snapshot={"k": "v"}
    )


@attrs.define
class Steps:
    """Writes a run as the loop does: per step 2 barriers and 2 non-barrier writes."""

    store: RunStore
    run_id: str
    seq: int = 1
    step: int = 0
    body: str = "observation"
    written: list[Record] = attrs.Factory(list)

    async def start(self) -> None:
        record = started(self.run_id)
        await self.store.write_run_started(record, seq=self.seq)
        self._wrote(record)

    async def model(self) -> None:
        self.step += 1
        intent = ModelIntent(
            run_id=self.run_id, step=self.step, intent_id=f"m{self.step}", attempt=1, ts=TS
        )
        await self.store.write_intent(intent, seq=self.seq)
        self._wrote(intent)
        result = ModelResult(run_id=self.run_id, step=self.step, intent_id=f"m{self.step}", ts=TS)
        await self.store.write_model_result(result, seq=self.seq)
        self._wrote(result)

    async def action(self) -> None:
        intent = ActionIntent(
            run_id=self.run_id,
            step=self.step,
            intent_id=f"a{self.step}",
            call_id="c",
            tool="t",
            arguments={"n": self.step},
            ts=TS,
        )
        await self.store.write_intent(intent, seq=self.seq)
        self._wrote(intent)

    async def finish_step(self) -> None:
        outcome = ActionOutcome(status=ActionStatus.EXECUTED, observation=self.body)
        result = ActionResult(
            run_id=self.run_id,
            step=self.step,
            intent_id=f"a{self.step}",
            call_id="c",
            tool="t",
            outcome=outcome,
            ts=TS,
        )
        record = StepRecord(
            run_id=self.run_id,
            step=self.step,
            ts=TS,
            model_intent_id=f"m{self.step}",
            decision=DecisionKind.ACTIONS,
        )
        await self.store.write_step([result], record, seq=self.seq)
        self._wrote(result, record)

    async def next(self) -> None:
        await self.model()
        await self.action()
        await self.finish_step()

    def _wrote(self, *records: Record) -> None:
        self.written.extend(records)
        self.seq += len(records)


def lines_of(data: bytes) -> list[tuple[int, bytes]]:
    """(offset, line with its newline) of each line."""
    out, pos = [], 0
    while pos < len(data):
        end = data.index(b"\n", pos) + 1
        out.append((pos, data[pos:end]))
        pos = end
    return out


async def write_run(directory: Path, run_id: str = "r", steps: int = 2) -> tuple[Path, Steps]:
    async with open_jsonl_store(directory) as store:
        run = Steps(store, run_id)
        await run.start()
        for _ in range(steps):
            await run.next()
        path = Path(store.run_file(run_id))
    return path, run


# --------------------------------------------------------------------------- case 32


def foreign_line(line: bytes, offset: int) -> dict[str, Any]:
    """The frame check of case 32's foreign shape: strict UTF-8 JSON, no checksum."""
    try:
        data = json.loads(strict_utf8(line))
    except ValueError as exc:
        raise FrameError(f"not JSON: {exc}") from exc
    if not isinstance(data, dict) or not isinstance(data.get("seq"), int):
        raise FrameError("not a record")
    return data


@attrs.define
class ForeignLog:
    """A minimal log of case 32's record shape, recovered by the store's own line rules."""

    path: Path

    def read(self) -> Any:
        return scan_lines(self.path.read_bytes(), foreign_line, where=str(self.path))

    def append(self, record: dict[str, Any]) -> int:
        scanned = self.read()  # the torn tail is cut BEFORE the next append
        seq = len(scanned.items) + 1
        with self.path.open("r+b") as file:
            file.truncate(scanned.end)
            file.seek(scanned.end)
            file.write(json.dumps({"seq": seq, **record}).encode() + b"\n")
            file.flush()
            os.fsync(file.fileno())
        return seq


def test_case_32_torn_tail_is_reported_cut_and_the_next_append_gets_seq_4(tmp_path: Path) -> None:
    case = json.loads((CASES / "32-store-jsonl-torn-tail.json").read_text())
    expected = case["expected"]
    path = tmp_path / "run.jsonl"
    shutil.copy(CASES / case["input_file"], path)
    with pytest.raises(UnicodeDecodeError):
        path.read_bytes().decode("utf-8")  # a whole-file decode fails; line by line does not
    log = ForeignLog(path)
    scanned = log.read()
    assert list(scanned.items) == expected["records"]
    assert scanned.torn is not None
    assert scanned.torn.offset == expected["torn_tail"]["offset"] == 228
    assert scanned.torn.length == expected["torn_tail"]["length"] == 73
    assert scanned.torn.reason == "no trailing newline"
    assert scanned.end == expected["after_recovery_file_ends_at"]
    assert path.stat().st_size == 301  # reading never cuts
    seq = log.append({"type": "tool_result", "run_id": "run-0001", "step": 1, "output": "café"})
    assert seq == expected["next_append_seq"] == 4
    data = path.read_bytes()
    assert data[:228] == (CASES / case["input_file"]).read_bytes()[:228]
    again = log.read()
    assert again.torn is None and [r["seq"] for r in again.items] == [1, 2, 3, 4]
    assert again.items[3]["output"] == "café"
    assert lines_of(data)[3][0] == 228  # seq 4 starts where the torn line started


def test_case_32_rules_for_a_complete_damaged_last_line_and_a_damaged_middle_line(
    tmp_path: Path,
) -> None:
    torn = (CASES / "32-store-jsonl-torn-tail.jsonl").read_bytes()
    ended = ForeignLog(tmp_path / "ended.jsonl")
    ended.path.write_bytes(torn + b"\n")  # the torn line got its newline: still the tail
    scanned = ended.read()
    assert len(scanned.items) == 3
    assert scanned.torn is not None and scanned.torn.offset == 228
    assert scanned.torn.reason.startswith("invalid UTF-8")
    middle = ForeignLog(tmp_path / "middle.jsonl")
    middle.path.write_bytes(torn + b'\n{"seq":5,"type":"x"}\n')
    with pytest.raises(LogCorrupted) as info:
        middle.read()
    assert info.value.offset == 228
    assert isinstance(info.value.__cause__, FrameError)


# --------------------------------------------------------------------------- our format


async def test_file_layout_and_frame_format(tmp_path: Path) -> None:
    path, run = await write_run(tmp_path / "runs", run_id="Run/1", steps=1)
    assert path.name == "%52un%2F1.jsonl"
    data = path.read_bytes()
    assert data.endswith(b"\n")
    lines = [json.loads(line) for _, line in lines_of(data)]
    assert lines[0]["seq"] == 0
    header = lines[0]["header"]
    assert header.pop("created_ns") > 0
    assert header == {"format": "treadle.jsonl", "version": 1, "run_id": "Run/1"}
    assert [line["seq"] for line in lines[1:]] == [1, 2, 3, 4, 5]
    assert [len(line["records"]) for line in lines[1:]] == [1, 1, 1, 1, 2]  # step: one line
    assert [r["kind"] for r in lines[-1]["records"]] == ["action_result", "step"]
    async with open_jsonl_store(tmp_path / "runs") as store:
        assert (await store.read_log("Run/1")).records == tuple(run.written)


@pytest.mark.parametrize("last", ["barrier", "step"])
async def test_torn_tail_at_every_byte_offset_of_the_last_line(tmp_path: Path, last: str) -> None:
    source = tmp_path / "source"
    async with open_jsonl_store(source) as store:
        run = Steps(store, "r")
        await run.start()
        await run.next()
        await run.model()
        if last == "step":
            await run.action()
            await run.finish_step()
        else:
            await run.action()
        path = Path(store.run_file("r"))
    original = await trio.Path(path).read_bytes()
    start, line = lines_of(original)[-1]
    lost = len(json.loads(line)["records"])
    kept = tuple(run.written[:-lost])
    for cut in range(start, len(original)):
        directory = tmp_path / f"cut{cut}"
        directory.mkdir()
        (directory / path.name).write_bytes(original[:cut])
        async with open_jsonl_store(directory) as store:
            assert (await store.read_log("r")).records == kept, cut
            if cut == start:
                assert store.torn_tails() == ()
            else:
                (torn,) = store.torn_tails()
                assert (torn.offset, torn.length) == (start, cut - start)
                assert torn.reason == "no trailing newline"
                assert torn.head == original[start:cut][:256]
                assert store.statistics().torn_tails == 1
            assert (directory / path.name).stat().st_size == cut  # reading never cuts
            await rewrite(store, run.written[-lost:], seq=len(kept) + 1)
        assert (directory / path.name).read_bytes() == original, cut
        async with open_jsonl_store(directory) as store:
            assert (await store.read_log("r")).records == tuple(run.written)
            assert store.torn_tails() == ()


async def rewrite(store: JsonlStore, records: list[Record], *, seq: int) -> None:
    """Write the lost last operation again, as the resumed run would."""
    first = records[0]
    if isinstance(first, ActionResult | StepRecord):
        *results, step = records
        assert isinstance(step, StepRecord)
        await store.write_step([r for r in results if isinstance(r, ActionResult)], step, seq=seq)
    else:
        assert isinstance(first, ModelIntent | ActionIntent)
        await store.write_intent(first, seq=seq)


async def test_damaged_complete_last_line_is_a_torn_tail(tmp_path: Path) -> None:
    path, run = await write_run(tmp_path / "source", steps=1)
    original = path.read_bytes()
    start, line = lines_of(original)[-1]
    kept = tuple(run.written[:-2])
    reasons = set()
    for position in range(start, len(original) - 1):  # every byte but the newline
        damaged = bytearray(original)
        damaged[position] ^= 0x01 if damaged[position] ^ 0x01 != 0x0A else 0x02
        found = read_run_file_bytes(tmp_path, bytes(damaged))
        assert found.records == kept, position
        assert found.torn is not None and found.torn.offset == start
        assert found.torn.length == len(line)
        reasons.add(found.torn.reason)
    assert reasons == {"checksum mismatch", "not a frame"}
    directory = tmp_path / "one"
    directory.mkdir()
    damaged = bytearray(original)
    damaged[len(original) - 20] ^= 0x01
    (directory / path.name).write_bytes(bytes(damaged))
    async with open_jsonl_store(directory) as store:
        assert (await store.read_log("r")).records == kept
        assert store.torn_tails()[0].reason == "checksum mismatch"
        await rewrite(store, run.written[-2:], seq=len(kept) + 1)
    assert (directory / path.name).read_bytes() == original


def read_run_file_bytes(tmp_path: Path, data: bytes) -> Any:
    scratch = tmp_path / "scratch.jsonl"
    scratch.write_bytes(data)
    return read_run_file(str(scratch))


async def test_damaged_middle_line_is_log_corrupted_with_its_byte_offset(tmp_path: Path) -> None:
    path, _ = await write_run(tmp_path / "runs", steps=2)
    original = path.read_bytes()
    for offset, line in lines_of(original)[:-1]:
        damaged = bytearray(original)
        damaged[offset + len(line) // 2] ^= 0x01
        path.write_bytes(bytes(damaged))
        async with open_jsonl_store(tmp_path / "runs") as store:
            with pytest.raises(LogCorrupted) as info:
                await store.read_log("r")
            assert info.value.offset == offset
            assert info.value.where == str(path)
            intent = ModelIntent(run_id="r", step=3, intent_id="m3", attempt=1, ts=TS)
            with pytest.raises(LogCorrupted):  # the first write reads the file too
                await store.write_intent(intent, seq=12)
        assert path.read_bytes() == bytes(damaged)  # nothing was cut or appended
    path.write_bytes(original)


async def test_a_missing_line_is_a_seq_gap(tmp_path: Path) -> None:
    path, _ = await write_run(tmp_path / "runs", steps=1)
    lines = lines_of(path.read_bytes())
    path.write_bytes(b"".join(line for i, (_, line) in enumerate(lines) if i != 2))
    async with open_jsonl_store(tmp_path / "runs") as store:
        with pytest.raises(LogCorrupted, match="frame seq 3, expected 2") as info:
            await store.read_log("r")
    assert info.value.offset == lines[2][0]


async def test_a_record_of_another_run_is_corruption(tmp_path: Path) -> None:
    path, _ = await write_run(tmp_path / "runs", steps=1)
    stranger = ModelIntent(run_id="other", step=2, intent_id="x", attempt=1, ts=TS)
    from treadle.stores.jsonl import records_frame

    size = path.stat().st_size
    with path.open("ab") as file:
        file.write(records_frame(7, [stranger]))
        file.write(records_frame(8, [stranger]))
    async with open_jsonl_store(tmp_path / "runs") as store:
        with pytest.raises(LogCorrupted, match="a record of run 'other'") as info:
            await store.read_log("r")
    assert info.value.offset == size


async def test_a_torn_first_write_leaves_no_run(tmp_path: Path) -> None:
    directory = tmp_path / "runs"
    directory.mkdir()
    from treadle.stores.jsonl import header_frame, records_frame

    path = directory / run_file_name("r")
    header = len(header_frame("r", created_ns=1))
    whole = header_frame("r", created_ns=1) + records_frame(1, [started("r")])
    for cut, torn in (
        (5, (0, 5)),
        (header, None),
        (len(whole) - 1, (header, len(whole) - 1 - header)),
    ):
        await trio.Path(path).write_bytes(whole[:cut])
        async with open_jsonl_store(directory) as store:
            assert await store.list_runs() == ()
            assert (await store.read_log("r")).records == ()
            assert [(t.offset, t.length) for t in store.torn_tails()] == ([torn] if torn else [])
            await store.write_run_started(started("r"), seq=1)
            assert await store.list_runs() == ("r",)
            assert store.statistics().tails_cut == (1 if torn else 0)
        data = await trio.Path(path).read_bytes()
        assert data.endswith(whole[-30:]) and data.count(b"\n") == 2


async def test_newer_format_version_and_newer_schema_are_refused(tmp_path: Path) -> None:
    directory = tmp_path / "runs"
    directory.mkdir()
    from treadle.stores.jsonl import records_frame

    header = {"format": "treadle.jsonl", "version": FORMAT_VERSION + 1, "run_id": "new"}
    newer = frame(0, "header", json.dumps(header)) + records_frame(1, [started("new")])
    await trio.Path(directory / run_file_name("new")).write_bytes(newer)
    async with open_jsonl_store(directory) as store:
        with pytest.raises(SchemaTooNew) as info:
            await store.read_log("new")
        assert (info.value.version, info.value.supported) == (FORMAT_VERSION + 1, FORMAT_VERSION)
        future = attrs.evolve(started("future"), schema_version=SCHEMA_VERSION + 1)
        await store.write_run_started(future, seq=1)
        with pytest.raises(SchemaTooNew) as info:
            await store.read_log("future")
        assert info.value.version == SCHEMA_VERSION + 1


async def test_run_ids_round_trip_through_file_names(tmp_path: Path) -> None:
    ids = ["Run/1", "ünï cødé", "a b", "..", "", "x" * 300, "CON", "%41", "A", "a"]
    async with open_jsonl_store(tmp_path / "runs") as store:
        for run_id in ids:
            await store.write_run_started(started(run_id), seq=1)
    names = sorted(p.name for p in (tmp_path / "runs").iterdir())
    assert len(names) == len(ids)
    assert all(n.isascii() and "/" not in n and len(n) < 255 for n in names)
    assert not any(n.startswith(".") for n in names)
    async with open_jsonl_store(tmp_path / "runs") as store:
        assert await store.list_runs() == tuple(ids)
        for run_id in ids:
            assert (await store.read_log(run_id)).records == (started(run_id),)


async def test_two_store_objects_share_a_directory(tmp_path: Path) -> None:
    async with open_jsonl_store(tmp_path / "runs") as a, open_jsonl_store(tmp_path / "runs") as b:
        one, two = Steps(a, "one"), Steps(b, "two")
        await one.start()
        await two.start()
        await one.next()
        await two.next()
        assert sorted(await a.list_runs()) == ["one", "two"]
        assert (await a.read_log("two")).records == tuple(two.written[:-2])  # b's appends
        await b.read_log("two")  # b's step write was queued, not yet written: now it is
        assert (await a.read_log("two")).records == tuple(two.written)
        await two.model()
        assert (await a.read_log("two")).records == tuple(two.written[:-1])  # up to the barrier


async def test_a_second_writer_of_a_run_conflicts_at_append(tmp_path: Path) -> None:
    async with open_jsonl_store(tmp_path / "runs") as a, open_jsonl_store(tmp_path / "runs") as b:
        first = Steps(a, "r")
        await first.start()
        await first.model()
        await a.read_log("r")  # the model result is written, not just queued
        assert (await b.read_log("r")).records == tuple(first.written)  # b knows seq 4 next
        await first.action()  # a takes seq 4
        intent = ModelIntent(run_id="r", step=1, intent_id="b", attempt=2, ts=TS)
        with pytest.raises(ConflictError) as info:
            await b.write_intent(intent, seq=4)
        assert (info.value.expected, info.value.got) == (5, 4)
        with pytest.raises(StoreError, match="refuses further writes"):
            await b.write_intent(intent, seq=5)
        assert (await a.read_log("r")).records == tuple(first.written)  # nothing interleaved
        await first.finish_step()
        await b.write_run_started(started("other"), seq=1)  # other runs are unaffected
    async with open_jsonl_store(tmp_path / "runs") as store:
        assert (await store.read_log("r")).records == tuple(first.written)


async def test_open_refuses_a_file_and_a_missing_parent(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    with pytest.raises(StoreError, match="not a directory"):
        await JsonlStore.open(tmp_path / "file")
    with pytest.raises(StoreError, match="is not a directory"):
        await JsonlStore.open(tmp_path / "missing" / "runs")


async def test_statistics_is_a_frozen_record(tmp_path: Path) -> None:
    async with open_jsonl_store(tmp_path / "runs") as store:
        assert store.statistics() == JsonlStatistics()
        with pytest.raises(attrs.exceptions.FrozenInstanceError):
            store.statistics().syncs = 1  # type: ignore[misc]
        assert store.torn_tails() == ()
        assert TornTail(run_id="r", path="p", offset=1, length=2, reason="x").head == b""


# --------------------------------------------------------------------------- group commit


async def test_group_commit_shares_syncs_across_100_concurrent_runs(tmp_path: Path) -> None:
    async with open_jsonl_store(tmp_path / "runs") as store:
        runs = [Steps(store, f"run-{n:03}") for n in range(100)]

        async def drive(run: Steps) -> None:
            await run.start()
            for _ in range(5):
                await run.next()

        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                for run in runs:
                    nursery.start_soon(drive, run)
        assert sorted(await store.list_runs()) == [r.run_id for r in runs]
        stats = store.statistics()
        barriers = 100 * 5 * 2
        assert stats.writes_committed == 100 * (1 + 5 * 4)
        assert stats.records_written == 100 * (1 + 5 * 5)
        assert stats.sync_rounds < barriers / 10, stats  # one round of syncs serves many runs
        assert stats.max_batch >= 20, stats
        assert stats.syncs <= barriers + stats.sync_rounds, stats  # never more than one per file
        for run in (runs[0], runs[57], runs[-1]):
            assert (await store.read_log(run.run_id)).records == tuple(run.written)


async def test_more_runs_than_open_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_jsonl_commit, "MAX_OPEN_FILES", 3)
    async with open_jsonl_store(tmp_path / "runs") as store:
        runs = [Steps(store, f"r{n}") for n in range(12)]

        async def drive(run: Steps) -> None:
            await run.start()
            for _ in range(3):
                await run.next()

        async with trio.open_nursery() as nursery:
            for run in runs:
                nursery.start_soon(drive, run)
    async with open_jsonl_store(tmp_path / "runs") as store:
        for run in runs:
            assert (await store.read_log(run.run_id)).records == tuple(run.written)


async def test_non_barrier_writes_ride_with_the_next_barrier(tmp_path: Path) -> None:
    async with open_jsonl_store(tmp_path / "runs") as store:
        run = Steps(store, "r")
        await run.start()
        assert store.statistics().pending == 1  # lingering for a barrier
        await run.model()  # a barrier, then a non-barrier
        await run.action()
        stats = store.statistics()
        assert stats.pending == 0 and stats.writes_committed == 4
        assert stats.sync_rounds == 2, stats


@attrs.define
class GatedSync(FailingFileOps):
    """Syncs wait until the test opens the gate."""

    gate: threading.Event = attrs.Factory(threading.Event)

    def sync(self, fd: int) -> None:
        assert self.gate.wait(30)
        super().sync(fd)


async def test_cancelled_barrier_still_commits(tmp_path: Path) -> None:
    ops = GatedSync()
    ops.gate.set()
    async with open_jsonl_store(tmp_path / "runs", file_ops=ops) as store:
        await store.write_run_started(started("r"), seq=1)
        intent = ModelIntent(run_id="r", step=1, intent_id="m", attempt=1, ts=TS)
        with trio.CancelScope() as scope:
            scope.cancel()
            await store.write_intent(intent, seq=2)  # cancelled before queuing: nothing
        assert (await store.read_log("r")).records == (started("r"),)
        ops.gate.clear()
        with trio.fail_after(30):
            async with trio.open_nursery() as nursery:

                async def write() -> None:
                    await store.write_intent(intent, seq=2)
                    raise AssertionError("the barrier returned before its sync")

                nursery.start_soon(write)
                await trio.testing.wait_all_tasks_blocked()
                nursery.cancel_scope.cancel(reason="test cancels a waiting barrier")
            ops.gate.set()
            assert (await store.read_log("r")).records == (started("r"), intent)
        result = ModelResult(run_id="r", step=1, intent_id="m", ts=TS)
        await store.write_model_result(result, seq=3)  # the seq moved on


# --------------------------------------------------------------------------- write failures


async def test_full_disk_fails_the_write_and_loses_nothing_acknowledged(tmp_path: Path) -> None:
    ops = FailingFileOps()
    directory = tmp_path / "runs"
    async with open_jsonl_store(directory, file_ops=ops) as store:
        run = Steps(store, "r")
        await run.start()
        await run.next()
        await store.read_log("r")  # the step write is written, not just queued
        acknowledged = list(run.written)
        path = Path(store.run_file("r"))
        size = (await trio.Path(path).stat()).st_size
        ops.space_bytes = ops.written + 10  # the next append writes 10 bytes, then ENOSPC
        with pytest.raises(StoreError, match="No space left on device") as info:
            await run.model()  # its barrier fails
        assert isinstance(info.value.__cause__, OSError)
        assert info.value.__cause__.errno == errno.ENOSPC
        assert (await trio.Path(path).stat()).st_size == size  # the short write was cut back off
        ops.space_bytes = None  # space is freed: the run is still refused in this store
        with pytest.raises(StoreError, match="refuses further writes"):
            await run.action()
        await store.write_run_started(started("other"), seq=1)  # other runs are unaffected
    async with open_jsonl_store(directory) as store:
        assert (await store.read_log("r")).records == tuple(acknowledged)
        assert store.torn_tails() == ()
        resumed = Steps(store, "r", seq=len(acknowledged) + 1, step=1)
        await resumed.next()
        assert len((await store.read_log("r")).records) == len(acknowledged) + 5


async def test_failed_sync_fails_the_barrier_and_refuses_the_run(tmp_path: Path) -> None:
    ops = FailingFileOps(fail_sync_at=2)
    async with open_jsonl_store(tmp_path / "runs", file_ops=ops) as store:
        run = Steps(store, "r")
        await run.start()
        await run.model()  # sync 1
        with pytest.raises(StoreError, match="Input/output error") as info:
            await run.action()  # sync 2 fails
        assert info.value.__cause__.errno == errno.EIO  # type: ignore[union-attr]
        with pytest.raises(StoreError, match="refuses further writes"):
            await run.finish_step()


async def test_failed_non_barrier_surfaces_from_the_next_write_or_aclose(tmp_path: Path) -> None:
    ops = FailingFileOps()
    store = await JsonlStore.open(tmp_path / "runs", file_ops=ops)
    try:
        await store.write_run_started(started("r"), seq=1)
        await store.read_log("r")  # written
        ops.space_bytes = ops.written
        result = ModelResult(run_id="r", step=1, intent_id="m", ts=TS)
        await store.write_model_result(result, seq=2)  # queued: returns
        await store.write_run_started(started("s"), seq=1)
        assert (await store.read_log("r")).records == (started("r"),)
        ops.space_bytes = None
    finally:
        with pytest.raises(StoreError, match=r"writes of runs \['r', 's'\] failed after returning"):
            await store.aclose()


async def test_bad_records_are_refused_and_the_seq_stays_free(tmp_path: Path) -> None:
    async with open_jsonl_store(tmp_path / "runs") as store:
        await store.write_run_started(started("r"), seq=1)
        bad = ActionIntent(
            run_id="r",
            step=1,
            intent_id="a",
            call_id="c",
            tool="t",
            arguments={"x": object()},
            ts=TS,
        )
        with pytest.raises(UsageError, match="cannot encode"):
            await store.write_intent(bad, seq=2)
        stranger = ActionResult(
            run_id="x",
            step=1,
            intent_id="a",
            call_id="c",
            tool="t",
            outcome=ActionOutcome(status=ActionStatus.EXECUTED, observation=""),
            ts=TS,
        )
        step = StepRecord(run_id="r", step=1, ts=TS, model_intent_id=None, decision=None)
        with pytest.raises(UsageError, match="holds a record of run 'x'"):
            await store.write_step([stranger], step, seq=2)
        good = attrs.evolve(bad, arguments={"x": "\ud800 a lone surrogate is escaped"})
        with pytest.raises(ConflictError):
            await store.write_intent(good, seq=3)
        await store.write_intent(good, seq=2)
        assert (await store.read_log("r")).records == (started("r"), good)


# --------------------------------------------------------------------------- real processes

CHILD = """
import sys, trio
from treadle.stores.jsonl import JsonlStore
from treadle.testing.faults import FailingFileOps
from treadle.types import *

async def main(directory, space, body_chars):
    body = "y" * int(body_chars)
    ops = FailingFileOps(space_bytes=int(space) if space != "none" else None, kill=True)
    store = await JsonlStore.open(directory, file_ops=ops)
    await store.write_run_started(RunStarted(run_id="r", ts="t", input=(), snapshot={}), seq=1)
    seq = 2
    for step in range(1, 100000):
        intent = ModelIntent(run_id="r", step=step, intent_id=f"m{step}", attempt=1, ts="t")
        await store.write_intent(intent, seq=seq)
        print(seq, flush=True)
        outcome = ActionOutcome(status=ActionStatus.EXECUTED, observation=body)
        result = ActionResult(run_id="r", step=step, intent_id="a", call_id="c", tool="t",
                              outcome=outcome, ts="t")
        record = StepRecord(run_id="r", step=step, ts="t", model_intent_id=f"m{step}",
                            decision=None)
        await store.write_step([result], record, seq=seq + 1)
        seq += 3

trio.run(main, *sys.argv[1:])
"""


def run_child(
    directory: Path, space: str, body_chars: int, kill_after_s: float | None
) -> list[int]:
    process = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(directory), space, str(body_chars)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        if kill_after_s is not None:
            assert process.stdout is not None
            process.stdout.readline()  # started writing
            time.sleep(kill_after_s)
            process.kill()
        output, _ = process.communicate(timeout=60)
    finally:
        process.kill()
    assert process.returncode == -9, process.returncode
    return [int(line) for line in output.split()]


def check_after_kill(directory: Path, acked: list[int]) -> tuple[TornTail, ...]:
    async def check() -> tuple[TornTail, ...]:
        async with open_jsonl_store(directory) as store:
            records = (await store.read_log("r")).records
            assert len(records) >= (acked[-1] if acked else 0)
            assert all(  # whole steps only: a result never without its step record
                isinstance(records[i + 1], StepRecord)
                for i, r in enumerate(records)
                if isinstance(r, ActionResult)
            )
            tails = store.torn_tails()
            step = sum(1 for r in records if isinstance(r, ModelIntent)) + 1
            await store.write_intent(
                ModelIntent(run_id="r", step=step, intent_id="next", attempt=1, ts="t"),
                seq=len(records) + 1,
            )
        async with open_jsonl_store(directory) as store:
            assert len((await store.read_log("r")).records) == len(records) + 1
            assert store.torn_tails() == ()
        return tails

    return trio.run(check)


@pytest.mark.parametrize("space", [700, 1500, 2600])
def test_sigkill_half_way_through_an_append_leaves_a_torn_tail(tmp_path: Path, space: int) -> None:
    directory = tmp_path / "runs"
    acked = run_child(directory, str(space), 300, None)
    (tail,) = check_after_kill(directory, acked)
    assert tail.reason == "no trailing newline"
    assert tail.offset + tail.length == space  # the kill came right after the short write


def test_sigkill_from_outside_while_appending_large_lines(tmp_path: Path) -> None:
    for attempt, delay in enumerate((0.05, 0.11, 0.2)):
        directory = tmp_path / f"runs{attempt}"
        acked = run_child(directory, "none", 200_000, delay)
        check_after_kill(directory, acked)


async def test_a_crashed_first_write_of_another_store_object_is_cut(tmp_path: Path) -> None:
    from treadle.stores.jsonl import header_frame, records_frame

    async with open_jsonl_store(tmp_path / "runs") as store:
        assert (await store.read_log("r")).records == ()  # no file yet
        path = Path(store.run_file("r"))
        # meanwhile another writer created the file and died half-way through its first line
        remnant = header_frame("r", created_ns=1) + records_frame(1, [started("r")])[:-9]
        await trio.Path(path).write_bytes(remnant)
        await store.write_run_started(started("r"), seq=1)
        await store.write_intent(
            ModelIntent(run_id="r", step=1, intent_id="m", attempt=1, ts=TS), seq=2
        )
        assert store.statistics().tails_cut == 1
    async with open_jsonl_store(tmp_path / "runs") as store:
        assert len((await store.read_log("r")).records) == 2
        assert store.torn_tails() == ()
