"""The capability contracts (`treadle.testing.capabilities`) against every store that has them.

Memory, SQLite and PostgreSQL keep leases with expiry, control streams, a run index and a
queue; JSONL keeps leases as OS locks (no expiry to check), control streams and a run index.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
import trio

from treadle.ports import RunStore
from treadle.stores import JsonlStore, MemoryStore, SqliteStore, open_jsonl_store
from treadle.stores._sql import run_pooled, write_transaction
from treadle.stores.postgres import PostgresStore
from treadle.testing.capabilities import (
    ContractClock,
    FakeClock,
    SleepingClock,
    check_control_stream,
    check_lease_store,
    check_run_index,
    check_run_queue,
)
from treadle.testing.contracts import StoreContractError, StoreOpener
from treadle.types import Liveness, Message, Record, RunStarted, StoreOp


def _opener(make: Callable[[], object]) -> StoreOpener:
    @contextlib.asynccontextmanager
    async def open_store() -> AsyncIterator[RunStore]:
        store = await make()  # type: ignore[misc]
        try:
            yield store
        finally:
            await store.aclose()

    return open_store


def _store(
    kind: str, tmp_path: Path, request: pytest.FixtureRequest
) -> tuple[StoreOpener, ContractClock | None, bool]:
    """``(opener, clock, persistent)`` for one kind of store."""
    if kind == "memory":
        clock = FakeClock()
        memory = MemoryStore(clock=clock.now)

        @contextlib.asynccontextmanager
        async def same() -> AsyncIterator[RunStore]:
            yield memory

        return same, clock, False
    if kind == "sqlite":
        clock = FakeClock()
        path = tmp_path / "runs.db"
        return _opener(lambda: SqliteStore.open(path, clock=clock.now)), clock, True
    if kind == "jsonl":
        return _opener(lambda: JsonlStore.open(tmp_path / "runs")), None, True
    dsn = request.getfixturevalue("postgres_dsn")
    schema = request.getfixturevalue("postgres_schema")
    return _opener(lambda: PostgresStore.open(dsn, schema=schema)), SleepingClock(), True


ALL = ["memory", "sqlite", "jsonl", "postgres"]
QUEUED = ["memory", "sqlite", "postgres"]


@pytest.mark.parametrize("kind", ALL)
async def test_lease_contract(kind: str, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    opener, clock, _ = _store(kind, tmp_path, request)
    await check_lease_store(opener, clock=clock)


@pytest.mark.parametrize("kind", ALL)
async def test_control_stream_contract(
    kind: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    opener, _, persistent = _store(kind, tmp_path, request)
    await check_control_stream(opener, persistent=persistent)


@pytest.mark.parametrize("kind", ALL)
async def test_run_index_contract(
    kind: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    opener, _, _ = _store(kind, tmp_path, request)
    await check_run_index(opener)


@pytest.mark.parametrize("kind", QUEUED)
async def test_run_queue_contract(
    kind: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    opener, clock, _ = _store(kind, tmp_path, request)
    await check_run_queue(opener, clock=clock)


async def test_lease_renewals_and_control_readings_never_wait_behind_the_runs_reads(
    fleet_store,
) -> None:
    # With hundreds of runs starting, their reads filled the store's worker threads; the one
    # renewal for all runs waited its turn behind them (and lost it each time the run hosting
    # it ended) until leases expired under runs still driven, and cancels landed seconds late.
    await _shared_calls_pass_full_workers(fleet_store)


async def test_a_jsonl_store_bounds_its_reads_and_keeps_a_thread_for_shared_calls(
    tmp_path: Path,
) -> None:
    # A JSONL store ran every call in trio's default pool (up to 40 threads at once), with
    # renewals and control readings queued among the runs' reads.
    async with open_jsonl_store(tmp_path / "runs") as store:
        await _shared_calls_pass_full_workers(store)
        workers = store._engine.workers
        holders = [object() for _ in range(workers.total_tokens)]
        for holder in holders:
            await workers.acquire_on_behalf_of(holder)
        try:
            with trio.move_on_after(0.5) as waited:  # no read while every worker is taken
                await store.read_log("r")
            assert waited.cancelled_caught
        finally:
            for holder in holders:
                workers.release_on_behalf_of(holder)
        assert len((await store.read_log("r")).records) == 1


async def _shared_calls_pass_full_workers(store: Any) -> None:
    """Renew, read the control heads, the control stream and the lease of a run with every
    worker thread for reads taken: each must still be served."""
    from treadle.approvals import request_cancel

    lease = await store.acquire_lease("r", owner="o", ttl_s=600)
    await store.write_run_started(
        RunStarted(run_id="r", ts="2026-01-01T00:00:00+00:00", input=(), snapshot={}),
        seq=1,
        generation=lease.generation,
    )
    await request_cancel(store, "r", reason="stop")
    workers = store._engine.workers
    holders = [object() for _ in range(workers.total_tokens)]
    for holder in holders:  # every worker thread taken, as by reads of starting runs
        await workers.acquire_on_behalf_of(holder)
    try:
        with trio.fail_after(10):
            (renewed,) = await store.renew_leases([lease], ttl_s=600)
            heads = await store.control_heads(["r"])
            entries = await store.read_control("r")
            current = await store.read_lease("r")
    finally:
        for holder in holders:
            workers.release_on_behalf_of(holder)
    assert renewed.generation == lease.generation
    assert heads == {"r": 1} and len(entries) == 1
    assert current is not None and current.expires_at == renewed.expires_at


def _insert_damaged_row(dialect: Any, conn: Any, damage: str) -> None:
    """Insert run ``rogue``, queued for agent ``a``, with its ``damage``d column."""
    state, submission = ("bogus", b"[]") if damage == "state" else ("queued", b"\x00\xff")
    with write_transaction(dialect, conn):
        conn.execute(
            dialect.sql(
                "INSERT INTO runs (run_id, state, agent, submission, submitted_at) "
                "VALUES ('rogue', ?, 'a', ?, 1)"
            ),
            (state, submission),
        )


def _quarantine_of(dialect: Any, conn: Any) -> str | None:
    row = conn.execute(dialect.sql("SELECT quarantined FROM runs WHERE run_id = 'rogue'"))
    return row.fetchone()[0]  # type: ignore[no-any-return]


@pytest.mark.parametrize("damage", ["state", "submission"])
async def test_a_damaged_queue_row_is_quarantined_and_the_other_runs_are_claimed(
    fleet_store: Any, damage: str, caplog: pytest.LogCaptureFixture
) -> None:
    """One run's row holding a state no run has, or a submission that does not decode,
    failed the transaction of every claim: no worker claimed any run, and the worker logged
    "claiming runs failed (Expecting value ...)" every interval without naming the run."""
    store = fleet_store
    hi = (Message(role="user", content="hi"),)
    await store.submit("good-1", agent="a", input=hi)
    await trio.to_thread.run_sync(
        run_pooled, store._dialect, store._pool, _insert_damaged_row, damage
    )
    await store.submit("good-2", agent="a", input=hi)

    async def claim() -> list[str]:
        claims = await store.claim(
            owner="w", agents={"a": ("",)}, limit=3, ttl_s=60, max_takeovers=3, backoff_s=0
        )
        assert all(c.submission is not None and c.submission.input == hi for c in claims)
        return sorted(c.lease.run_id for c in claims)

    assert await claim() == ["good-1", "good-2"]
    assert await claim() == []  # the damaged run is no candidate any more
    logged = [r.getMessage() for r in caplog.records if "'rogue'" in r.getMessage()]
    assert len(logged) == 1 and "damaged" in logged[0], logged
    reason = await trio.to_thread.run_sync(run_pooled, store._dialect, store._pool, _quarantine_of)
    assert reason is not None and "damaged" in reason and "unquarantine" in reason


async def test_a_damaged_queue_rows_summary_names_its_quarantine(fleet_store: Any) -> None:
    """A run quarantined for a row holding a state no run has was listed as quarantined
    with no reason (`quarantined` ``None``), so `treadle show` printed "(...)" empty; its
    summary now carries the reason the claim stored (docs/fleet.md, "Poison runs")."""
    store = fleet_store
    await trio.to_thread.run_sync(
        run_pooled, store._dialect, store._pool, _insert_damaged_row, "state"
    )
    claims = await store.claim(
        owner="w", agents={"a": ("",)}, limit=1, ttl_s=60, max_takeovers=3, backoff_s=0
    )
    assert claims == ()
    stored = await trio.to_thread.run_sync(run_pooled, store._dialect, store._pool, _quarantine_of)
    summary = await store.read_summary("rogue")
    assert summary is not None and summary.error is not None  # the row is still damaged
    assert summary.liveness is Liveness.QUARANTINED
    assert stored is not None and summary.quarantined == stored
    (listed,) = [s for s in await store.list_summaries() if s.run_id == "rogue"]
    assert listed.quarantined == stored


class _FencesOnlySomeWrites(MemoryStore):
    """A store that fences every write but one kind, whose writer's generation it ignores."""

    unfenced: StoreOp = StoreOp.MODEL_RESULT

    async def _append(
        self,
        run_id: str,
        seq: int,
        records: tuple[Record, ...],
        *,
        op: StoreOp,
        generation: int,
    ) -> None:
        lease = await self.read_lease(run_id)
        if op is self.unfenced and lease is not None:
            generation = lease.generation
        await super()._append(run_id, seq, records, op=op, generation=generation)


