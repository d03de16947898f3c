"""The run store contract (`treadle.testing.contracts`), run against every store we ship."""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import attrs
import pytest
import trio

from treadle import (
    Agent,
    ConflictError,
    NativeToolCallParser,
    Toolbox,
    UsageError,
    open_jsonl_store,
    run,
    tool,
)
from treadle.ports import RunIndex, RunStore
from treadle.stores import JsonlStore, MemoryStore, SqliteStore
from treadle.stores.postgres import PostgresStore
from treadle.testing.contracts import (
    RUN_STORE_CHECKS,
    StoreCheck,
    StoreContractError,
    StoreOpener,
    check_run_store,
    lease_generation,
)
from treadle.testing.scripted import ScriptedModel, call, say
from treadle.types import (
    ActionResult,
    ActionStatus,
    Liveness,
    Record,
    RunLog,
    RunStarted,
    RunState,
    StepRecord,
    StoreOp,
)


@attrs.frozen
class Harness:
    open_store: StoreOpener
    persistent: bool


def _opener(make: Callable[[], Awaitable[RunStore]]) -> StoreOpener:
    @contextlib.asynccontextmanager
    async def open_store() -> AsyncIterator[RunStore]:
        store = await make()
        try:
            yield store
        finally:
            await store.aclose()

    return open_store


def _memory(cls: type[MemoryStore] = MemoryStore) -> StoreOpener:
    async def make() -> RunStore:
        return cls()

    return _opener(make)


def _harness(kind: str, tmp_path: Path, request: pytest.FixtureRequest) -> Harness:
    if kind == "memory":
        return Harness(_memory(), persistent=False)
    if kind == "jsonl":
        return Harness(_opener(lambda: JsonlStore.open(tmp_path / "runs")), persistent=True)
    if kind == "postgres":
        dsn = request.getfixturevalue("postgres_dsn")
        schema = request.getfixturevalue("postgres_schema")
        return Harness(_opener(lambda: PostgresStore.open(dsn, schema=schema)), persistent=True)
    path = tmp_path / "runs.db"
    return Harness(_opener(lambda: SqliteStore.open(path)), persistent=True)


STORES = ("memory", "sqlite", "jsonl", "postgres")
CASES = [
    pytest.param(kind, check, id=f"{kind}-{check.name}")
    for kind in STORES
    for check in RUN_STORE_CHECKS
    if kind != "memory" or not check.persistent_only  # memory keeps nothing across a reopen
]


@pytest.fixture(params=STORES)
def harness(request: pytest.FixtureRequest, tmp_path: Path) -> Harness:
    return _harness(request.param, tmp_path, request)


