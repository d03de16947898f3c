from __future__ import annotations

import contextlib
import re

import pytest
import trio
from runtime_fakes import LedgerTools, SimpleParser

from treadle._exceptions import UsageError
from treadle.actors import CANCEL_GRACE_S
from treadle.agent import Agent
from treadle.approvals import request_cancel
from treadle.stores.memory import MemoryStore
from treadle.supervisors import CONTROL_POLL_S, open_run
from treadle.testing.scripted import ScriptedModel, call, say
from treadle.types import (
    Action,
    ActionIntent,
    ActionOutcome,
    ActionResult,
    ActionStatus,
    CancelRequested,
    EventKind,
    ModelIntent,
    RunFinished,
    RunState,
    StopReason,
    ToolSpec,
)

# Three steps; the model takes 1 s per call and each tool call sleeps 1 s: 5 s in all.
TURNS = [
    call("sleep", s=1, call_id="c1"),
    call("sleep", s=1, call_id="c2"),
    say("done"),
]
RUN_S = 5.0


def make(tools=None, turns=TURNS):
    tools = tools or LedgerTools()
    model = ScriptedModel(turns=turns, latency_s=1.0)
    return Agent(model=model, executor=tools, parser=SimpleParser()), tools, model


def check_cancelled_log(log, tools, model):
    """No model call or action started after the cancel record; everything kept."""
    records = list(log.records)
    assert isinstance(records[-1], RunFinished)
    assert records[-1].state is RunState.CANCELLED
    assert isinstance(records[-2], CancelRequested)
    assert not any(isinstance(r, CancelRequested) for r in records[:-2])
    # Every model request and every tool execution has its intent in the log (an intent
    # whose request a cancel cut before it left has none: its result says so).
    assert len(model.requests) <= sum(isinstance(r, ModelIntent) for r in records)
    intents = {r.call_id for r in records if isinstance(r, ActionIntent)}
    assert {a.call_id for a in tools.executed} <= intents
    # Every action intent has a result (a cut action is kept as late, never applied).
    results = {r.intent_id: r for r in records if isinstance(r, ActionResult)}
    for intent in (r for r in records if isinstance(r, ActionIntent)):
        assert intent.intent_id in results


@pytest.mark.parametrize("tenths", range(0, int(RUN_S * 10) + 5, 2))
async def test_cancel_at_every_point_starts_nothing_after_the_cancel_record(tenths, autojump_clock):
    cancel_at = tenths / 10
    agent, tools, model = make()
    store = MemoryStore()
    async with open_run(agent, "x", store=store, run_id="r") as handle:
        await trio.sleep(cancel_at)
        before = handle.state
        requested = trio.current_time()
        handle.cancel("stop")
        result = await handle.wait()
        took = trio.current_time() - requested
    log = await store.read_log("r")
    if before.is_terminal or result.state is RunState.SUCCEEDED:
        # A terminal state never changes; a cancel that arrives while the run writes its
        # run-finished record is too late for it (docs/concepts.md, "Stop reasons").
        assert result.state is RunState.SUCCEEDED
        assert not any(isinstance(r, CancelRequested) for r in log.records)
        assert cancel_at >= RUN_S  # only at the very end
        return
    assert result.state is RunState.CANCELLED
    assert result.stop_reason is StopReason.CANCELLED
    assert took < 0.01  # the model stream and the tool call in flight were cut at once
    check_cancelled_log(log, tools, model)


@pytest.mark.parametrize("tenths", [3, 12, 15, 25, 37])
async def test_cancel_from_another_process_lands_within_the_poll_interval(tenths, autojump_clock):
    agent, tools, model = make()
    store = MemoryStore()
    async with open_run(agent, "x", store=store, run_id="r") as handle:
        await trio.sleep(tenths / 10)
        requested = trio.current_time()
        await request_cancel(store, "r", reason="from the CLI", canceller="ops")
        result = await handle.wait()
        took = trio.current_time() - requested
    assert result.state is RunState.CANCELLED
    assert took <= CONTROL_POLL_S + 0.01
    log = await store.read_log("r")
    check_cancelled_log(log, tools, model)
    assert (log.records[-2].reason, log.records[-2].canceller) == ("from the CLI", "ops")


async def test_a_cancel_written_while_nobody_drives_the_run_ends_it_on_resume(autojump_clock):
    store = MemoryStore()
    agent, _, _ = make()
    with trio.CancelScope() as crash:
        async with open_run(agent, "x", store=store, run_id="r"):
            await trio.sleep(1.5)
            crash.cancel()
    await request_cancel(store, "r", reason="gone")
    agent, tools, model = make()
    async with open_run(agent, store=store, run_id="r", control_poll_s=None) as handle:
        result = await handle.wait()
    assert result.state is RunState.CANCELLED
    assert model.requests == []
    assert tools.executed == []


