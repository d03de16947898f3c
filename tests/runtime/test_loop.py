from __future__ import annotations

import attrs
import pytest
import trio
from runtime_fakes import LedgerTools, SimpleParser

from treadle._cli_common import describe
from treadle._exceptions import ModelCallError, RunInterrupted, UsageError
from treadle.agent import Agent
from treadle.stores.memory import MemoryStore
from treadle.supervisors import open_run, run
from treadle.testing.invariants import check_invariants
from treadle.testing.scripted import ScriptedModel, call, say
from treadle.types import (
    ActionResult,
    ActionStatus,
    Attempt,
    Budgets,
    EventKind,
    Limits,
    ModelErrorInfo,
    RunState,
    StopReason,
    Usage,
)


def make_agent(turns, **kwargs):
    tools = kwargs.pop("tools", None) or LedgerTools()
    model = ScriptedModel(turns=turns, failures=kwargs.pop("failures", {}))
    return Agent(model=model, executor=tools, parser=SimpleParser(), **kwargs), tools, model


async def test_two_tool_steps_then_final_answer():
    agent, tools, model = make_agent([call("add", a=1, b=2), call("add", a=3, b=4), say("7")])
    store = MemoryStore()
    result = await run(agent, "add things", store=store, run_id="r1")
    assert result.state is RunState.SUCCEEDED
    assert result.stop_reason is StopReason.FINAL_ANSWER
    assert result.final_answer == "7"
    assert result.totals.steps == 3
    assert [a.arguments for a in tools.executed] == [{"a": 1, "b": 2}, {"a": 3, "b": 4}]
    # The third request saw both observations, as tool messages answering the calls.
    last = model.requests[-1].messages
    assert [m.role for m in last] == ["user", "assistant", "tool", "assistant", "tool"]
    assert [m.content for m in last if m.role == "tool"] == ["3", "7"]
    log = await store.read_log("r1")
    kinds = [type(r).__name__ for r in log.records]
    assert kinds == [
        "RunStarted",
        "ModelIntent",
        "ModelResult",
        "ActionIntent",
        "ActionResult",
        "StepRecord",
        "ModelIntent",
        "ModelResult",
        "ActionIntent",
        "ActionResult",
        "StepRecord",
        "ModelIntent",
        "ModelResult",
        "StepRecord",
        "RunFinished",
    ]


async def test_task_completed_beats_budget():
    agent, _, _ = make_agent([call("done")], budgets=Budgets(max_steps=1))
    result = await run(agent, "x", store=MemoryStore())
    assert result.stop_reason is StopReason.TASK_COMPLETED


async def test_env_error_ends_run_with_synthetic_observation():
    agent, _, _ = make_agent([call("boom"), say("never")])
    store = MemoryStore()
    result = await run(agent, "x", store=store, run_id="r")
    assert result.stop_reason is StopReason.ENV_ERROR
    assert result.state is RunState.FAILED
    log = await store.read_log("r")
    (action,) = [r for r in log.records if isinstance(r, ActionResult)]
    assert action.outcome.status is ActionStatus.ENV_ERROR
    assert action.outcome.observation_is_synthetic
    assert action.outcome.detail == "db connection lost"
    assert action.outcome.observation == agent.synthetic.env_error.format(tool="boom", detail="")


async def test_unknown_tool_not_executed_and_run_continues():
    agent, _, model = make_agent([call("nope"), say("fine")])
    result = await run(agent, "x", store=MemoryStore())
    assert result.stop_reason is StopReason.FINAL_ANSWER
    tool_msg = [m for m in model.requests[1].messages if m.role == "tool"][0]
    assert tool_msg.content.startswith("Error: the call to nope was not executed")


async def test_invalid_decisions_stop_after_limit():
    agent, _, _ = make_agent([say("")] * 5)
    result = await run(agent, "x", store=MemoryStore())
    assert result.stop_reason is StopReason.INVALID_DECISIONS
    assert result.totals.steps == 3


async def test_max_steps():
    agent, _, _ = make_agent([call("add", a=1, b=1)] * 5, budgets=Budgets(max_steps=2))
    result = await run(agent, "x", store=MemoryStore())
    assert result.stop_reason is StopReason.MAX_STEPS
    assert result.totals.steps == 2


async def test_retry_then_success_counts_attempts(autojump_clock):
    rate = ModelErrorInfo(kind="rate_limited", retryable=True, retry_after_s=7)
    agent, _, _ = make_agent([say("hi")], failures={0: [rate, rate]})
    start = trio.current_time()
    result = await run(agent, "x", store=MemoryStore())
    assert result.stop_reason is StopReason.FINAL_ANSWER
    assert result.totals.model_attempts == 3
    assert trio.current_time() - start >= 14


