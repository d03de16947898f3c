"""Contract suites that any implementation of a treadle seam must pass.

`check_run_store` holds a `treadle.ports.RunStore` to docs/seams.md, "Run store": an empty log for
a missing run, `InvalidRunId` for a string that is not a run id, writes read back equal and in
order, the atomic step write (a read beside the writer
never sees action results without their step record), `ConflictError` on a wrong seq with the
log unchanged, first-write order of `list_runs`, many concurrent runs, nothing written by a
write called in a cancelled scope, refusal after close and, for persistent stores, everything
acknowledged surviving a reopen.

Use it from a test of your own store::

    @contextlib.asynccontextmanager
    async def open_store() -> AsyncIterator[RunStore]:
        store = await MyStore.open(path)        # every call opens the SAME storage
        try:
            yield store
        finally:
            await store.aclose()

    async def test_my_store_contract() -> None:
        await check_run_store(open_store, persistent=True)

Each check is also available alone in `RUN_STORE_CHECKS`, for one test per check. Checks use
fresh random run ids and never assume the storage is empty, so they may share one database.
"""

from __future__ import annotations

import secrets
from collections.abc import Awaitable, Callable, Sequence
from contextlib import AbstractAsyncContextManager
from typing import Any, Final

import attrs
import trio

from treadle._exceptions import (
    ConflictError,
    ContractViolation,
    InvalidRunId,
    StoreError,
    innermost,
)
from treadle.ports import LeaseStore, RunStore
from treadle.stores import write_records
from treadle.types import (
    ActionIntent,
    ActionOutcome,
    ActionResult,
    ActionStatus,
    ApprovalDecided,
    ApprovalRequested,
    CancelRequested,
    ControlRecord,
    DecisionKind,
    Message,
    ModelErrorInfo,
    ModelIntent,
    ModelReply,
    ModelResult,
    Record,
    RunFinished,
    RunLog,
    RunStarted,
    RunState,
    StepRecord,
    StopReason,
    ToolCall,
    Totals,
    Usage,
)

__all__ = [
    "CHECK_TIMEOUT_S",
    "RUN_STORE_CHECKS",
    "StoreCheck",
    "StoreContractError",
    "StoreOpener",
    "check_run_store",
    "every_write",
    "lease_generation",
    "seed_log",
]

StoreOpener = Callable[[], AbstractAsyncContextManager[RunStore]]
"""Opens the store under test for an ``async with`` block and closes it at the end.

Every call must open the same storage: for a persistent store, a second opening sees what
an earlier (closed) one wrote. For an in-memory store each call may start empty.
"""

CHECK_TIMEOUT_S: Final = 60.0
"""Seconds (trio clock) after which one check fails instead of hanging."""

_TS: Final = "2025-01-01T00:00:00+00:00"


class StoreContractError(ContractViolation):
    """A store broke the run store contract; the message names the check and the difference."""


@attrs.frozen(kw_only=True)
class StoreCheck:
    """One named check of the run store contract.

    Attributes:
        name: a short identifier, usable as a test id.
        doc: what the check proves.
        fn: the check; receives the opener and raises `StoreContractError` on a violation.
        persistent_only: the check reopens the storage and is skipped for in-memory stores.
    """

    name: str
    doc: str
    fn: Callable[[StoreOpener], Awaitable[None]]
    persistent_only: bool = False

    async def __call__(self, open_store: StoreOpener) -> None:
        """Run the check within `CHECK_TIMEOUT_S`.

        Raises:
            StoreContractError: the store broke the contract, or raised an error where the
                contract allows none (that error as ``__cause__``).
            trio.TooSlowError: the check hung.
        """
        try:
            with trio.fail_after(CHECK_TIMEOUT_S):
                await self.fn(open_store)
        except (StoreContractError, trio.TooSlowError):
            raise
        except Exception as exc:
            error = innermost(exc)
            if isinstance(error, StoreContractError):
                raise error from None
            raise StoreContractError(
                f"[{self.name}] the store raised {error!r} where the contract allows no error "
                f"({self.doc})"
            ) from error


def _expect(condition: bool, check: str, message: str) -> None:
    if not condition:
        raise StoreContractError(f"[{check}] {message}")


def _new_run_id(label: str) -> str:
    return f"{label}-{secrets.token_hex(6)}"


# --------------------------------------------------------------------------- a scripted writer