@pytest.mark.parametrize("unfenced", list(StoreOp), ids=lambda op: op.value)
async def test_the_lease_contract_refuses_a_store_that_fences_only_some_writes(
    unfenced: StoreOp,
) -> None:
    # A store that checked the writer's generation on write_intent alone passed, and a stale
    # writer's model result and run-finished landed after a takeover (docs/seams.md, "Run
    # store": every write of a stale generation raises LeaseLost and changes nothing).
    clock = FakeClock()
    store = _FencesOnlySomeWrites(clock=clock.now)
    store.unfenced = unfenced

    @contextlib.asynccontextmanager
    async def same() -> AsyncIterator[RunStore]:
        yield store

    with pytest.raises(StoreContractError, match="lease_fencing"):
        await check_lease_store(same, clock=clock)


class _NeverWakes(MemoryStore):
    """Its wake changes nothing: a parent parked on its child runs waits for its recheck."""

    async def wake(self, run_id: str) -> bool:
        return False


async def test_the_queue_contract_refuses_a_store_whose_wake_changes_nothing() -> None:
    # The contract never called wake: a queue built without it (or with one that changes
    # nothing) passed, and a fleet's parent run parked on its children until its recheck.
    clock = FakeClock()
    store = _NeverWakes(clock=clock.now)

    @contextlib.asynccontextmanager
    async def same() -> AsyncIterator[RunStore]:
        yield store

    with pytest.raises(StoreContractError, match="queue_woken"):
        await check_run_queue(same, clock=clock)