async def test_model_error_for_good():
    bad = ModelErrorInfo(kind="context_length_exceeded", retryable=False)
    agent, _, _ = make_agent([say("hi")], failures={0: [bad]})
    result = await run(agent, "x", store=MemoryStore())
    assert result.stop_reason is StopReason.MODEL_ERROR
    assert result.error == "context_length_exceeded"
    assert result.totals.model_attempts == 1


async def test_a_wait_longer_than_the_cap_ends_the_call_live_and_on_resume(autojump_clock):
    """A server-directed wait longer than `Limits.retry_after_max_s` ends the call at once
    (decision 0102). A crash after that attempt's result was durable and before its step
    record made the resumed run retry it (a new paid call) and succeed."""
    from treadle.testing.faults import CrashingStore, SimulatedCrash

    quota = ModelErrorInfo(kind="rate_limited", retryable=True, retry_after_s=50.0)
    limits = Limits(retry_after_max_s=5.0)
    live, _, _ = make_agent([say("hi")], failures={0: [quota]}, limits=limits)
    result = await run(live, "x", store=MemoryStore())
    assert result.stop_reason is StopReason.MODEL_ERROR and result.totals.model_attempts == 1

    store = MemoryStore()
    crashed, _, _ = make_agent([say("hi")], failures={0: [quota]}, limits=limits)
    # Writes: run started, model intent, model result; die once the result is stored.
    with pytest.raises((SimulatedCrash, RunInterrupted)):
        await run(
            crashed, "x", store=CrashingStore(inner=store, crash_at=3, when="after"), run_id="r"
        )
    resumed, _, model = make_agent([say("hi")], limits=limits)
    result = await run(resumed, store=store, run_id="r")
    assert result.stop_reason is StopReason.MODEL_ERROR and result.error == "rate_limited"
    assert model.requests == []  # the recorded failure is reused, never retried
    assert result.totals.model_attempts == 1


async def test_max_model_attempts(autojump_clock):
    err = ModelErrorInfo(kind="server_error", retryable=True)
    agent, _, _ = make_agent(
        [say("hi")], failures={0: [err] * 10}, budgets=Budgets(max_model_attempts=3)
    )
    result = await run(agent, "x", store=MemoryStore())
    assert result.stop_reason is StopReason.MAX_MODEL_ATTEMPTS
    assert result.totals.model_attempts == 3


async def test_token_budget():
    reply = call("add", a=1, b=1)
    reply = type(reply)(
        tool_calls=reply.tool_calls,
        finish_reason="tool_calls",
        usage=Usage(input_tokens=60, output_tokens=50),
    )
    agent, _, _ = make_agent([reply] * 5, budgets=Budgets(token_budget=200))
    result = await run(agent, "x", store=MemoryStore())
    assert result.stop_reason is StopReason.TOKEN_BUDGET
    assert result.totals.input_tokens == 120


async def test_a_total_reported_without_its_parts_counts_against_the_token_budget():
    """A server that reports only ``total_tokens`` never met the token budget, and its
    attempts were counted as unknown usage."""
    reply = attrs.evolve(call("add", a=1, b=1), usage=Usage(total_tokens=500))
    agent, _, _ = make_agent([reply] * 3, budgets=Budgets(token_budget=100))
    store = MemoryStore()
    result = await run(agent, "x", store=store, run_id="r")
    assert result.stop_reason is StopReason.TOKEN_BUDGET
    assert result.totals.model_attempts == 1
    assert (result.totals.input_tokens, result.totals.output_tokens) == (None, None)
    assert result.totals.other_tokens == 500 and result.totals.unknown_usage_attempts == 0
    assert check_invariants(await store.read_log("r")) == []


async def test_a_total_reported_while_streaming_cuts_the_attempt_at_the_token_budget():
    class TotalsOnly:
        async def complete(self, request, *, on_delta=None, attempt=Attempt.STANDALONE):
            attempt.report_usage(Usage(total_tokens=500))
            return say("too late")

    agent = Agent(
        model=TotalsOnly(),
        executor=LedgerTools(),
        parser=SimpleParser(),
        budgets=Budgets(token_budget=100),
    )
    result = await run(agent, "x", store=MemoryStore())
    assert result.stop_reason is StopReason.TOKEN_BUDGET and result.final_answer is None
    assert result.totals.other_tokens == 500


def test_the_budget_counts_input_and_output_or_a_larger_total():
    assert Usage().known_total is None
    assert Usage(input_tokens=7).known_total == 7  # a failure after the prompt was counted
    assert Usage(input_tokens=7, output_tokens=3, total_tokens=10).known_total == 10
    assert Usage(total_tokens=500).known_total == 500
    # A total that counts more than its parts (tokens the parts leave out) counts in full.
    assert Usage(input_tokens=7, output_tokens=3, total_tokens=14).known_total == 14
    assert Usage(input_tokens=7, output_tokens=3, total_tokens=4).known_total == 10