CONTRACT_OWNER: Final = "treadle-contract-check"
"""The lease owner the checks write as (in a store with leases)."""


async def lease_generation(store: RunStore, run_id: str, owner: str = CONTRACT_OWNER) -> int:
    """Take the run's lease (in a store with leases) and return the generation to write with.

    0 for a store without leases (`treadle.ports.LeaseStore`).
    """
    if not isinstance(store, LeaseStore):
        return 0
    lease = await store.acquire_lease(run_id, owner=owner, ttl_s=CHECK_TIMEOUT_S * 10)
    return lease.generation


async def seed_log(
    store: RunStore, records: Sequence[Record], *, owner: str = CONTRACT_OWNER
) -> None:
    """Write ``records`` (one run's log, in order) to ``store`` as a driver would, then let go.

    Each record goes through the store operation of its kind; a step's action results and its
    step record are one `RunStore.write_step`. In a store with leases the run's lease is taken
    first and released after, so that a run can then be driven (or resumed) from this log.
    Seqs continue from what the store already holds of the run.

    Raises:
        ConflictError, LeaseLost, StoreError: as the store's writes.
    """
    if not records:
        return
    run_id = records[0].run_id
    lease = None
    if isinstance(store, LeaseStore):
        lease = await store.acquire_lease(run_id, owner=owner, ttl_s=CHECK_TIMEOUT_S)
    generation = lease.generation if lease is not None else 0
    seq = len((await store.read_log(run_id)).records) + 1
    try:
        await write_records(store, records, seq=seq, generation=generation)
    finally:
        if lease is not None and isinstance(store, LeaseStore):
            await store.release_lease(lease)


@attrs.define(eq=False)
class _Writer:
    """Writes one run's records with the right seqs and remembers what it wrote.

    It takes the run's lease before its first write, as a driver does.
    """

    store: RunStore
    run_id: str
    written: list[Record] = attrs.field(factory=list)
    gen: int = -1

    @property
    def seq(self) -> int:
        return len(self.written) + 1

    async def lease(self) -> int:
        """The generation to write with (the lease is taken on first use)."""
        if self.gen < 0:
            self.gen = await lease_generation(self.store, self.run_id)
        return self.gen

    async def started(self, text: str = "hello") -> RunStarted:
        record = RunStarted(
            run_id=self.run_id,
            ts=_TS,
            input=(Message(role="user", content=text),),
            snapshot={"model": "m", "params": {"temperature": 0.5}, "tools": ["echo"]},
        )
        await self.store.write_run_started(record, seq=self.seq, generation=await self.lease())
        self.written.append(record)
        return record

    async def model_call(self, step: int, text: str | None = "thinking") -> str:
        intent_id = f"{self.run_id}/m{step}"
        intent = ModelIntent(run_id=self.run_id, step=step, intent_id=intent_id, attempt=1, ts=_TS)
        await self.store.write_intent(intent, seq=self.seq, generation=await self.lease())
        self.written.append(intent)
        reply = ModelReply(text=text, finish_reason="stop", usage=Usage(input_tokens=3))
        result = ModelResult(
            run_id=self.run_id, step=step, intent_id=intent_id, ts=_TS, reply=reply, latency_s=0.25
        )
        await self.store.write_model_result(result, seq=self.seq, generation=await self.lease())
        self.written.append(result)
        return intent_id

    async def action_intent(self, step: int, n: int, arguments: Any = None) -> ActionIntent:
        intent = ActionIntent(
            run_id=self.run_id,
            step=step,
            intent_id=f"{self.run_id}/a{step}.{n}",
            call_id=f"call-{step}-{n}",
            tool="echo",
            arguments=arguments if arguments is not None else {"text": f"x{n}"},
            ts=_TS,
        )
        await self.store.write_intent(intent, seq=self.seq, generation=await self.lease())
        self.written.append(intent)
        return intent

    async def step(self, step: int, actions: int = 1) -> StepRecord:
        model_intent_id = await self.model_call(step)
        intents = [await self.action_intent(step, n) for n in range(actions)]
        results = [_result_of(intent) for intent in intents]
        record = StepRecord(
            run_id=self.run_id,
            step=step,
            ts=_TS,
            model_intent_id=model_intent_id,
            decision=DecisionKind.ACTIONS if actions else DecisionKind.FINAL_ANSWER,
            model_output_text="thinking",
            visible_output_chars=8,
            observations=tuple(r.outcome.observation for r in results),
            action_result_ids=tuple(r.intent_id for r in results),
        )
        await self.store.write_step(
            results if actions else None, record, seq=self.seq, generation=await self.lease()
        )
        self.written.extend((*results, record))
        return record

    async def control(self, record: ControlRecord) -> None:
        await self.store.write_control(record, seq=self.seq, generation=await self.lease())
        self.written.append(record)

    async def finished(self) -> RunFinished:
        record = RunFinished(
            run_id=self.run_id,
            ts=_TS,
            state=RunState.SUCCEEDED,
            stop_reason=StopReason.FINAL_ANSWER,
            totals=Totals(steps=1, model_attempts=1),
            final_answer="done",
        )
        await self.store.write_run_finished(record, seq=self.seq, generation=await self.lease())
        self.written.append(record)
        return record


