"""A run that continues a thread, crashed at every write and in every action: every store."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest

from treadle.ports import RunStore
from treadle.stores import MemoryStore, SqliteStore
from treadle.stores.jsonl import JsonlStore
from treadle.testing.contracts import StoreOpener
from treadle.testing.crashes import check_thread_crash_recovery
from treadle.types import Record


def opener(make: Callable[[], Awaitable[RunStore]]) -> StoreOpener:
    @contextlib.asynccontextmanager
    async def open_store() -> AsyncIterator[RunStore]:
        store = await make()
        try:
            yield store
        finally:
            await store.aclose()

    return open_store


def memory() -> StoreOpener:
    logs: dict[str, list[Record]] = {}

    async def make() -> RunStore:
        store = MemoryStore()
        store._logs = logs  # reopened: the logs outlive the store object, as a file does
        return store

    return opener(make)


@pytest.fixture(params=["memory", "sqlite", "jsonl", "postgres"])
def open_store(request: pytest.FixtureRequest, tmp_path: Path) -> StoreOpener:
    if request.param == "memory":
        return memory()
    if request.param == "sqlite":
        return opener(lambda: SqliteStore.open(tmp_path / "runs.db"))
    if request.param == "jsonl":
        return opener(lambda: JsonlStore.open(tmp_path / "runs"))
    from treadle.stores.postgres import open_postgres_store

    dsn = request.getfixturevalue("postgres_dsn")
    schema = request.getfixturevalue("postgres_schema")
    return lambda: open_postgres_store(dsn, schema=schema)


async def test_a_thread_run_crashed_anywhere_loses_nothing_and_repeats_nothing(
    open_store: StoreOpener, tmp_path: Path
) -> None:
    report = await check_thread_crash_recovery(open_store, workdir=tmp_path)
    # run-started (naming the thread), 2 steps of 3 actions, run-finished
    assert (report.writes, report.actions) == (11, 3)
    assert report.crashes == 2 * (11 + 3)