async def test_unknown_usage_never_counted_as_zero():
    agent, _, _ = make_agent([say("hi", usage=Usage())])
    result = await run(agent, "x", store=MemoryStore())
    assert result.totals.input_tokens is None
    assert result.totals.unknown_usage_attempts == 1


async def test_a_reply_reporting_no_usage_ends_a_token_budgeted_run():
    """With ``token_budget=1`` and a client that reports no usage, nine steps ran to a final
    answer: the budget bound nothing and nothing said so (docs/decisions/0114)."""
    refused = ModelErrorInfo(kind="rate_limited", retryable=True, retry_after_s=0)
    turns = [attrs.evolve(call("add", a=1, b=1), usage=Usage()), say("2", usage=Usage())]
    agent, tools, _ = make_agent(turns, failures={0: [refused]}, budgets=Budgets(token_budget=1000))
    store = MemoryStore()
    result = await run(agent, "x", store=store, run_id="r")
    log = await store.read_log("r")
    # the failed attempt of unknown usage was retried; the reply of unknown usage ended it
    assert (result.state, result.stop_reason) == (RunState.FAILED, StopReason.TOKEN_BUDGET)
    assert result.totals.model_attempts == 2 and result.totals.unknown_usage_attempts == 2
    assert tools.executed == [] and result.totals.steps == 0  # the reply was not acted on
    assert check_invariants(log, budgets=Budgets(token_budget=1000)) == []
    assert describe(log.finished) == (
        "run finished",
        "failed (token_budget), 2 model attempts reported no usage, 0 steps",
    )
    # without a token budget, unknown usage is only reported
    agent, tools, _ = make_agent(turns)
    result = await run(agent, "x", store=MemoryStore())
    assert result.stop_reason is StopReason.FINAL_ANSWER and len(tools.executed) == 1


async def test_time_budget_cancels_tool_in_flight(autojump_clock):
    agent, _, _ = make_agent([call("sleep", s=100), say("late")], budgets=Budgets(time_budget_s=5))
    store = MemoryStore()
    start = trio.current_time()
    result = await run(agent, "x", store=store, run_id="r")
    assert result.stop_reason is StopReason.TIME_BUDGET
    assert 5 <= trio.current_time() - start < 6
    log = await store.read_log("r")
    # The cut call has its one result: unknown, late (never applied).
    (result,) = [r for r in log.records if isinstance(r, ActionResult)]
    assert result.late and result.outcome.status is ActionStatus.UNKNOWN
    assert check_invariants(log) == []


async def test_cancel_from_handle_during_tool(autojump_clock):
    agent, _, _ = make_agent([call("sleep", s=100), say("late")])
    store = MemoryStore()
    async with open_run(agent, "x", store=store, run_id="r") as handle:
        await trio.sleep(1)
        assert handle.state is RunState.RUNNING
        handle.cancel("user pressed stop")
        result = await handle.wait()
    assert result.state is RunState.CANCELLED
    assert result.stop_reason is StopReason.CANCELLED
    log = await store.read_log("r")
    assert type(log.records[-2]).__name__ == "CancelRequested"
    assert log.records[-2].reason == "user pressed stop"


async def test_events_are_gapless_and_match_log():
    agent, _, _ = make_agent([call("add", a=1, b=2), say("3")])
    store = MemoryStore()
    seen = []
    async with open_run(agent, "x", store=store, run_id="r") as handle:
        async for event in handle.events():
            if event.durable:
                seen.append(event)
    log = await store.read_log("r")
    assert [e.seq for e in seen] == list(range(1, len(log.records) + 1))
    assert [e.record for e in seen] == list(log.records)
    assert seen[-1].kind is EventKind.RUN_FINISHED


async def test_resume_finished_run_returns_stored_result():
    agent, tools, model = make_agent([call("add", a=1, b=2), say("3")])
    store = MemoryStore()
    first = await run(agent, "x", store=store, run_id="r")
    again = await run(agent, store=store, run_id="r")
    assert again == first
    assert len(tools.executed) == 1
    assert len(model.requests) == 2