def _result_of(intent: ActionIntent) -> ActionResult:
    return ActionResult(
        run_id=intent.run_id,
        step=intent.step,
        intent_id=intent.intent_id,
        call_id=intent.call_id,
        tool=intent.tool,
        outcome=ActionOutcome(status=ActionStatus.EXECUTED, observation=f"ok {intent.call_id}"),
        ts=_TS,
        duration_s=0.001,
    )


async def _read_log(check: str, store: RunStore, run_id: str) -> RunLog:
    """``store.read_log(run_id)``, a `RunLog` of that run whose records are a tuple.

    Raises:
        StoreContractError: naming ``check``, when the answer is no such log (records in a
            list would be the store's own, changed by its later writes).
    """
    log = await store.read_log(run_id)
    _expect(isinstance(log, RunLog), check, f"read_log returned {type(log).__name__}")
    _expect(log.run_id == run_id, check, f"read_log({run_id!r}) is for run {log.run_id!r}")
    _expect(
        isinstance(log.records, tuple),
        check,
        f"read_log({run_id!r}) returned its records as a {type(log.records).__name__}, not a "
        "tuple: RunLog.records is an immutable copy of the log",
    )
    return log


async def _expect_log(check: str, store: RunStore, run_id: str, records: Sequence[Record]) -> None:
    log = await _read_log(check, store, run_id)
    if log.records == tuple(records):
        return
    kinds = [type(r).__name__ for r in log.records]
    want = [type(r).__name__ for r in records]
    _expect(False, check, f"run {run_id!r}: read back {kinds}, expected {want}")


async def _our_runs(store: RunStore, ours: Sequence[str]) -> list[str]:
    listed = await store.list_runs()
    return [run_id for run_id in listed if run_id in set(ours)]


# --------------------------------------------------------------------------- the checks


async def _missing_run_reads_empty(open_store: StoreOpener) -> None:
    check = "missing_run_reads_empty"
    run_id = _new_run_id("missing")
    async with open_store() as store:
        log = await _read_log(check, store, run_id)
        _expect(log.records == (), check, f"a missing run read back {len(log.records)} records")
        _expect(log.started is None and log.finished is None, check, "started/finished set")
        _expect(log.run_id == run_id, check, "the empty log names another run")
        _expect(run_id not in await store.list_runs(), check, "list_runs shows a missing run")


NOT_RUN_IDS: Final = ("", "bad id!", "../x", "#control", "r\x00", "é", "a" * 201)
"""Strings that are not run ids (docs/concepts.md, "Run ids"): empty, a space, a path, a
character outside the allowed set, a NUL, non-ASCII, one character too long."""


async def _malformed_run_id_refused(open_store: StoreOpener) -> None:
    check = "malformed_run_id_refused"
    async with open_store() as store:
        for run_id in NOT_RUN_IDS:
            try:
                log = await store.read_log(run_id)
            except InvalidRunId:
                continue
            _expect(False, check, f"read_log({run_id!r}) returned {len(log.records)} records")


async def _writes_read_back_in_order(open_store: StoreOpener) -> None:
    check = "writes_read_back_in_order"
    async with open_store() as store:
        w = _Writer(store, _new_run_id("order"))
        steps: list[Callable[[], Awaitable[object]]] = [
            w.started,
            lambda: w.step(1),
            lambda: w.control(_approval_requested(w.run_id)),
            lambda: w.control(_approval_decided(w.run_id)),
            lambda: w.control(CancelRequested(run_id=w.run_id, ts=_TS, reason="r", canceller="c")),
            lambda: w.step(2, actions=0),
            w.finished,
        ]
        for write in steps:
            await write()
            await _expect_log(check, store, w.run_id, w.written)
        log = await _read_log(check, store, w.run_id)
        _expect(log.started == w.written[0], check, "RunLog.started is not the first record")
        _expect(log.finished == w.written[-1], check, "RunLog.finished is not the last record")


