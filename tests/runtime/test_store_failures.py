"""Bad input on resume and stores that cannot write, on every persistent store.

* a log written by a newer schema version is refused with a clear error, and nothing is
  written to it;
* a log whose parameter snapshot differs from the agent is refused naming the keys;
* a store that fails a write (a full disk) stops the run with that error, and a reopened
  store still holds every acknowledged barrier; the run then resumes to the end;
* a store write that raises something else (an ``OSError``) is the cause of the run's
  `RunInterrupted`, never the closed inbox the other actors then hit.
"""

from __future__ import annotations

import contextlib
import errno
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Literal

import attrs
import pytest
import trio

import treadle
from treadle.ports import RunStore
from treadle.stores.jsonl import open_jsonl_store
from treadle.supervisors import run
from treadle.supervisors._driver import _interrupted
from treadle.testing import InterceptingStore, seed_log
from treadle.testing.crashes import (
    RUN_INPUT,
    check_recovered_run,
    make_agent,
    read_ledger,
)
from treadle.testing.faults import FailingFileOps, FailingStore
from treadle.types import (
    SCHEMA_VERSION,
    Record,
    RunLog,
    RunStarted,
    StoreOp,
)

Kind = Literal["sqlite", "jsonl"]
KINDS: tuple[Kind, ...] = ("sqlite", "jsonl")
WRITES = 21  # store writes of the scenario run


@contextlib.asynccontextmanager
async def opened(kind: Kind, tmp_path: Path) -> AsyncIterator[RunStore]:
    if kind == "sqlite":
        async with treadle.open_sqlite_store(tmp_path / "runs.db") as store:
            yield store
    else:
        async with open_jsonl_store(tmp_path / "runs") as store:
            yield store


@attrs.define(eq=False)
class Acks(InterceptingStore):
    """Remembers the records of every barrier that returned."""

    inner: RunStore
    acknowledged: list[Record] = attrs.Factory(list)
    written: list[Record] = attrs.Factory(list)

    def after_write(self, act: bool, op: StoreOp, records: tuple[Record, ...], seq: int) -> None:
        self.written.extend(records)
        if op.barrier:
            self.acknowledged = list(self.written)


async def baseline(tmp_path: Path) -> RunLog:
    store = treadle.MemoryStore()
    await run(make_agent(tmp_path / "baseline.ledger"), RUN_INPUT, store=store, run_id="base")
    return await store.read_log("base")


# --------------------------------------------------------------------------- bad logs


@pytest.mark.parametrize("kind", KINDS)
async def test_a_log_from_a_newer_schema_is_refused_and_left_alone(
    kind: Kind, tmp_path: Path
) -> None:
    agent = make_agent(tmp_path / "ledger.jsonl")
    started = RunStarted(
        run_id="future",
        ts="2030-01-01T00:00:00+00:00",
        input=(treadle.Message(role="user", content=RUN_INPUT),),
        snapshot=agent.snapshot(),
        schema_version=SCHEMA_VERSION + 1,
    )
    async with opened(kind, tmp_path) as store:
        await seed_log(store, [started])
    async with opened(kind, tmp_path) as store:
        with pytest.raises(treadle.SchemaTooNew) as info:
            await run(agent, store=store, run_id="future")
        assert f"schema version {SCHEMA_VERSION + 1}" in str(info.value)
        assert f"reads up to {SCHEMA_VERSION}" in str(info.value)
        assert (info.value.version, info.value.supported) == (SCHEMA_VERSION + 1, SCHEMA_VERSION)
        with pytest.raises(ExceptionGroup) as group:
            await treadle.resume_unfinished(agent, store=store)
        assert group.group_contains(treadle.SchemaTooNew)
    async with opened(kind, tmp_path) as store:
        with pytest.raises(treadle.SchemaTooNew):
            await store.read_log("future")  # still there, still refused, nothing appended
    assert read_ledger(tmp_path / "ledger.jsonl") == []


@pytest.mark.parametrize("kind", KINDS)
async def test_a_different_snapshot_is_refused_naming_the_keys(kind: Kind, tmp_path: Path) -> None:
    ledger = tmp_path / "ledger.jsonl"
    async with opened(kind, tmp_path) as store:
        failing = FailingStore(inner=store, fail_at=9)
        with pytest.raises(treadle.StoreError):
            await run(make_agent(ledger), RUN_INPUT, store=failing, run_id="r")
    other = attrs.evolve(
        make_agent(ledger),
        system_prompt="Another prompt.",
        model_name="another-model",
        synthetic=treadle.SyntheticObservations(unknown="gone"),
    )
    async with opened(kind, tmp_path) as store:
        before = await store.read_log("r")
        with pytest.raises(treadle.SnapshotMismatch) as info:
            await run(other, store=store, run_id="r")
        assert info.value.keys == ["model", "synthetic", "system_prompt"]
        assert "model, synthetic, system_prompt" in str(info.value)
        assert await store.read_log("r") == before
        result = await run(make_agent(ledger), store=store, run_id="r")  # the right agent
        assert result.state is treadle.RunState.SUCCEEDED