async def test_model_call_error_from_client_propagates_classification():
    class RefusingModel:
        async def complete(self, request, *, on_delta=None, attempt=Attempt.STANDALONE):
            await trio.lowlevel.checkpoint()
            raise ModelCallError(ModelErrorInfo(kind="auth", status=401, message="key revoked"))

    agent = Agent(model=RefusingModel(), executor=LedgerTools(), parser=SimpleParser())
    store = MemoryStore()
    result = await run(agent, "x", store=store, run_id="r")
    # The client's classification reaches the log and the result; auth is never retried.
    log = await store.read_log("r")
    (failed,) = [r for r in log.records if type(r).__name__ == "ModelResult"]
    assert failed.error.kind == "auth"
    assert ModelCallError(ModelErrorInfo(kind="auth")).info.kind == "auth"
    assert result.stop_reason is StopReason.MODEL_ERROR and result.error == "auth"
    assert result.totals.model_attempts == 1
    # The whole failure, not a bare word (issue 13 item 5): kind, status, message.
    assert result.model_error == ModelErrorInfo(kind="auth", status=401, message="key revoked")
    assert log.finished is not None and log.finished.model_error == result.model_error
    title, detail = describe(log.finished)
    assert title == "run finished" and "auth HTTP 401 key revoked" in detail


async def test_a_stalled_attempt_is_ended_by_the_attempt_deadline_and_retried(autojump_clock):
    from treadle.testing.scripted import STALLED
    from treadle.types import Limits, ModelResult

    agent, _, _ = make_agent(
        [say("hi")],
        failures={0: [ModelErrorInfo(kind=STALLED)]},
        limits=Limits(model_attempt_s=5.0, retry_initial_s=0.5),
    )
    store = MemoryStore()
    start = trio.current_time()
    result = await run(agent, "x", store=store, run_id="r")
    assert result.stop_reason is StopReason.FINAL_ANSWER
    assert result.totals.model_attempts == 2
    assert 5 <= trio.current_time() - start < 7
    log = await store.read_log("r")
    first = next(r for r in log.records if isinstance(r, ModelResult))
    assert first.error is not None and first.error.kind == "timeout"


@pytest.mark.parametrize(
    ("make", "named"),
    [
        (lambda: Budgets(max_steps="10"), "Budgets.max_steps"),
        (lambda: Budgets(time_budget_s="60"), "Budgets.time_budget_s"),
        (lambda: Budgets(max_steps=-1), "Budgets.max_steps"),
        (lambda: Budgets(token_budget=1.5), "Budgets.token_budget"),
        (lambda: Budgets(max_model_attempts=True), "Budgets.max_model_attempts"),
        (lambda: Budgets(time_budget_s=float("nan")), "Budgets.time_budget_s"),
        (lambda: Limits(tool_timeout_s=-1), "Limits.tool_timeout_s"),
        (lambda: Limits(max_model_retries=None), "Limits.max_model_retries"),
        (lambda: Limits(max_observation_chars="many"), "Limits.max_observation_chars"),
        # out of range: a deadline no ISO-8601 instant can hold, a wait that cannot be met
        (lambda: Limits(approval_timeout_s=float("inf")), "Limits.approval_timeout_s"),
        (lambda: Limits(approval_timeout_s=1e12), "Limits.approval_timeout_s"),
        (lambda: Budgets(time_budget_s=float("inf")), "Budgets.time_budget_s"),
        (lambda: Limits(model_attempt_s=0), "Limits.model_attempt_s"),
        (lambda: Limits(tool_timeout_s=0.0), "Limits.tool_timeout_s"),
        (lambda: Limits(invalid_decisions=0), "Limits.invalid_decisions"),
    ],
)
def test_a_budget_or_limit_of_the_wrong_kind_is_refused_when_made(make, named):
    # Before, such a budget was taken, and the run failed at its first check with a
    # TypeError that named no budget, leaving an unfinished run in the store.
    with pytest.raises(UsageError, match=rf"^{named} must be .*, not "):
        make()


@pytest.mark.parametrize(
    ("setting", "value"),
    [
        ("control_poll_s", float("nan")),
        ("control_poll_s", 0),
        ("control_poll_s", -1.0),
        ("control_poll_s", float("inf")),
        ("park_after_s", float("nan")),
        ("park_after_s", -1.0),
    ],
)
async def test_open_run_refuses_a_poll_or_park_interval_out_of_range(setting, value):
    """A NaN control poll failed later with trio's own ValueError and left a broken run in
    the store; 0 or less read the control stream without pause."""
    agent, _, _ = make_agent([say("hi")])
    store = MemoryStore()
    with pytest.raises(UsageError, match=rf"^{setting} must be a finite number of seconds"):
        async with open_run(agent, "x", store=store, run_id="r", **{setting: value}):
            pass
    assert (await store.read_log("r")).records == ()  # nothing was written


def test_zero_and_unlimited_budgets_are_allowed():
    assert Budgets(max_steps=0, token_budget=0, time_budget_s=0).max_steps == 0
    assert Budgets(max_steps=None, max_model_attempts=None).max_steps is None
    assert Limits(max_observation_chars=None, tool_timeout_s=0.5).tool_timeout_s == 0.5
