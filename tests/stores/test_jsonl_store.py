"""The JSONL store: the run store contract, its file format, torn tails and corruption."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from treadle.ports import RunStore
from treadle.stores.jsonl import JsonlStore
from treadle.testing.contracts import RUN_STORE_CHECKS, StoreCheck, StoreOpener, check_run_store


def jsonl_opener(directory: Path) -> StoreOpener:
    @contextlib.asynccontextmanager
    async def open_store() -> AsyncIterator[RunStore]:
        store = await JsonlStore.open(directory)
        try:
            yield store
        finally:
            await store.aclose()

    return open_store


@pytest.mark.parametrize("check", RUN_STORE_CHECKS, ids=lambda c: c.name)
async def test_contract(check: StoreCheck, tmp_path: Path) -> None:
    await check(jsonl_opener(tmp_path / "runs"))


async def test_whole_suite_runs_through_the_public_runner(tmp_path: Path) -> None:
    await check_run_store(jsonl_opener(tmp_path / "runs"), persistent=True)