async def test_a_finished_run_refuses_a_cancel(autojump_clock):
    agent, _, _ = make()
    store = MemoryStore()
    async with open_run(agent, "x", store=store, run_id="r") as handle:
        result = await handle.wait()
        handle.cancel("too late")
        assert handle.state is RunState.SUCCEEDED
    assert result.state is RunState.SUCCEEDED
    with pytest.raises(UsageError, match="already finished"):
        await request_cancel(store, "r")
    with pytest.raises(UsageError, match="no run"):
        await request_cancel(store, "nope")
    log = await store.read_log("r")
    assert not any(isinstance(r, CancelRequested) for r in log.records)


async def test_a_handle_asked_from_another_thread_refuses_and_names_the_way_to_ask():
    """From a plain thread (a sync web framework's, say), handle.cancel() failed with trio's
    "must be called from async context" and the run went on as if nothing was asked."""
    tools = LedgerTools()
    agent = Agent(
        model=ScriptedModel(turns=[call("sleep", s=3600, call_id="c1"), say("done")]),
        executor=tools,
        parser=SimpleParser(),
    )

    def ask_from_a_plain_thread(handle) -> dict[str, BaseException | None]:
        asked = {
            "cancel": lambda: handle.cancel("from a thread"),
            "approve": handle.approve,
            "drain": handle.drain,
        }
        errors: dict[str, BaseException | None] = {}
        for name, ask in asked.items():
            try:
                ask()
                errors[name] = None
            except BaseException as exc:
                errors[name] = exc
        return errors

    def cancel_from_another_trio_run(handle) -> BaseException | None:
        async def ask() -> None:
            handle.cancel("from another trio run")

        try:
            trio.run(ask)
        except BaseException as exc:
            return exc
        return None

    async with open_run(agent, "x", store=MemoryStore(), run_id="r") as handle:
        async with contextlib.aclosing(handle.events()) as events:
            async for event in events:
                if event.kind is EventKind.ACTION_REQUESTED:
                    break
        errors = await trio.to_thread.run_sync(ask_from_a_plain_thread, handle)
        errors["cancel in another trio run"] = await trio.to_thread.run_sync(
            cancel_from_another_trio_run, handle
        )
        for name, error in errors.items():
            assert isinstance(error, UsageError), (name, error)
            assert "came from another thread" in str(error), (name, error)
            method = name.split()[0]
            assert f"trio.from_thread.run_sync(handle.{method}" in str(error), (name, error)
        assert handle.state is RunState.RUNNING  # nothing was handed over
        token = trio.lowlevel.current_trio_token()
        await trio.to_thread.run_sync(
            lambda: trio.from_thread.run_sync(handle.cancel, "handed over", trio_token=token)
        )
        result = await handle.wait()
    assert result.state is RunState.CANCELLED


class CarefulTools:
    """``save(s)``: on cancellation, takes ``s`` seconds (shielded) to write its own state;
    ``finish``: when cancelled, completes anyway inside a shield and returns a result."""

    def __init__(self):
        self.saved = []
        self.executed = []

    def tool_specs(self):
        return (ToolSpec(name="save"), ToolSpec(name="finish"))

    def replay_policy(self, tool):
        from treadle.types import ReplayPolicy

        return ReplayPolicy.NEVER

    async def execute(self, action: Action) -> ActionOutcome:
        self.executed.append(action)
        try:
            await trio.sleep(100)
        except trio.Cancelled:
            with trio.CancelScope(shield=True):
                await trio.sleep(action.arguments.get("s", 0.5))
                self.saved.append(action.call_id)
            if action.tool == "finish":
                return ActionOutcome(
                    status=ActionStatus.EXECUTED, observation="finished", task_completed=True
                )
            raise
        return ActionOutcome(status=ActionStatus.EXECUTED, observation="slow")

    async def reconcile(self, action):
        return None


async def test_a_cancelled_tool_gets_a_shielded_grace_period_to_save_its_state(autojump_clock):
    tools = CarefulTools()
    agent, _, model = make(tools, turns=[call("save", s=0.5, call_id="c1"), say("x")])
    store = MemoryStore()
    async with open_run(agent, "x", store=store, run_id="r") as handle:
        await trio.sleep(2)
        handle.cancel()
        requested = trio.current_time()
        result = await handle.wait()
        took = trio.current_time() - requested
    assert result.state is RunState.CANCELLED
    assert tools.saved == ["c1"]
    assert 0.5 <= took < 0.6
    log = await store.read_log("r")
    check_cancelled_log(log, tools, model)
    (late,) = [r for r in log.records if isinstance(r, ActionResult)]
    assert late.late
    assert late.outcome.status is ActionStatus.UNKNOWN