def _approval_requested(run_id: str) -> ApprovalRequested:
    return ApprovalRequested(
        run_id=run_id,
        step=2,
        call_id="call-2-0",
        tool="echo",
        arguments_digest="sha256:00",
        ts=_TS,
        deadline_ts=_TS,
    )


def _approval_decided(run_id: str) -> ApprovalDecided:
    return ApprovalDecided(
        run_id=run_id,
        step=2,
        call_id="call-2-0",
        arguments_digest="sha256:00",
        decision="edit",
        ts=_TS,
        edited_arguments={"text": "edited"},
    )


async def _step_write_without_action(open_store: StoreOpener) -> None:
    check = "step_write_without_action"
    async with open_store() as store:
        w = _Writer(store, _new_run_id("noaction"))
        await w.started()
        record = await w.step(1, actions=0)
        log = await _read_log(check, store, w.run_id)
        _expect(len(log.records) == len(w.written), check, "write_step(None, ...) wrote extras")
        _expect(log.records[-1] == record, check, "the step record is not last")
        await w.finished()
        await _expect_log(check, store, w.run_id, w.written)


async def _step_write_with_several_results(open_store: StoreOpener) -> None:
    check = "step_write_with_several_results"
    async with open_store() as store:
        w = _Writer(store, _new_run_id("actions"))
        await w.started()
        step = await w.step(1, actions=3)
        log = await _read_log(check, store, w.run_id)
        tail = log.records[-4:]
        kinds = [type(r).__name__ for r in tail]
        _expect(kinds == ["ActionResult"] * 3 + ["StepRecord"], check, f"step write: {kinds}")
        _expect(tail[-1] == step, check, "the step record read back differs")
        ids = tuple(r.intent_id for r in tail[:3] if isinstance(r, ActionResult))
        _expect(ids == step.action_result_ids, check, "action results are out of call order")
        await w.finished()  # takes the seq after all four records
        await _expect_log(check, store, w.run_id, w.written)


async def _conflict_on_wrong_seq(open_store: StoreOpener) -> None:
    async with open_store() as store:
        await _conflict_on_new_run(store)
        w = _Writer(store, _new_run_id("conflict"))
        await w.started()
        await w.model_call(1)
        for bad in (w.seq + 1, w.seq - 1, 1):
            for name, attempt in every_write(w.store, w.run_id, seq=bad, generation=w.gen):
                await _expect_conflict(store, w, name, attempt, bad)
        await w.step(1)  # the right seq still works after every refusal
        await w.finished()
        await _expect_log("conflict_on_wrong_seq", store, w.run_id, w.written)


async def _conflict_on_new_run(store: RunStore) -> None:
    check = "conflict_on_wrong_seq"
    run_id = _new_run_id("conflict-new")
    record = RunStarted(run_id=run_id, ts=_TS, input=(), snapshot={})
    generation = await lease_generation(store, run_id)
    try:
        await store.write_run_started(record, seq=2, generation=generation)
    except ConflictError as exc:
        _expect(exc.expected == 1 and exc.got == 2, check, f"bad expected/got: {exc}")
    else:
        _expect(False, check, "seq 2 as the first write of a run was accepted")
    _expect(
        (await _read_log(check, store, run_id)).records == (), check, "a refused write is visible"
    )
    _expect(run_id not in await store.list_runs(), check, "a refused first write lists the run")


Attempt = Callable[[], Awaitable[None]]


