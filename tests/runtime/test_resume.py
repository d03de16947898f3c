from __future__ import annotations

import json

import pytest
import trio
from runtime_fakes import LedgerTools, SimpleParser

from treadle._exceptions import RunInterrupted, SnapshotMismatch, UsageError
from treadle._state import seconds_between
from treadle.agent import Agent
from treadle.stores.memory import MemoryStore
from treadle.supervisors import run
from treadle.testing.faults import CrashingStore, SimulatedCrash
from treadle.testing.scripted import ScriptedModel, call, say
from treadle.types import (
    ActionOutcome,
    ActionResult,
    ActionStatus,
    Limits,
    ModelErrorInfo,
    ModelIntent,
    ModelResult,
    StepRecord,
    StopReason,
)

TURNS = [call("add", a=1, b=2, call_id="c1"), call("add", a=3, b=4, call_id="c2"), say("done")]


def agent_with(tools, *, safe=frozenset()):
    tools.safe = safe
    return Agent(model=ScriptedModel(turns=TURNS), executor=tools, parser=SimpleParser())


async def baseline():
    store = MemoryStore()
    tools = LedgerTools()
    result = await run(agent_with(tools), "go", store=store, run_id="r")
    return result, await store.read_log("r")


async def test_baseline_writes_fifteen_records():
    _, log = await baseline()
    assert len(log.records) == 15


@pytest.mark.parametrize("when", ["before", "after"])
@pytest.mark.parametrize("crash_at", range(1, 14))  # 13 store writes
async def test_crash_at_every_write_then_resume(crash_at, when):
    expected, expected_log = await baseline()
    memory = MemoryStore()
    tools = LedgerTools()
    with pytest.raises((RunInterrupted, SimulatedCrash)):
        await run(
            agent_with(tools),
            "go",
            store=CrashingStore(inner=memory, crash_at=crash_at, when=when),
            run_id="r",
        )
    result = await run(agent_with(tools), "go", store=memory, run_id="r")
    log = await memory.read_log("r")
    # No `never` action ran twice: each call id executed at most once.
    call_ids = [a.call_id for a in tools.executed]
    assert len(call_ids) == len(set(call_ids))
    assert result.stop_reason == expected.stop_reason
    assert result.final_answer == expected.final_answer
    steps = [r for r in log.records if isinstance(r, StepRecord)]
    assert [s.step for s in steps] == [1, 2, 3]
    # Every action result has its step record right after the batch.
    for i, record in enumerate(log.records):
        if isinstance(record, ActionResult):
            assert isinstance(log.records[i + 1], StepRecord | ActionResult)
    unknown = [
        r
        for r in log.records
        if isinstance(r, ActionResult) and r.outcome.status is ActionStatus.UNKNOWN
    ]
    # A crash between an action intent and its result: the action may or may not have run
    # before the crash; resume never runs it again and records UNKNOWN.
    assert 2 - len(unknown) <= len(tools.executed) <= 2
    abandoned = [r for r in log.records if isinstance(r, ModelResult) and r.abandoned]
    # An abandoned model attempt adds its abandoned result and the fresh attempt's intent.
    assert len(log.records) == len(expected_log.records) + 2 * len(abandoned)


async def test_safe_tool_is_reexecuted_under_same_intent_id():
    memory = MemoryStore()
    tools = LedgerTools()
    # write 4 is the first action intent; crash after it: the action never ran.
    with pytest.raises((RunInterrupted, SimulatedCrash)):
        await run(
            agent_with(tools, safe=frozenset({"add"})),
            "go",
            store=CrashingStore(inner=memory, crash_at=4, when="after"),
            run_id="r",
        )
    assert tools.executed == []
    await run(agent_with(tools, safe=frozenset({"add"})), "go", store=memory, run_id="r")
    assert tools.executed[0].intent_id == "r/s1/a1"
    log = await memory.read_log("r")
    first = next(r for r in log.records if isinstance(r, ActionResult))
    assert first.outcome.status is ActionStatus.EXECUTED


