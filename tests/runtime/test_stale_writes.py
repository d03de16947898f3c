"""Stale-write protection through whole runs (docs/concepts.md, "Stale writes").

A booking desk with revisioned reservations; `get_reservation` reads one and reports its
revision, `change_seat` writes one and compares the revision the model saw with the current
one inside its own (synchronous, so atomic) transaction.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs
import pytest

import treadle
from treadle._exceptions import RunInterrupted
from treadle._state import fold
from treadle.stores.memory import MemoryStore
from treadle.testing import CrashingStore, ScriptedModel, SimulatedCrash, call, calls, say
from treadle.types import (
    Action,
    ActionOutcome,
    ActionResult,
    ActionStatus,
    Attempt,
    ModelReply,
    ModelRequest,
    RunLog,
    StepRecord,
    ToolCall,
)

KEY = "reservation:R1"


@attrs.define(eq=False)
class Desk:
    """Reservations by id: (seat, revision). Revisions start at 0."""

    seats: dict[str, tuple[str, int]] = attrs.Factory(lambda: {"R1": ("12A", 0)})
    writes: list[tuple[str, int | None]] = attrs.Factory(list)

    def change_elsewhere(self, reservation_id: str, seat: str) -> None:
        """Someone else changes the booking (the customer on the website)."""
        _, revision = self.seats[reservation_id]
        self.seats[reservation_id] = (seat, revision + 1)


def toolbox(desk: Desk, *, seen: list[dict[str, tuple[int, ...]]] | None = None) -> treadle.Toolbox:
    @treadle.tool(reads="reservation:{reservation_id}", replay=treadle.ReplayPolicy.SAFE)
    async def get_reservation(reservation_id: str) -> treadle.Observed[dict[str, Any]]:
        """Read a reservation."""
        seat, revision = desk.seats[reservation_id]
        return treadle.Observed({"seat": seat, "revision": revision}, revision=revision)

    @treadle.tool(writes="reservation:{reservation_id}")
    async def change_seat(
        reservation_id: str, seat: str, context: treadle.ToolContext
    ) -> treadle.Observed[str]:
        """Move a reservation to another seat."""
        desk.writes.append((seat, context.seen_revision))
        _, current = desk.seats[reservation_id]  # the transaction: no await from here on
        if current != context.seen_revision:
            raise treadle.StaleWrite(current=current)
        desk.seats[reservation_id] = (seat, current + 1)
        return treadle.Observed(f"moved to {seat}", revision=current + 1)

    @treadle.tool(writes="reservation:{reservation_id}", base_revision="revision")
    async def cancel_seat(reservation_id: str, revision: int) -> str:
        """Give up the seat of a reservation, from the revision you read."""
        desk.writes.append(("", revision))
        _, current = desk.seats[reservation_id]
        if current != revision:
            raise treadle.StaleWrite(current=current)
        desk.seats[reservation_id] = ("", current + 1)
        return "seat released"

    class Recording(treadle.Toolbox):
        async def execute(self, action: Action, *, replay: bool = False) -> ActionOutcome:
            if seen is not None:
                seen.append(dict(action.revisions))
            return await super().execute(action, replay=replay)

    return Recording([get_reservation, change_seat, cancel_seat])


@attrs.define(eq=False)
class Meanwhile:
    """A scripted model during whose call for ``turn`` the world changes (once)."""

    inner: ScriptedModel
    turn: int
    change: Callable[[], None]
    done: bool = False

    async def complete(
        self,
        request: ModelRequest,
        *,
        on_delta: Any = None,
        attempt: Attempt = Attempt.STANDALONE,
    ) -> ModelReply:
        if not self.done and sum(m.role == "assistant" for m in request.messages) == self.turn:
            self.done = True
            self.change()
        return await self.inner.complete(request, on_delta=on_delta, attempt=attempt)


def agent(desk: Desk, turns: list[ModelReply], **kwargs: Any) -> treadle.Agent:
    model = kwargs.pop("model", None) or ScriptedModel(turns=turns)
    return treadle.Agent(
        model=model,
        executor=toolbox(desk, seen=kwargs.pop("seen", None)),
        parser=treadle.NativeToolCallParser(),
        **kwargs,
    )


def results(log: RunLog) -> list[ActionResult]:
    return [r for r in log.records if isinstance(r, ActionResult)]


def observations(log: RunLog) -> list[str]:
    return [o for r in log.records if isinstance(r, StepRecord) for o in r.observations]


READ = call("get_reservation", reservation_id="R1")
MOVE = call("change_seat", reservation_id="R1", seat="3C")


async def test_a_write_after_a_read_gets_the_revision_read_even_revision_0() -> None:
    desk, store = Desk(), MemoryStore()
    result = await treadle.run(agent(desk, [READ, MOVE, say("ok")]), "go", store=store)
    log = await store.read_log(result.run_id)
    read, move = results(log)
    assert read.outcome.revisions == {KEY: 0}
    assert desk.writes == [("3C", 0)]
    assert move.outcome.status is ActionStatus.EXECUTED
    assert move.outcome.revisions == {KEY: 1}
    assert desk.seats["R1"] == ("3C", 1)
    assert fold(log.records).revisions == {KEY: (0, 1)}


async def test_a_write_the_run_never_read_for_is_not_executed() -> None:
    desk, store = Desk(), MemoryStore()
    result = await treadle.run(agent(desk, [MOVE, say("ok")]), "go", store=store)
    log = await store.read_log(result.run_id)
    (move,) = results(log)
    assert desk.writes == []  # the tool never ran
    assert move.outcome.status is ActionStatus.NOT_EXECUTED
    assert observations(log) == [
        "Error: the call to change_seat was not executed: reservation:R1 was not read in "
        "this run (a read from before it, earlier in the conversation, does not count); read "
        "it now, then change it from what you read"
    ]


async def test_a_run_that_continues_another_writes_from_its_own_reads_only() -> None:
    # A thread's next run and a fork hold the read of the run before them in their history.
    # It does not count for their writes (decision 0140), and the refusal says so: it said
    # the resource "was not read", with the read in the model's history.
    desk, store = Desk(), MemoryStore()
    talk = [READ, say("seat 12A"), MOVE, READ, MOVE, say("moved")]
    await treadle.run(agent(desk, talk), "show R1", store=store, run_id="t")
    await treadle.run(agent(desk, talk), "move me to 3C", store=store, thread_id="t")
    retry = [READ, MOVE, READ, MOVE, say("moved")]  # tries step 2 of t again: the write
    await treadle.run(agent(desk, retry), store=store, run_id="f", fork_of="t", at_step=2)
    for run_id, revision in (("t.2", 0), ("f", 1)):
        log = await store.read_log(run_id)
        refused, read, moved = results(log)
        assert read.outcome.revisions == {KEY: revision}
        assert observations(log)[0] == (
            "Error: the call to change_seat was not executed: reservation:R1 was not read in "
            "this run (a read from before it, earlier in the conversation, does not count); "
            "read it now, then change it from what you read"
        ), run_id
        assert refused.outcome.status is ActionStatus.NOT_EXECUTED
        assert moved.outcome.status is ActionStatus.EXECUTED
    assert desk.writes == [("3C", 0), ("3C", 1)]  # each from its own run's read


async def test_a_read_in_the_same_batch_does_not_count_for_the_write() -> None:
    # The model issued both calls before it saw what the read returned.
    desk, store = Desk(), MemoryStore()
    batch = calls(
        ToolCall(id="r", name="get_reservation", arguments={"reservation_id": "R1"}),
        ToolCall(id="w", name="change_seat", arguments={"reservation_id": "R1", "seat": "3C"}),
    )
    result = await treadle.run(agent(desk, [batch, say("ok")]), "go", store=store)
    read, move = results(await store.read_log(result.run_id))
    assert read.outcome.status is ActionStatus.EXECUTED
    assert move.outcome.status is ActionStatus.NOT_EXECUTED
    assert desk.writes == []


async def test_a_booking_changed_between_read_and_write_is_read_again() -> None:
    desk, store = Desk(), MemoryStore()
    turns = [READ, MOVE, READ, MOVE, say("ok")]
    model = Meanwhile(
        ScriptedModel(turns=turns), turn=1, change=lambda: desk.change_elsewhere("R1", "20F")
    )
    result = await treadle.run(agent(desk, turns, model=model), "go", store=store)
    log = await store.read_log(result.run_id)
    first_read, stale, second_read, move = results(log)
    assert first_read.outcome.revisions == {KEY: 0}
    assert stale.outcome.status is ActionStatus.NOT_EXECUTED
    assert stale.outcome.stale_resource == KEY
    assert stale.outcome.revisions == {}
    assert observations(log)[1] == (
        "Error: the call to change_seat was not executed: reservation:R1 changed since you "
        "read it (you read revision 0; it is now at revision 1). Read it again, then decide "
        "again from what you read."
    )
    assert second_read.outcome.revisions == {KEY: 1}
    assert move.outcome.status is ActionStatus.EXECUTED
    assert desk.writes == [("3C", 0), ("3C", 1)]
    assert desk.seats["R1"] == ("3C", 2)


async def test_the_stale_text_is_the_definitions() -> None:
    desk, store = Desk(), MemoryStore()
    turns = [READ, MOVE, say("ok")]
    model = Meanwhile(
        ScriptedModel(turns=turns), turn=1, change=lambda: desk.change_elsewhere("R1", "20F")
    )
    synthetic = treadle.SyntheticObservations(stale="{resource} moved on ({detail}) [{tool}]")
    result = await treadle.run(
        agent(desk, turns, model=model, synthetic=synthetic), "go", store=store
    )
    log = await store.read_log(result.run_id)
    assert observations(log)[1] == (
        "reservation:R1 moved on (you read revision 0; it is now at revision 1) [change_seat]"
    )


async def test_a_base_revision_the_run_never_read_is_refused() -> None:
    desk, store = Desk(), MemoryStore()
    turns = [
        READ,
        call("cancel_seat", reservation_id="R1", revision=5),
        call("cancel_seat", reservation_id="R1", revision=0),
        say("ok"),
    ]
    result = await treadle.run(agent(desk, turns), "go", store=store)
    log = await store.read_log(result.run_id)
    _, refused, done = results(log)
    assert refused.outcome.status is ActionStatus.NOT_EXECUTED
    assert (
        "revision 5 of reservation:R1 was never read in this run (read: 0)"
        in (observations(log)[1])
    )
    assert done.outcome.status is ActionStatus.EXECUTED
    assert desk.writes == [("", 0)]  # the refused call never ran; revision 0 is one


async def test_an_older_base_revision_the_run_read_is_handed_over_and_found_stale() -> None:
    desk, store = Desk(), MemoryStore()
    turns = [READ, READ, call("cancel_seat", reservation_id="R1", revision=0), say("ok")]
    model = Meanwhile(
        ScriptedModel(turns=turns), turn=1, change=lambda: desk.change_elsewhere("R1", "20F")
    )
    result = await treadle.run(agent(desk, turns, model=model), "go", store=store)
    log = await store.read_log(result.run_id)
    assert fold(log.records).revisions == {KEY: (0, 1)}
    stale = results(log)[2]
    assert stale.outcome.stale_resource == KEY
    assert desk.writes == [("", 0)]


@pytest.mark.parametrize("when", ["before", "after"])
async def test_resume_after_a_crash_between_read_and_write_keeps_the_revision(when: str) -> None:
    # Writes: 1 run-started, 2 model intent, 3 model result, 4 read intent, 5 read result and
    # step, 6 model intent, 7 model result, 8 the write's intent. The process dies at the
    # write's intent: the read's revision is in the log, and nowhere else.
    baseline_desk, baseline_store = Desk(), MemoryStore()
    await treadle.run(
        agent(baseline_desk, [READ, MOVE, say("ok")]), "go", store=baseline_store, run_id="r"
    )
    baseline = await baseline_store.read_log("r")

    desk, memory = Desk(), MemoryStore()
    crashing = CrashingStore(inner=memory, crash_at=8, when=when)  # type: ignore[arg-type]
    with pytest.raises((RunInterrupted, SimulatedCrash)):
        await treadle.run(agent(desk, [READ, MOVE, say("ok")]), "go", store=crashing, run_id="r")
    before = fold((await memory.read_log("r")).records).revisions
    assert before == {KEY: (0,)}
    assert desk.writes == []  # the crash came before the write could run

    seen: list[dict[str, tuple[int, ...]]] = []
    await treadle.run(
        agent(desk, [READ, MOVE, say("ok")], seen=seen), "go", store=memory, run_id="r"
    )
    log = await memory.read_log("r")
    if when == "before":
        assert seen == [before]  # the write, checked against the table folded from the log
        assert desk.writes == [("3C", 0)]
        assert desk.seats["R1"] == ("3C", 1)
        assert fold(log.records).revisions == fold(baseline.records).revisions
        assert [r.outcome for r in results(log)] == [r.outcome for r in results(baseline)]
    else:  # the intent is durable: a `never` write is not run again, its outcome unknown
        assert seen == []
        assert results(log)[1].outcome.status is ActionStatus.UNKNOWN
        assert fold(log.records).revisions == before


async def test_late_and_refused_results_do_not_count_as_observed() -> None:
    from treadle._state import RunView

    def result(status: ActionStatus, *, late: bool = False) -> ActionResult:
        return ActionResult(
            run_id="r",
            step=1,
            intent_id="r/s1/a1",
            call_id="c",
            tool="t",
            ts="",
            late=late,
            outcome=ActionOutcome(status=status, observation="", revisions={KEY: 3}),
        )

    view = RunView()
    view.apply(result(ActionStatus.EXECUTED, late=True))
    view.apply(result(ActionStatus.NOT_EXECUTED))
    assert view.revisions == {}
    view.apply(result(ActionStatus.EXECUTED))
    assert view.revisions == {KEY: (3,)}


@pytest.mark.parametrize(
    ("read", "written"),
    [(None, "null"), (7, "7"), (True, "true"), ("null", None), ("7", 7), (1.5, "1.5")],
)
async def test_a_write_of_a_value_of_another_type_than_the_one_read_is_not_executed(
    read: object, written: object
) -> None:
    """Account ``None`` and account ``"null"`` (``7`` and ``"7"``) had one key: a write of an
    account the model never read ran, handed the other account's revision."""
    accounts: dict[object, int] = {read: 0, written: 0}
    wrote: list[object] = []

    @treadle.tool(reads="acct:{acct_id}")
    async def get_acct(acct_id: str | int | float | bool | None) -> treadle.Observed[str]:
        """Read an account."""
        return treadle.Observed(f"account {acct_id!r}", revision=accounts[acct_id])

    @treadle.tool(writes="acct:{acct_id}")
    async def set_acct(
        acct_id: str | int | float | bool | None, context: treadle.ToolContext
    ) -> str:
        """Overwrite an account."""
        wrote.append(acct_id)
        return "written"

    turns = [call("get_acct", acct_id=read), call("set_acct", acct_id=written), say("done")]
    store = MemoryStore()
    ran = treadle.Agent(
        model=ScriptedModel(turns=turns),
        executor=treadle.Toolbox([get_acct, set_acct]),
        parser=treadle.NativeToolCallParser(),
    )
    result = await treadle.run(ran, "go", store=store)
    log = await store.read_log(result.run_id)
    read_result, write_result = results(log)
    assert wrote == []  # the tool never ran
    assert write_result.outcome.status is ActionStatus.NOT_EXECUTED
    (read_key,) = read_result.outcome.revisions
    assert f"{read_key} was not read" not in (write_result.outcome.detail or "")
    assert "was not read in this run" in (write_result.outcome.detail or "")