def every_write(
    store: RunStore, run_id: str, *, seq: int, generation: int
) -> list[tuple[str, Attempt]]:
    """One attempt at each of the six writes of docs/seams.md, "Run store", named.

    Each writes record(s) of ``run_id`` at ``seq`` with ``generation``; the contract checks
    call them with a wrong seq or a stale generation, which the store must refuse.
    """
    at: dict[str, int] = {"seq": seq, "generation": generation}
    started = RunStarted(run_id=run_id, ts=_TS, input=(), snapshot={})
    intent = ModelIntent(run_id=run_id, step=1, intent_id="x", attempt=2, ts=_TS)
    result = ModelResult(run_id=run_id, step=1, intent_id="x", ts=_TS)
    step = StepRecord(run_id=run_id, step=1, ts=_TS, model_intent_id=None, decision=None)
    action = _result_of(
        ActionIntent(
            run_id=run_id, step=1, intent_id="y", call_id="c", tool="t", arguments={}, ts=_TS
        )
    )
    return [
        ("write_run_started", lambda: store.write_run_started(started, **at)),
        ("write_intent", lambda: store.write_intent(intent, **at)),
        ("write_model_result", lambda: store.write_model_result(result, **at)),
        ("write_step", lambda: store.write_step([action, action], step, **at)),
        ("write_control", lambda: store.write_control(_approval_requested(run_id), **at)),
        ("write_run_finished", lambda: store.write_run_finished(_finished(run_id), **at)),
    ]


def _finished(run_id: str) -> RunFinished:
    return RunFinished(
        run_id=run_id,
        ts=_TS,
        state=RunState.FAILED,
        stop_reason=StopReason.MAX_STEPS,
        totals=Totals(),
    )


async def _expect_conflict(
    store: RunStore, w: _Writer, name: str, attempt: Callable[[], Awaitable[None]], bad: int
) -> None:
    check = "conflict_on_wrong_seq"
    try:
        await attempt()
    except ConflictError as exc:
        _expect(exc.run_id == w.run_id, check, f"{name}: ConflictError names run {exc.run_id!r}")
        _expect(exc.expected == w.seq, check, f"{name}: expected={exc.expected}, not {w.seq}")
        _expect(exc.got == bad, check, f"{name}: got={exc.got}, not {bad}")
    else:
        _expect(False, check, f"{name} with seq {bad} (next is {w.seq}) was accepted")
    await _expect_log(check, store, w.run_id, w.written)


async def _record_contents_survive(open_store: StoreOpener) -> None:
    check = "record_contents_survive"
    text = 'ünïcødé 🧵 "quoted" \\ back\nslash\ttab\x00nul ' + "x" * 100_000
    async with open_store() as store:
        w = _Writer(store, _new_run_id("contents"))
        await w.started(text)
        await w.action_intent(1, 0, {"nested": {"list": [1, 2.5, None, True, "é"]}, "": ""})
        reply = ModelReply(
            text=None,
            reasoning="why",
            tool_calls=(ToolCall(id="c", name="echo", arguments={"a": [1, {"b": None}]}),),
            finish_reason="tool_calls",
            usage=Usage(input_tokens=None, output_tokens=7),
        )
        failed = ModelErrorInfo(kind="rate_limited", retryable=True, retry_after_s=1.5, status=429)
        for record in (
            ModelResult(run_id=w.run_id, step=1, intent_id="i", ts=_TS, reply=reply),
            ModelResult(run_id=w.run_id, step=1, intent_id="j", ts=_TS, error=failed),
            ModelResult(run_id=w.run_id, step=1, intent_id="k", ts=_TS, abandoned=True),
        ):
            await store.write_model_result(record, seq=w.seq, generation=await w.lease())
            w.written.append(record)
        await _every_outcome(w)
        await _expect_log(check, store, w.run_id, w.written)


async def _every_outcome(w: _Writer) -> None:
    """Write one step whose action results hold every `ActionStatus`, each flag set once.

    A store that writes the status or a flag of an outcome it thinks rare (``unknown``,
    ``reconciled``, ``late``) as something else turns a refused or unknown call into an
    executed one: docs/crash-safety.md, "What is guaranteed" (one result per intent, of
    what really happened).
    """
    statuses = tuple(ActionStatus)
    intents = [await w.action_intent(2, n) for n in range(len(statuses))]
    results = [
        attrs.evolve(
            _result_of(intent),
            outcome=ActionOutcome(
                status=status,
                observation=f"{status.value} {intent.call_id}",
                observation_is_synthetic=status is not ActionStatus.EXECUTED,
                detail=None if status is ActionStatus.EXECUTED else f"why {status.value}",
            ),
            duration_s=None if status is ActionStatus.UNKNOWN else 0.5,
            late=status is ActionStatus.UNKNOWN,
            reconciled=status is ActionStatus.NOT_EXECUTED,
        )
        for status, intent in zip(statuses, intents, strict=True)
    ]
    record = StepRecord(
        run_id=w.run_id,
        step=2,
        ts=_TS,
        model_intent_id=None,
        decision=DecisionKind.ACTIONS,
        observations=tuple(r.outcome.observation for r in results),
        action_result_ids=tuple(r.intent_id for r in results),
        env_error=True,
    )
    await w.store.write_step(results, record, seq=w.seq, generation=await w.lease())
    w.written.extend((*results, record))