async def test_snapshot_mismatch_names_keys():
    memory = MemoryStore()
    with pytest.raises((RunInterrupted, SimulatedCrash)):
        await run(
            agent_with(LedgerTools()),
            "go",
            store=CrashingStore(inner=memory, crash_at=3),
            run_id="r",
        )
    other = Agent(
        model=ScriptedModel(turns=TURNS),
        executor=LedgerTools(),
        parser=SimpleParser(),
        system_prompt="be different",
        model_name="other",
    )
    with pytest.raises(SnapshotMismatch) as info:
        await run(other, store=memory, run_id="r")
    assert info.value.keys == ["model", "system_prompt"]


@pytest.mark.parametrize("finished", [True, False])
async def test_another_input_under_a_run_id_is_refused_finished_or_not(finished):
    # Before, a finished run returned its stored answer to a question it was never asked.
    memory = MemoryStore()
    tools = LedgerTools()
    if finished:
        first = await run(agent_with(tools), "go", store=memory, run_id="r")
        assert first.stop_reason is StopReason.FINAL_ANSWER
    else:
        with pytest.raises((RunInterrupted, SimulatedCrash)):
            await run(
                agent_with(tools), "go", store=CrashingStore(inner=memory, crash_at=3), run_id="r"
            )
    records = len((await memory.read_log("r")).records)
    with pytest.raises(UsageError, match=r"input differs .* give a new run id"):
        await run(agent_with(LedgerTools()), "something else", store=memory, run_id="r")
    assert len((await memory.read_log("r")).records) == records  # nothing written
    again = await run(agent_with(LedgerTools()), "go", store=memory, run_id="r")  # lease let go
    assert again.stop_reason is StopReason.FINAL_ANSWER
    assert (await run(agent_with(LedgerTools()), store=memory, run_id="r")) == again


@pytest.mark.parametrize(
    "error",
    [
        ModelErrorInfo(kind="bad_request", status=400),
        ModelErrorInfo(kind="server_error", retryable=True, status=503),
    ],
)
async def test_a_model_call_that_failed_for_good_is_not_rerun_after_a_crash(error):
    """The process dies between the final model error and its step record (docs/crash-safety.md, "Resume")."""
    retries = 0 if not error.retryable else 1
    failures = {0: [error] * (retries + 1)}
    limits = Limits(max_model_retries=retries, retry_initial_s=0.001, retry_max_s=0.001)
    model = ScriptedModel(turns=[say("never")], failures=failures)
    agent = Agent(model=model, executor=LedgerTools(), parser=SimpleParser(), limits=limits)
    store = MemoryStore()
    # Writes: run started, then intent + result per attempt; die right after the last result.
    last_result = 1 + 2 * (retries + 1)
    with pytest.raises((SimulatedCrash, RunInterrupted)):
        await run(
            agent,
            "x",
            store=CrashingStore(inner=store, crash_at=last_result, when="after"),
            run_id="r",
        )
    calls_before = len(model.requests)
    assert calls_before == retries + 1
    result = await run(agent, store=store, run_id="r")
    assert len(model.requests) == calls_before  # nothing re-run: the failure is reused
    assert result.stop_reason is StopReason.MODEL_ERROR
    log = await store.read_log("r")
    (step,) = log.steps
    assert step.decision is None


async def test_a_resumed_step_counts_the_recorded_model_time_as_active(autojump_clock):
    model = ScriptedModel(turns=[call("add", a=1, b=2), say("3")], latency_s=2.0)
    agent = Agent(model=model, executor=LedgerTools(), parser=SimpleParser())
    store = MemoryStore()
    # Writes: run started, model intent, model result, action intent (the barrier that makes
    # the result durable); die right after it, before the action's result and step record.
    crashing = CrashingStore(inner=store, crash_at=4, when="after")
    with pytest.raises((SimulatedCrash, RunInterrupted)):
        await run(agent, "x", store=crashing, run_id="r")
    await run(agent, store=store, run_id="r")
    log = await store.read_log("r")
    result = next(r for r in log.records if isinstance(r, ModelResult))
    assert result.latency_s >= 2.0
    # The model call the crashed process made counts in the resumed step's active time.
    assert log.steps[0].active_s >= result.latency_s