@pytest.mark.parametrize(("kind", "check"), CASES)
async def test_contract(
    kind: str, check: StoreCheck, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    await check(_harness(kind, tmp_path, request).open_store)


async def test_whole_suite_runs_through_the_public_runner(harness: Harness) -> None:
    await check_run_store(harness.open_store, persistent=harness.persistent)


def test_check_names_are_unique() -> None:
    names = [c.name for c in RUN_STORE_CHECKS]
    assert len(set(names)) == len(names)


# ---------------------------------------------------------------- the suite catches bad stores


@attrs.define(eq=False)
class _NoSeqCheck(MemoryStore):
    """Appends whatever seq it is given."""

    async def _append(
        self, run_id: str, seq: int, records: tuple[Record, ...], **options: object
    ) -> None:
        self._logs.setdefault(run_id, []).extend(records)


@attrs.define(eq=False)
class _DropsStepResults(MemoryStore):
    """Forgets the action results of a step write (not atomic)."""

    async def write_step(
        self,
        action_results: Sequence[ActionResult] | None,
        step: StepRecord,
        *,
        seq: int,
        generation: int,
    ) -> None:
        await self._append(step.run_id, seq, (step,), op=StoreOp.STEP, generation=generation)


@attrs.define(eq=False)
class _RaisesOnMissingRun(MemoryStore):
    async def read_log(self, run_id: str) -> RunLog:
        if run_id not in self._logs:
            raise KeyError(run_id)
        return await super().read_log(run_id)


@attrs.define(eq=False)
class _SeqCountsWrites(MemoryStore):
    """Takes a write's seq as the number of writes before it, not of records."""

    _writes: dict[str, int] = attrs.Factory(dict)

    async def _append(
        self, run_id: str, seq: int, records: tuple[Record, ...], **options: Any
    ) -> None:
        written = self._writes.get(run_id, 0)
        if seq != written + 1:
            raise ConflictError(run_id, expected=written + 1, got=seq)
        self._writes[run_id] = written + 1
        await super()._append(run_id, len(self._logs.get(run_id, ())) + 1, records, **options)


@attrs.define(eq=False)
class _ReadsItsOwnList(MemoryStore):
    """Hands out its own list of the run's records, which its later writes change."""

    async def read_log(self, run_id: str) -> RunLog:
        await trio.lowlevel.checkpoint()
        return RunLog(run_id=run_id, records=self._logs.get(run_id, []))  # type: ignore[arg-type]


@attrs.define(eq=False)
class _ListsNewestFirst(MemoryStore):
    async def list_runs(self) -> tuple[str, ...]:
        return tuple(reversed(await super().list_runs()))


@attrs.define(eq=False)
class _ListsSorted(MemoryStore):
    """Lists its runs by run id, not in the order of their first write."""

    async def list_runs(self) -> tuple[str, ...]:
        return tuple(sorted(await super().list_runs()))


@attrs.define(eq=False)
class _StoresEveryOutcomeExecuted(MemoryStore):
    """Writes every action result as executed and not reconciled (a lossy encoding)."""

    async def write_step(
        self,
        action_results: Sequence[ActionResult] | None,
        step: StepRecord,
        *,
        seq: int,
        generation: int,
    ) -> None:
        flattened = [
            attrs.evolve(
                r,
                outcome=attrs.evolve(r.outcome, status=ActionStatus.EXECUTED),
                reconciled=False,
            )
            for r in action_results or ()
        ]
        await super().write_step(flattened, step, seq=seq, generation=generation)


@attrs.define(eq=False)
class _StepInTwoWrites(MemoryStore):
    """Appends a step's action results, lets others run, then its step record (not atomic).

    It lets them run for eight scheduler passes: a reader beside it takes a read in fewer
    (a read, a listing and a checkpoint a loop), so every reader sees the half-written step
    whatever order trio runs the tasks of a pass in (one pass let a run of the suite miss it).
    """

    async def write_step(
        self,
        action_results: Sequence[ActionResult] | None,
        step: StepRecord,
        *,
        seq: int,
        generation: int,
    ) -> None:
        results = tuple(action_results or ())
        if results:
            await self._append(step.run_id, seq, results, op=StoreOp.STEP, generation=generation)
            for _ in range(8):
                await trio.lowlevel.checkpoint()
        await self._append(
            step.run_id, seq + len(results), (step,), op=StoreOp.STEP, generation=generation
        )


@attrs.define(eq=False)
class _WritesWhenCancelled(MemoryStore):
    """Stores the write, then notices that its scope was cancelled."""

    async def _append(
        self, run_id: str, seq: int, records: tuple[Record, ...], **options: Any
    ) -> None:
        with trio.CancelScope(shield=True):
            await super()._append(run_id, seq, records, **options)
        await trio.lowlevel.checkpoint()


@pytest.mark.parametrize(
    ("broken", "check_name", "cause"),
    [
        # A read beside the writer saw action results without their step record, and a write
        # called in a cancelled scope was stored: both passed (docs/seams.md, "Run store").
        (_StepInTwoWrites, "reads_beside_a_writer_change_nothing", StoreContractError),
        (_WritesWhenCancelled, "cancelled_write_writes_nothing", StoreContractError),
        (_NoSeqCheck, "conflict_on_wrong_seq", StoreContractError),
        (_DropsStepResults, "step_write_with_several_results", StoreContractError),
        # The store's own KeyError escaped, not an error naming the check.
        (_RaisesOnMissingRun, "missing_run_reads_empty", KeyError),
        (_SeqCountsWrites, "writes_read_back_in_order", ConflictError),
        (_ListsNewestFirst, "list_runs_in_first_write_order", StoreContractError),
        # These two passed: the run ids sorted in first-write order, and no outcome but an
        # executed one was ever written.
        (_ListsSorted, "list_runs_in_first_write_order", StoreContractError),
        (_StoresEveryOutcomeExecuted, "record_contents_survive", StoreContractError),
        # Told as "a missing run read back 0 records": its records were a list.
        (_ReadsItsOwnList, "missing_run_reads_empty", StoreContractError),
    ],
)
async def test_suite_catches_a_broken_store(
    broken: type[MemoryStore], check_name: str, cause: type[Exception]
) -> None:
    """Each broken store fails with `StoreContractError` naming the check it broke.

    ``cause``: what the store raised itself (the error's ``__cause__``), or
    `StoreContractError` when the check found the breach.
    """
    check = next(c for c in RUN_STORE_CHECKS if c.name == check_name)
    with pytest.raises(StoreContractError, match=rf"^\[{check_name}\] ") as caught:
        await check(_memory(broken))
    if cause is not StoreContractError:
        assert isinstance(caught.value.__cause__, cause)
    with pytest.raises(StoreContractError, match=r"^\[[a-z_]+\] "):  # the first it breaks
        await check_run_store(_memory(broken), persistent=False)


async def test_a_read_log_with_records_in_a_list_is_told_so() -> None:
    with pytest.raises(StoreContractError, match="returned its records as a list, not a tuple"):
        await check_run_store(_memory(_ReadsItsOwnList), persistent=False)


async def test_forgetful_persistent_store_fails_the_reopen_check() -> None:
    check = next(c for c in RUN_STORE_CHECKS if c.name == "durable_after_reopen")
    with pytest.raises(StoreContractError, match="durable_after_reopen"):
        await check(_memory())  # a fresh memory store per opening loses everything


# ---------------------------------------------------------------- the index's record count


def _echo_agent(text_size: int = 10, answer: str = "done") -> Agent:
    @tool
    async def echo(text: str) -> str:
        """Say it back."""
        return text

    return Agent(
        model=ScriptedModel(turns=[call("echo", text="x" * text_size), say(answer)]),
        executor=Toolbox([echo]),
        parser=NativeToolCallParser(),
    )


async def test_a_summary_counts_the_records_of_the_log(harness: Harness) -> None:
    """`RunSummary.records` is what a poller compares to skip reading an unmoved log."""
    async with harness.open_store() as store:
        assert isinstance(store, RunIndex)
        await run(_echo_agent(), "go", store=store, run_id="counted")
        log = await store.read_log("counted")
        summary = await store.read_summary("counted")
        listed = {s.run_id: s for s in await store.list_summaries()}
    assert summary is not None and len(log.records) > 4
    assert summary.records == listed["counted"].records == len(log.records)


async def test_a_jsonl_summary_whose_last_line_outgrows_the_tail_reads_all_of_it(
    tmp_path: Path,
) -> None:
    """The last 64 KiB of the file are inside one record: the summary reads back as far as
    that record's line begins, and counts the records (it once said unknown, and the state
    of a finished run read as running)."""
    async with open_jsonl_store(tmp_path / "runs") as store:
        await run(_echo_agent(text_size=0), "go", store=store, run_id="small")
        await run(_echo_agent(answer="y" * 200_000), "go", store=store, run_id="big")
        small = await store.read_summary("small")
        big = await store.read_summary("big")
        small_log = await store.read_log("small")
        big_log = await store.read_log("big")
    assert small is not None and small.records == len(small_log.records)
    assert big is not None and big.records == len(big_log.records)
    assert big.state is RunState.SUCCEEDED and big.liveness is Liveness.FINISHED


# ---------------------------------------------------------------- one trio run per store


async def _use_from_here(store: RunStore, run_id: str) -> None:
    """Read, write (a barrier) and read back ``run_id`` in ``store``."""
    await store.read_log(run_id)
    record = RunStarted(run_id=run_id, ts="2026-01-01T00:00:00+00:00", input=(), snapshot={})
    await store.write_run_started(record, seq=1, generation=await lease_generation(store, run_id))
    assert (await store.read_log(run_id)).records == (record,)


@pytest.mark.parametrize("kind", ["sqlite", "jsonl", "postgres"])
def test_a_durable_store_refuses_a_trio_run_other_than_its_own(
    kind: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """A store belongs to the trio run that opened it (docs/asyncio.md).

    Used from another one (here while the opener's runs in another thread), a barrier
    waited for ever (its batch is handed back to the opener's run only) and the opener's
    run could die with TrioInternalError; reads went through. Now every call is refused
    with `UsageError` at once, and the opener's run goes on using and closing it.
    """
    harness = _harness(kind, tmp_path, request)
    opened: queue.Queue[RunStore] = queue.Queue()
    done = threading.Event()

    async def opener() -> None:
        async with harness.open_store() as store:
            opened.put(store)
            await trio.to_thread.run_sync(done.wait)
            await _use_from_here(store, "mine")

    async def other(store: RunStore) -> list[str]:
        refused = []
        with trio.fail_after(30):
            for name, call_it in [
                ("read_log", lambda: store.read_log("theirs")),
                ("write", lambda: _use_from_here(store, "theirs")),
                ("list_runs", store.list_runs),
                ("read_lease", lambda: store.read_lease("theirs")),
                ("aclose", store.aclose),
            ]:
                with pytest.raises(UsageError, match="belongs to the trio run that opened it"):
                    await call_it()
                refused.append(name)
        return refused

    with ThreadPoolExecutor(1) as pool:
        first = pool.submit(trio.run, opener)
        try:
            refused = trio.run(other, opened.get(timeout=30))
        finally:
            done.set()
        first.result(timeout=60)
    assert refused == ["read_log", "write", "list_runs", "read_lease", "aclose"]


def test_the_memory_store_serves_any_trio_run() -> None:
    """The memory store keeps no trio objects: opened in one trio run, used in the next."""
    store = trio.run(_memory_store)
    trio.run(_use_from_here, store, "r")
    trio.run(_use_from_here, store, "s")


async def _memory_store() -> MemoryStore:
    return MemoryStore()