async def _list_runs_in_first_write_order(open_store: StoreOpener) -> None:
    check = "list_runs_in_first_write_order"
    async with open_store() as store:
        # first written b, c, a: neither sorted nor reverse sorted (docs/seams.md, "Run store")
        writers = [_Writer(store, _new_run_id(f"list-{name}")) for name in "bca"]
        for w in writers:
            await w.started()
        for w in reversed(writers):
            await w.step(1)
        ours = [w.run_id for w in writers]
        listed = await _our_runs(store, ours)
        _expect(listed == ours, check, f"list_runs gave {listed}, first-write order is {ours}")
        all_runs = await store.list_runs()
        _expect(len(set(all_runs)) == len(all_runs), check, "list_runs repeats a run id")


async def _concurrent_runs_interleave(open_store: StoreOpener) -> None:
    check = "concurrent_runs_interleave"
    async with open_store() as store:
        writers = [_Writer(store, _new_run_id(f"many{n}")) for n in range(40)]

        async def drive(w: _Writer) -> None:
            await w.started()
            for step in range(1, 4):
                await w.step(step, actions=step % 3)
            await w.finished()

        async with trio.open_nursery() as nursery:
            for w in writers:
                nursery.start_soon(drive, w)
        for w in writers:
            await _expect_log(check, store, w.run_id, w.written)
        listed = await _our_runs(store, [w.run_id for w in writers])
        _expect(len(listed) == len(writers), check, f"list_runs shows {len(listed)} of 40 runs")


async def _reads_beside_a_writer_change_nothing(open_store: StoreOpener) -> None:
    check = "reads_beside_a_writer_change_nothing"
    async with open_store() as store:
        w = _Writer(store, _new_run_id("read-live"))
        done = trio.Event()
        seen: list[tuple[Record, ...]] = []

        async def read_all_the_time() -> None:
            while not done.is_set():
                seen.append((await _read_log(check, store, w.run_id)).records)
                await store.list_runs()
                await trio.lowlevel.checkpoint()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(read_all_the_time)
            nursery.start_soon(read_all_the_time)
            await w.started()
            for step in range(1, 13):  # a read after every write: no write may be refused
                await w.step(step, actions=step % 3)
            await w.finished()
            done.set()
        _expect(bool(seen), check, "the readers never ran")
        await _expect_log(check, store, w.run_id, w.written)
        final = tuple(w.written)
        for records in seen:  # every read saw a prefix of what was written, whole writes only
            _expect(
                records == final[: len(records)],
                check,
                f"a read beside the writer saw {len(records)} records that are not a prefix",
            )
            _expect(
                not records or not isinstance(records[-1], ActionResult),
                check,
                f"a read beside the writer saw {len(records)} records ending in an action "
                "result without its step record: write_step is not atomic",
            )


async def _cancelled_write_writes_nothing(open_store: StoreOpener) -> None:
    check = "cancelled_write_writes_nothing"
    async with open_store() as store:
        w = _Writer(store, _new_run_id("cancelled"))
        await w.started()
        writes = every_write(store, w.run_id, seq=w.seq, generation=await w.lease())
        for name, write in writes:
            with trio.CancelScope() as scope:
                scope.cancel()
                await write()
            _expect(scope.cancelled_caught, check, f"{name} in a cancelled scope returned")
            await _expect_log(check, store, w.run_id, w.written)
        await w.step(1)  # the run goes on at the seq it had
        await w.finished()
        await _expect_log(check, store, w.run_id, w.written)


async def _closed_store_refuses_writes(open_store: StoreOpener) -> None:
    check = "closed_store_refuses_writes"
    async with open_store() as store:
        w = _Writer(store, _new_run_id("closed"))
        await w.started()
    try:
        await w.model_call(1)
    except StoreError:
        return
    _expect(False, check, "a write after aclose was accepted")