class ReconcilingTools(LedgerTools):
    """LedgerTools whose reconcile finds every call it executed (an idempotency-key lookup)."""

    async def reconcile(self, action):
        await super().reconcile(action)
        if any(a.intent_id == action.intent_id for a in self.executed):
            return ActionOutcome(status=ActionStatus.EXECUTED, observation="found: 3")
        return None


async def test_a_reconciled_result_is_marked_in_the_log_the_events_and_show(tmp_path):
    """Issue 13 item 5: an outcome established by a reconcile hook looked exactly like an
    executed one. Crash right after the first action's call ran (before its result)."""
    from click.testing import CliRunner

    from treadle.cli import main
    from treadle.stores.sqlite import open_sqlite_store

    tools = ReconcilingTools()
    db = tmp_path / "runs.db"
    async with open_sqlite_store(db) as raw:
        crashing = CrashingStore(inner=raw, crash_at=5, when="before")  # the first action result
        with pytest.raises((RunInterrupted, SimulatedCrash)):
            await run(agent_with(tools), "go", store=crashing, run_id="r")
    assert [a.call_id for a in tools.executed] == ["c1"]
    async with open_sqlite_store(db) as store:
        result = await run(agent_with(tools), "go", store=store, run_id="r")
        log = await store.read_log("r")
    assert result.final_answer == "done"
    results = [r for r in log.records if isinstance(r, ActionResult)]
    assert [(r.call_id, r.reconciled) for r in results] == [("c1", True), ("c2", False)]
    assert [a.call_id for a in tools.executed] == ["c1", "c2"]  # c1 never ran twice

    def cli(*args, **kwargs):
        return trio.to_thread.run_sync(lambda: CliRunner().invoke(main, list(args), **kwargs))

    shown = await cli("show", "r", "--store", str(db), env={"COLUMNS": "250"})
    assert shown.exit_code == 0, shown.output
    assert shown.output.count("reconciled after a crash") == 1
    as_json = await cli("show", "r", "--store", str(db), "--json")
    rows = [json.loads(line) for line in as_json.output.splitlines()]
    assert [r.get("reconciled", False) for r in rows if r["kind"] == "action_finished"] == [
        True,
        False,
    ]


class _TrioTimeClock:
    """A wall clock that follows trio's (a mock clock's jumps included)."""

    def now_iso(self):
        import datetime as dt

        start = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
        return (start + dt.timedelta(seconds=trio.current_time())).isoformat()


async def test_a_run_resumed_during_a_retry_after_wait_waits_out_what_is_left(autojump_clock):
    """The server asked for 60 s; the process died 20 s into the wait: the resumed run sends
    its next attempt 60 s after the refused one, not at once (docs/models.md)."""
    from treadle.supervisors import open_run

    rate = ModelErrorInfo(kind="rate_limited", retryable=True, retry_after_s=60)
    store, clock = MemoryStore(), _TrioTimeClock()
    model = ScriptedModel(turns=[say("hi")], failures={0: [rate]})
    agent = Agent(model=model, executor=LedgerTools(), parser=SimpleParser())
    with pytest.raises(RuntimeError):
        async with open_run(agent, "x", store=store, run_id="r", clock=clock):
            await trio.sleep(20)
            raise RuntimeError("the process died")
    resumed = Agent(
        model=ScriptedModel(turns=[say("hi")]), executor=LedgerTools(), parser=SimpleParser()
    )
    began = trio.current_time()
    result = await run(resumed, store=store, run_id="r", clock=clock)
    assert result.final_answer == "hi"
    log = await store.read_log("r")
    refused = next(r for r in log.records if isinstance(r, ModelResult) and r.error is not None)
    retried = [r for r in log.records if isinstance(r, ModelIntent)][-1]
    assert retried.attempt == 2
    assert seconds_between(refused.ts, retried.ts) >= 60
    assert 39 <= trio.current_time() - began < 45  # what was left of the wait, no more