async def test_the_grace_period_is_bounded(autojump_clock):
    tools = CarefulTools()
    agent, _, _ = make(tools, turns=[call("save", s=100, call_id="c1"), say("x")])
    store = MemoryStore()
    async with open_run(agent, "x", store=store, run_id="r") as handle:
        await trio.sleep(2)
        handle.cancel()
        requested = trio.current_time()
        result = await handle.wait()
        took = trio.current_time() - requested
    assert result.state is RunState.CANCELLED
    assert took == pytest.approx(CANCEL_GRACE_S, abs=0.01)


async def test_a_late_result_is_recorded_as_late_and_not_applied(autojump_clock):
    tools = CarefulTools()
    agent, _, model = make(tools, turns=[call("finish", s=0.2, call_id="c1"), say("x")])
    store = MemoryStore()
    async with open_run(agent, "x", store=store, run_id="r") as handle:
        await trio.sleep(2)
        handle.cancel()
        result = await handle.wait()
    # The tool said the task was completed, after the cancel: the run stays cancelled.
    assert result.state is RunState.CANCELLED
    assert result.stop_reason is StopReason.CANCELLED
    log = await store.read_log("r")
    check_cancelled_log(log, tools, model)
    (late,) = [r for r in log.records if isinstance(r, ActionResult)]
    assert late.late
    assert late.outcome.status is ActionStatus.EXECUTED
    assert late.outcome.observation == "finished"
    assert len(model.requests) == 1


# --------------------------------------------------------------- the CLI


@pytest.mark.parametrize("kind", ["sqlite", "jsonl"])
def test_cli_cancel_then_resume_and_tail(tmp_path, kind):
    import json

    from click.testing import CliRunner

    from treadle.cli import main
    from treadle.stores.jsonl import open_jsonl_store
    from treadle.stores.sqlite import open_sqlite_store

    if kind == "sqlite":
        db, open_store = tmp_path / "runs.db", open_sqlite_store
    else:
        db, open_store = tmp_path / "jsonl", open_jsonl_store
        db.mkdir()

    def agent():
        model = ScriptedModel(turns=[call("sleep", s=100, call_id="c1"), say("done")])
        return Agent(model=model, executor=LedgerTools(), parser=SimpleParser())

    async def crash_mid_run():
        async with open_store(db) as store:
            with trio.CancelScope() as crash:
                async with open_run(agent(), "x", store=store, run_id="r") as handle:
                    with trio.fail_after(30):  # until the action's intent (seq 4) is durable
                        async with contextlib.aclosing(handle.events()) as events:
                            async for event in events:
                                if event.seq >= 4:
                                    break
                    crash.cancel()

    trio.run(crash_mid_run)
    runner = CliRunner()
    cancelled = runner.invoke(main, ["cancel", "r", "--store", str(db), "--reason", "enough"])
    assert cancelled.exit_code == 0, cancelled.output
    assert "cancel requested" in cancelled.output
    unknown = runner.invoke(main, ["cancel", "nope", "--store", str(db)])
    assert unknown.exit_code != 0 and "no run 'nope'" in unknown.output

    async def resume():
        async with (
            open_store(db) as store,
            open_run(agent(), store=store, run_id="r") as handle,
        ):
            return await handle.wait()

    result = trio.run(resume)
    assert result.state is RunState.CANCELLED
    tailed = runner.invoke(main, ["tail", "r", "--store", str(db), "--from", "3", "--json"])
    assert tailed.exit_code == 0, tailed.output
    rows = [json.loads(line) for line in tailed.output.splitlines()]
    assert rows[0]["seq"] == 3
    assert [r["kind"] for r in rows[-2:]] == ["cancel_requested", "run_finished"]
    assert rows[-2]["reason"] == "enough"
    again = runner.invoke(main, ["cancel", "r", "--store", str(db)])
    assert again.exit_code != 0 and "already finished" in again.output
    readable = runner.invoke(main, ["tail", "r", "--store", str(db)])
    lines = readable.output.splitlines()
    assert lines[0].split()[:3] == ["1", "run", "started"]
    assert "cancel requested" in lines[-2] and "enough by treadle cancel" in lines[-2]


class SlowIntentStore(MemoryStore):
    """Action intents take 1 s to become durable."""

    async def write_intent(self, record, *, seq, generation):
        if isinstance(record, ActionIntent):
            await trio.sleep(1)
        await super().write_intent(record, seq=seq, generation=generation)