async def _durable_after_reopen(open_store: StoreOpener) -> None:
    check = "durable_after_reopen"
    async with open_store() as store:
        w = _Writer(store, _new_run_id("reopen"))
        await w.started()
        await w.step(1, actions=2)
        await w.model_call(2)  # ends with a non-barrier write: aclose must flush it
    async with open_store() as store:
        await _expect_log(check, store, w.run_id, w.written)
        _expect(w.run_id in await store.list_runs(), check, "a reopened store lost the run")
        w.store = store
        w.gen = -1  # a new store object: take the lease again (a JSONL lock died with the old)
        await w.lease()
        attempt = dict(every_write(store, w.run_id, seq=2, generation=w.gen))["write_intent"]
        await _expect_conflict(store, w, "write_intent after reopen", attempt, 2)
        await w.action_intent(2, 0)  # the next seq continues where the log ends
        await w.finished()
    async with open_store() as store:
        await _expect_log(check, store, w.run_id, w.written)


RUN_STORE_CHECKS: Final[tuple[StoreCheck, ...]] = (
    StoreCheck(
        name="missing_run_reads_empty",
        doc="a run never written reads as an empty log, not an error, and is not listed",
        fn=_missing_run_reads_empty,
    ),
    StoreCheck(
        name="malformed_run_id_refused",
        doc="read_log of a string that is not a run id raises InvalidRunId, as writes do",
        fn=_malformed_run_id_refused,
    ),
    StoreCheck(
        name="writes_read_back_in_order",
        doc="every kind of write reads back equal, in write order, right after it returns",
        fn=_writes_read_back_in_order,
    ),
    StoreCheck(
        name="step_write_without_action",
        doc="write_step(None, step) appends the step record only",
        fn=_step_write_without_action,
    ),
    StoreCheck(
        name="step_write_with_several_results",
        doc="write_step appends every action result in order, then the step record",
        fn=_step_write_with_several_results,
    ),
    StoreCheck(
        name="conflict_on_wrong_seq",
        doc="a write with a seq other than the next raises ConflictError and changes nothing",
        fn=_conflict_on_wrong_seq,
    ),
    StoreCheck(
        name="record_contents_survive",
        doc=(
            "unicode, NUL, large text, nested JSON, None fields, errors and outcomes of every "
            "status read back equal"
        ),
        fn=_record_contents_survive,
    ),
    StoreCheck(
        name="list_runs_in_first_write_order",
        doc="list_runs names each run once, in the order of its first write",
        fn=_list_runs_in_first_write_order,
    ),
    StoreCheck(
        name="concurrent_runs_interleave",
        doc="40 runs written concurrently each read back exactly their own records",
        fn=_concurrent_runs_interleave,
    ),
    StoreCheck(
        name="reads_beside_a_writer_change_nothing",
        doc="reads (and listings) beside a writer never disturb it and see whole writes only",
        fn=_reads_beside_a_writer_change_nothing,
    ),
    StoreCheck(
        name="cancelled_write_writes_nothing",
        doc="each write called in a cancelled scope raises trio.Cancelled and writes nothing",
        fn=_cancelled_write_writes_nothing,
    ),
    StoreCheck(
        name="closed_store_refuses_writes",
        doc="a write after aclose raises StoreError",
        fn=_closed_store_refuses_writes,
    ),
    StoreCheck(
        name="durable_after_reopen",
        doc="a reopened store holds every write acknowledged before close and the next seq",
        fn=_durable_after_reopen,
        persistent_only=True,
    ),
)
"""Every check of the run store contract, in a stable order."""


async def check_run_store(open_store: StoreOpener, *, persistent: bool) -> None:
    """Run every check of `RUN_STORE_CHECKS` against a store, one after another.

    Args:
        open_store: opens the store under test (see `StoreOpener`); called several times.
        persistent: True when the store keeps its data across close and reopen; False skips
            the checks marked ``persistent_only``.

    Raises:
        StoreContractError: the first check the store fails, naming it; when the store
            raised an error the contract allows none of there (a ``KeyError`` for a missing
            run, a ``ConflictError`` for a write with the right seq), that error is its
            ``__cause__``.
        trio.TooSlowError: a check hung for `CHECK_TIMEOUT_S`.
    """
    for check in RUN_STORE_CHECKS:
        if persistent or not check.persistent_only:
            await check(open_store)
