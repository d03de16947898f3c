"""Crash at every write point and mid-action, reopen, resume: every store we ship."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest

from treadle.ports import RunStore
from treadle.stores import MemoryStore, SqliteStore
from treadle.stores.jsonl import JsonlStore
from treadle.testing.contracts import StoreOpener
from treadle.testing.crashes import (
    CrashContractError,
    check_crash_recovery,
    check_thread_crash_recovery,
)
from treadle.types import ActionResult, Record, StepRecord


def opener(make: Callable[[], Awaitable[RunStore]]) -> StoreOpener:
    @contextlib.asynccontextmanager
    async def open_store() -> AsyncIterator[RunStore]:
        store = await make()
        try:
            yield store
        finally:
            await store.aclose()

    return open_store


def memory(damage: Callable[[list[Record]], None] | None = None) -> StoreOpener:
    """A memory store that keeps its logs across reopens (optionally damaging them)."""
    logs: dict[str, list[Record]] = {}

    async def make() -> RunStore:
        if damage is not None:
            for log in logs.values():
                damage(log)
        store = MemoryStore()
        store._logs = logs  # reopened: the logs outlive the store object, as a file does
        return store

    return opener(make)


def stores(tmp_path: Path) -> dict[str, StoreOpener]:
    return {
        "memory": memory(),
        "sqlite": opener(lambda: SqliteStore.open(tmp_path / "runs.db")),
        "jsonl": opener(lambda: JsonlStore.open(tmp_path / "runs")),
    }


@pytest.mark.parametrize("kind", ["memory", "sqlite", "jsonl"])
async def test_crash_at_every_write_and_in_every_action(kind: str, tmp_path: Path) -> None:
    report = await check_crash_recovery(stores(tmp_path)[kind], workdir=tmp_path)
    assert (report.writes, report.actions) == (21, 5)
    assert report.crashes == 2 * (21 + 5)
    # resume met every branch of the table: unknown, reconciled, safe re-execution
    assert report.unknown_outcomes > 0
    assert report.reconciled > 0
    assert report.safe_reexecutions > 0


def drop_last_record(log: list[Record]) -> None:
    """A store that acknowledged its last write before it was durable."""
    if log:
        log.pop()


def drop_step_of_last_write(log: list[Record]) -> None:
    """A store whose step write is not atomic: the results survive, the step record not."""
    if len(log) > 1 and isinstance(log[-1], StepRecord) and isinstance(log[-2], ActionResult):
        log.pop()


async def test_a_store_losing_an_acknowledged_barrier_fails(tmp_path: Path) -> None:
    with pytest.raises(CrashContractError, match=r"acknowledged barrier .* is lost"):
        await check_crash_recovery(memory(drop_last_record), workdir=tmp_path)


async def test_a_store_with_a_torn_step_write_fails(tmp_path: Path) -> None:
    with pytest.raises(CrashContractError, match="not the next write"):
        await check_crash_recovery(memory(drop_step_of_last_write), workdir=tmp_path)


async def test_a_store_that_forgets_everything_fails(tmp_path: Path) -> None:
    async def fresh() -> RunStore:
        return MemoryStore()

    with pytest.raises(CrashContractError):
        await check_crash_recovery(opener(fresh), workdir=tmp_path)


async def test_a_passing_check_logs_its_abandoned_calls_at_debug(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A call a simulated crash abandoned ends later in the process (a real crash kills it):
    each such call of a passing check printed a warning on standard error."""
    caplog.set_level(logging.DEBUG, logger="treadle.tools")
    await check_crash_recovery(memory(), workdir=tmp_path)
    await check_thread_crash_recovery(memory(), workdir=tmp_path)
    tools = [r for r in caplog.records if r.name == "treadle.tools"]
    assert any("abandoned" in r.getMessage() for r in tools)  # the calls did end late
    assert [r.getMessage() for r in tools if r.levelno >= logging.WARNING] == []