async def test_an_action_cancelled_while_its_intent_is_written_is_not_executed(autojump_clock):
    agent, tools, model = make()
    store = SlowIntentStore()
    async with open_run(agent, "x", store=store, run_id="r") as handle:
        await trio.sleep(1.5)  # the model answered at 1 s; the intent is being written
        handle.cancel()
        result = await handle.wait()
    assert result.state is RunState.CANCELLED
    assert tools.executed == []
    log = await store.read_log("r")
    check_cancelled_log(log, tools, model)
    (late,) = [r for r in log.records if isinstance(r, ActionResult)]
    assert late.late
    assert late.outcome.status is ActionStatus.NOT_EXECUTED
    assert "before the call started" in late.outcome.observation


@pytest.mark.parametrize("kind", ["memory", "sqlite"])
async def test_a_dropped_store_is_freed_within_the_trio_run_that_drove_it(kind, tmp_path):
    # The runs of a store share one reading of its control heads per trio run, found
    # through the store as a weak key; the index must not hold the store (and every log
    # it keeps) alive until the trio run ends.
    import gc
    import weakref

    from treadle.stores.sqlite import open_sqlite_store
    from treadle.supervisors._control import shared_index

    agent, _, _ = make(turns=[say("done")])
    if kind == "memory":
        store = MemoryStore()
        async with open_run(agent, "x", store=store, run_id="r") as handle:
            await handle.wait()
    else:
        async with (
            open_sqlite_store(str(tmp_path / "runs.db")) as store,
            open_run(agent, "x", store=store, run_id="r") as handle,
        ):
            await handle.wait()
    assert shared_index(store, CONTROL_POLL_S) is not None  # the runs had one
    dropped = weakref.ref(store)
    del store, handle
    gc.collect()
    assert dropped() is None


@pytest.mark.parametrize("run_id", ["", "bad id", "a#b", "x" * 201, "\udcff"])
async def test_cancel_and_decide_refuse_an_invalid_run_id_before_reading(tmp_path, run_id):
    # They answered "there is no run ..." (or a UnicodeEncodeError from the database driver)
    # where docs/concepts.md, "Run ids" promises InvalidRunId before anything is read.
    from treadle._exceptions import InvalidRunId
    from treadle.approvals import decide
    from treadle.stores.sqlite import open_sqlite_store

    async with open_sqlite_store(tmp_path / "runs.db") as store:
        with pytest.raises(InvalidRunId):
            await request_cancel(store, run_id)
        with pytest.raises(InvalidRunId):
            await decide(store, run_id)
        with pytest.raises(InvalidRunId):
            await store.read_log(run_id)


@pytest.mark.parametrize("command", ["cancel", "approve", "show", "tail", "resume"])
def test_the_cli_refuses_an_invalid_run_id_with_a_usage_error(tmp_path, command):
    from click.testing import CliRunner

    from treadle.cli import main

    args = [command, "\udcff", "--store", str(tmp_path / "runs.db")]
    if command == "resume":
        args += ["--agent", "nowhere:agent"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2, result.output
    assert re.search(r"Invalid value for '\[?RUN_ID\]?': invalid run id '\\udcff'", result.output)
    assert result.exception is None or isinstance(result.exception, SystemExit)


async def test_a_cancel_stored_before_the_run_ends_is_applied_not_left_behind(autojump_clock):
    """`treadle cancel` while the last call runs: the command said the run's driver stops
    it, but the run read its control stream only at its next poll (every
    ``control_poll_s``) and finished ``succeeded`` first, the cancel never applied. Before
    it ends, the run reads the stream once more: the cancel ends it ``cancelled``."""
    from treadle._cli_runs import cancel
    from treadle.parsers import NativeToolCallParser
    from treadle.tools import Toolbox, tool

    store = MemoryStore()
    told: list[str] = []

    @tool
    async def work(n: int) -> str:
        """Work, while someone cancels the run."""
        told.append(await cancel(store, "r", reason="stop", canceller="ops"))
        return "worked"

    agent = Agent(
        model=ScriptedModel(turns=[call("work", n=1), say("done")]),
        executor=Toolbox([work]),
        parser=NativeToolCallParser(),
    )
    async with open_run(agent, "x", store=store, run_id="r", control_poll_s=60) as handle:
        result = await handle.wait()
    assert "drives the run and stops it" in told[0]
    assert (result.state, result.stop_reason) == (RunState.CANCELLED, StopReason.CANCELLED)
    records = (await store.read_log("r")).records
    assert isinstance(records[-2], CancelRequested)
    assert (records[-2].reason, records[-2].canceller) == ("stop", "ops")
