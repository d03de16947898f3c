"""A run crashed at any write and resumed ends as the uninterrupted run with the same budgets.

The model call that brings a run exactly to its token or attempt budget is acted on live: its
step is finished and the next step stops at the top of the loop (docs/models.md, "Budgets
during a call"). A crash after its result is stored and before its step record leaves that
result in the log; the resumed run finishes the step from it (docs/crash-safety.md,
"Resume") and ends as the live run did, never stopping before the step as if the call had
not been made. A reply that crossed the token budget is acted on neither live nor resumed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import attrs
import pytest
import trio

import treadle
from treadle.testing.crashes import compare_trajectories
from treadle.testing.faults import CrashingExecutor, CrashingStore, SimulatedCrash
from treadle.testing.invariants import check_invariants
from treadle.testing.scripted import ScriptedModel, call, say
from treadle.types import (
    Action,
    ActionOutcome,
    ActionResult,
    ActionStatus,
    Budgets,
    ModelErrorInfo,
    ModelResult,
    RunLog,
    StopReason,
    Usage,
)


@treadle.tool
async def add(a: int, b: int) -> int:
    """Add two numbers."""
    return a + b


def _turns() -> list[treadle.types.ModelReply]:
    """Two steps of 40 then 60 tokens: the run spends 100 tokens in 2 attempts."""
    return [
        attrs.evolve(call("add", a=1, b=2), usage=Usage(input_tokens=30, output_tokens=10)),
        attrs.evolve(say("3"), usage=Usage(input_tokens=50, output_tokens=10)),
    ]


REFUSED = ModelErrorInfo(kind="invalid_request", message="refused", retryable=False)

CASES = {
    # the final answer reaches the token budget exactly: acted on
    "tokens-reached": (Budgets(token_budget=100), {}, StopReason.FINAL_ANSWER),
    # it crosses it: recorded, never acted on
    "tokens-crossed": (Budgets(token_budget=99), {}, StopReason.TOKEN_BUDGET),
    # the last attempt allowed brings the final answer
    "attempts-reached": (Budgets(max_model_attempts=2), {}, StopReason.FINAL_ANSWER),
    # the last attempt allowed fails for good: the failure is the run's end
    "attempts-failed": (Budgets(max_model_attempts=2), {1: [REFUSED]}, StopReason.MODEL_ERROR),
}


def _agent(budgets: Budgets, failures) -> treadle.Agent:
    return treadle.Agent(
        model=ScriptedModel(turns=_turns(), failures=failures),
        executor=treadle.Toolbox([add]),
        parser=treadle.NativeToolCallParser(),
        budgets=budgets,
    )


@pytest.mark.parametrize("case", list(CASES))
async def test_a_crash_at_every_write_resumes_to_the_uninterrupted_end(case):
    budgets, failures, expected = CASES[case]
    counting = CrashingStore(inner=treadle.MemoryStore(), crash_at=10**9)
    live = await treadle.run(_agent(budgets, failures), "go", store=counting, run_id="r")
    assert live.stop_reason is expected
    baseline = await counting.inner.read_log("r")
    for at, when in _crash_points(counting.writes):
        point = f"{case}: crash {when} write {at}"
        resumed, log = await _crashed_and_resumed(lambda: _agent(budgets, failures), at, when)
        assert check_invariants(log) == [], point
        if _abandoned(log) and live.totals.model_attempts == budgets.max_model_attempts:
            # the live run used every attempt allowed, and the one whose outcome the
            # crash lost counts too (docs/concepts.md, "Budgets")
            assert resumed.stop_reason is StopReason.MAX_MODEL_ATTEMPTS, point
            continue
        assert resumed.stop_reason is expected, point
        assert resumed.final_answer == live.final_answer, point
        assert compare_trajectories(log, baseline) == [], point


async def test_a_reply_reporting_no_usage_is_not_acted_on_after_a_crash_either():
    # Under a token budget, a reply of unknown usage ends the run (docs/decisions/0114); a
    # crash right after it was stored must not let the resumed run act on it.
    def agent() -> treadle.Agent:
        return treadle.Agent(
            model=ScriptedModel(
                turns=[attrs.evolve(call("add", a=1, b=2), usage=Usage()), say("3", usage=Usage())]
            ),
            executor=treadle.Toolbox([add]),
            parser=treadle.NativeToolCallParser(),
            budgets=Budgets(token_budget=1000),
        )

    counting = CrashingStore(inner=treadle.MemoryStore(), crash_at=10**9)
    live = await treadle.run(agent(), "go", store=counting, run_id="r")
    assert live.stop_reason is StopReason.TOKEN_BUDGET
    for at, when in _crash_points(counting.writes):
        point = f"crash {when} write {at}"
        resumed, log = await _crashed_and_resumed(agent, at, when)
        assert resumed.stop_reason is StopReason.TOKEN_BUDGET, point
        assert not [r for r in log.records if isinstance(r, ActionResult)], point
        assert check_invariants(log, budgets=Budgets(token_budget=1000)) == [], point


def _crash_points(writes: int) -> list[tuple[int, Literal["before", "after"]]]:
    """Every store write of a run of ``writes`` writes, crashed before and after it."""
    whens: tuple[Literal["before", "after"], ...] = ("before", "after")
    return [(at, when) for at in range(1, writes + 1) for when in whens]


async def _crashed_and_resumed(
    agent: Callable[[], treadle.Agent], at: int, when: Literal["before", "after"]
) -> tuple[treadle.RunResult, RunLog]:
    """Run ``agent()`` until it crashes at write ``at`` (``when``), then resume it in a new
    drive on the same memory store: what the resumed drive returns, and the log."""
    store = treadle.MemoryStore()
    dying = CrashingStore(inner=store, crash_at=at, when=when)
    with pytest.raises((treadle.RunInterrupted, SimulatedCrash)):
        await treadle.run(agent(), "go", store=dying, run_id="r")
    with trio.fail_after(30):
        resumed = await treadle.run(agent(), "go", store=store, run_id="r")
    return resumed, await store.read_log("r")


def _abandoned(log: RunLog) -> bool:
    return any(isinstance(r, ModelResult) and r.abandoned for r in log.records)


async def test_a_call_reaching_the_token_budget_is_reconciled_after_a_crash_in_it():
    """The reply that reaches the budget asks for a call; the process dies while it runs.

    Live, the call runs and the run then ends with ``token_budget``. Resumed, the call is
    not forgotten: the tool's reconcile hook is asked for its outcome, as for any call
    interrupted while it ran, and the run ends with ``token_budget`` after the step.
    """
    asked: list[str] = []

    async def booked(action: Action) -> ActionOutcome:
        asked.append(action.intent_id)
        return ActionOutcome(status=ActionStatus.EXECUTED, observation="booked (reconciled)")

    @treadle.tool(reconcile=booked)
    async def book(seat: str) -> str:
        """Book a seat."""
        return f"booked {seat}"

    def agent() -> treadle.Agent:
        reply = attrs.evolve(
            call("book", seat="3A"), usage=Usage(input_tokens=60, output_tokens=40)
        )
        return treadle.Agent(
            model=ScriptedModel(turns=[reply, say("done")]),
            executor=treadle.Toolbox([book]),
            parser=treadle.NativeToolCallParser(),
            budgets=Budgets(token_budget=100),
        )

    store = treadle.MemoryStore()
    dying = CrashingStore(inner=store, crash_at=10**9)
    crashing = agent()
    crashing = attrs.evolve(
        crashing,
        executor=CrashingExecutor(inner=crashing.executor, crash_at=1, when="after", store=dying),
    )
    with pytest.raises((treadle.RunInterrupted, SimulatedCrash)):
        await treadle.run(crashing, "book 3A", store=dying, run_id="r")
    with trio.fail_after(30):
        resumed = await treadle.run(agent(), store=store, run_id="r")
    log = await store.read_log("r")
    assert resumed.stop_reason is StopReason.TOKEN_BUDGET
    assert asked == ["r/s1/a1"]
    (result,) = [r for r in log.records if isinstance(r, ActionResult)]
    assert (result.outcome.status, result.outcome.observation) == (
        ActionStatus.EXECUTED,
        "booked (reconciled)",
    )
    assert [s.step for s in log.steps] == [1]
    assert check_invariants(log) == []