# --------------------------------------------------------------------------- write failures


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("when", ["before", "after"])
async def test_a_failed_write_stops_the_run_and_loses_nothing_acknowledged(
    kind: Kind, when: Literal["before", "after"], tmp_path: Path
) -> None:
    expected = await baseline(tmp_path)
    ledger = tmp_path / "ledger.jsonl"
    for fail_at in range(1, WRITES + 1):
        run_id = f"r{fail_at}"
        full = treadle.StoreError(f"{run_id}: no space left on device")
        async with opened(kind, tmp_path) as store:
            acks = Acks(FailingStore(inner=store, fail_at=fail_at, error=full, when=when))
            with pytest.raises(treadle.StoreError) as info:
                await run(make_agent(ledger), RUN_INPUT, store=acks, run_id=run_id)
            assert info.value is full  # surfaced as it was raised
        async with opened(kind, tmp_path) as store:
            log = await store.read_log(run_id)
            assert log.records[: len(acks.acknowledged)] == tuple(acks.acknowledged), fail_at
            await run(make_agent(ledger), RUN_INPUT, store=store, run_id=run_id)
            log = await store.read_log(run_id)
        entries = read_ledger(ledger, run_id=run_id)
        assert check_recovered_run(log, entries, expected) == [], fail_at


@pytest.mark.parametrize("fraction", [0.1, 0.35, 0.6, 0.85, 0.99])
async def test_a_full_disk_under_the_jsonl_store(fraction: float, tmp_path: Path) -> None:
    expected = await baseline(tmp_path)
    measure = FailingFileOps()
    async with open_jsonl_store(tmp_path / "measure", file_ops=measure) as store:
        await run(make_agent(tmp_path / "measure.ledger"), RUN_INPUT, store=store, run_id="r")
    space = int(measure.written * fraction)  # the disk fills up part way through the run
    ledger = tmp_path / "ledger.jsonl"
    ops = FailingFileOps(space_bytes=space)
    async with open_jsonl_store(tmp_path / "runs", file_ops=ops) as store:
        acks = Acks(store)
        with pytest.raises(treadle.StoreError) as info:
            await run(make_agent(ledger), RUN_INPUT, store=acks, run_id="r")
        assert isinstance(info.value.__cause__, OSError)
        assert info.value.__cause__.errno == errno.ENOSPC
        assert "No space left on device" in str(info.value)
    async with open_jsonl_store(tmp_path / "runs") as store:  # space is back
        log = await store.read_log("r")
        assert log.records[: len(acks.acknowledged)] == tuple(acks.acknowledged)
        assert store.torn_tails() == ()  # the short write was cut back off
        await run(make_agent(ledger), RUN_INPUT, store=store, run_id="r")
        log = await store.read_log("r")
    assert check_recovered_run(log, read_ledger(ledger, run_id="r"), expected) == []


# --------------------------------------------------------------------------- the cause


ROUNDS = 4  # the other actors' follow-on errors come first in some schedules, not all


async def test_an_error_a_store_write_raises_is_the_cause_of_the_interrupted_run(
    tmp_path: Path,
) -> None:
    """Writes without a barrier (model results, step records) included, in any schedule."""
    ledger = tmp_path / "ledger.jsonl"
    for attempt in range(ROUNDS):
        for fail_at in range(1, WRITES + 1):
            burning = OSError(errno.EIO, f"disk on fire at write {fail_at}")
            store = FailingStore(inner=treadle.MemoryStore(), fail_at=fail_at, error=burning)
            run_id = f"r{attempt}-{fail_at}"
            with pytest.raises(treadle.RunInterrupted) as info:
                await run(make_agent(ledger), RUN_INPUT, store=store, run_id=run_id)
            assert info.value.__cause__ is burning, (fail_at, info.value)
            assert "OSError: [Errno 5] disk on fire" in str(info.value)


@pytest.mark.parametrize(
    "follow_on",
    [
        trio.BrokenResourceError("the mailbox's receiver is gone"),
        trio.EndOfChannel(),
        trio.ClosedResourceError("the mailbox was closed for sending"),
    ],
)
def test_a_closed_channel_error_is_the_cause_only_when_nothing_else_failed(
    follow_on: Exception,
) -> None:
    burning = OSError(errno.EIO, "disk on fire")
    group = BaseExceptionGroup("actors", [follow_on, ExceptionGroup("writer", [burning])])
    assert _interrupted("r", group).__cause__ is burning
    full = treadle.StoreError("no space left on device")
    assert _interrupted("r", BaseExceptionGroup("actors", [follow_on, full])) is full
    alone = _interrupted("r", BaseExceptionGroup("actors", [follow_on, trio.Cancelled._create()]))
    assert alone.__cause__ is follow_on
