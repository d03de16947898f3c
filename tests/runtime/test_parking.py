"""A run that waits on a human long enough is parked: its actors stop, then it resumes."""

from __future__ import annotations

import collections
import functools
import gc
import weakref

import pytest
import trio
import trio.testing
from runtime_fakes import LedgerTools, SimpleParser

from treadle._exceptions import StoreError, UsageError
from treadle.agent import Agent
from treadle.approvals import decide, request_cancel
from treadle.parsers import NativeToolCallParser
from treadle.stores.memory import MemoryStore
from treadle.supervisors import open_run
from treadle.testing.scripted import ScriptedModel, call, say
from treadle.tools import Toolbox, tool
from treadle.types import (
    ActionIntent,
    ActionResult,
    ActionStatus,
    ApprovalDecided,
    Budgets,
    EventKind,
    Limits,
    RunLog,
    RunState,
    StepRecord,
    StopReason,
)

PARK_AFTER_S = 5.0


def only_add(tool_name, arguments):
    return tool_name == "add"


def make(turns, *, latency_s=0.0, **kwargs):
    tools = LedgerTools()
    model = ScriptedModel(turns=turns, latency_s=latency_s)
    return Agent(model=model, executor=tools, parser=SimpleParser(), **kwargs), tools


def count_tasks() -> int:
    """Every task alive in this trio run."""

    def walk(task) -> int:
        return 1 + sum(walk(child) for n in task.child_nurseries for child in n.child_tasks)

    return walk(trio.lowlevel.current_root_task())


PARKING = {"approval_policy": only_add, "park_after_s": PARK_AFTER_S}
"""What `opened` passes: ``add`` waits for approval, and the run parks after a while."""


def opened(agent, store, **kwargs):
    return open_run(agent, "x", store=store, run_id="r", **PARKING, **kwargs)


async def parked(handle) -> None:
    """Wait until the run is parked (its coordinator gone, the request pending)."""
    with trio.fail_after(3600):
        assert await handle.wait_parked(), f"the run ended instead of parking: {handle.state}"
    await trio.sleep(0.1)  # the actors are told to stop once parked; let them end


async def test_a_parked_run_stops_its_actors_and_an_approval_resumes_it(autojump_clock):
    agent, tools = make([call("add", a=1, b=2, call_id="c1"), say("3")], latency_s=0.5)
    store = MemoryStore()
    async with opened(agent, store) as handle:
        await trio.sleep(1)
        assert handle.state is RunState.AWAITING_APPROVAL
        waiting_tasks = count_tasks()
        await parked(handle)
        assert handle.state is RunState.AWAITING_APPROVAL
        assert handle.pending_approval.call_id == "c1"
        # The writer, hydrator, gateway, executor and control poller are gone: only the
        # task driving the run (parked) is left of it.
        assert count_tasks() <= waiting_tasks - 5
        assert tools.executed == []
        await trio.sleep(60)
        handle.approve("c1")
        result = await handle.wait()
    assert result.stop_reason is StopReason.FINAL_ANSWER
    assert [a.arguments for a in tools.executed] == [{"a": 1, "b": 2}]
    log = await store.read_log("r")
    names = [type(r).__name__ for r in log.records]
    assert names.count("ApprovalRequested") == names.count("ApprovalDecided") == 1
    assert names.index("ApprovalDecided") < names.index("ActionIntent")
    # The step's active time carries over the parking: the 0.5 s model call before it,
    # not the minute of waiting.
    first_step = next(r for r in log.records if isinstance(r, StepRecord))
    assert 0.5 <= first_step.active_s < 1.0
    assert result.totals.active_s < 2.0


async def test_an_event_stream_carries_on_across_parking(autojump_clock):
    agent, _ = make([call("add", a=1, b=2, call_id="c1"), say("3")])
    store = MemoryStore()
    async with opened(agent, store) as handle:

        async def decide_later():
            await parked(handle)
            await trio.sleep(30)
            handle.approve()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(decide_later)
            live = [e async for e in handle.events()]
    async with open_run(agent, store=store, run_id="r") as finished:
        stored = [e async for e in finished.events()]
    assert live == stored
    assert live[-1].kind is EventKind.RUN_FINISHED
    durable = [e.seq for e in live if e.durable]
    assert durable == list(range(1, len(durable) + 1))


@pytest.mark.parametrize(
    ("decision", "executed", "observation"),
    [
        ({"edit": {"a": 10, "b": 20}}, [{"a": 10, "b": 20}], "30"),
        ({"reject": "no"}, [], None),
    ],
)
async def test_edit_and_reject_while_parked(autojump_clock, decision, executed, observation):
    agent, tools = make([call("add", a=1, b=2, call_id="c1"), say("ok")])
    store = MemoryStore()
    async with opened(agent, store) as handle:
        await parked(handle)
        handle.approve(**decision)
        with pytest.raises(UsageError, match="not waiting"):
            handle.approve()  # decided already; the run is on its way back
        await handle.wait()
    assert [a.arguments for a in tools.executed] == executed
    log = await store.read_log("r")
    (result,) = [r for r in log.records if isinstance(r, ActionResult)]
    if observation is None:
        assert result.outcome.status is ActionStatus.NOT_EXECUTED
        assert not any(isinstance(r, ActionIntent) for r in log.records)
    else:
        assert result.outcome.observation == observation


async def test_cancel_while_parked_starts_no_action(autojump_clock):
    agent, tools = make([call("add", a=1, b=2, call_id="c1"), say("ok")])
    store = MemoryStore()
    async with opened(agent, store) as handle:
        await parked(handle)
        handle.cancel("changed my mind")
        assert handle.state is RunState.CANCELLING
        result = await handle.wait()
    assert result.stop_reason is StopReason.CANCELLED
    assert tools.executed == []
    log = await store.read_log("r")
    assert not any(isinstance(r, ActionIntent) for r in log.records)


async def test_the_control_log_reaches_a_parked_run(autojump_clock):
    agent, tools = make([call("add", a=1, b=2, call_id="c1"), say("ok")])
    store = MemoryStore()
    async with opened(agent, store, control_poll_s=0.5) as handle:
        await parked(handle)
        await decide(store, "r", call_id="c1")  # as `treadle approve` does
        with trio.fail_after(1):
            await handle.wait()
    assert len(tools.executed) == 1


async def test_a_cancel_from_another_process_reaches_a_parked_run(autojump_clock):
    agent, tools = make([call("add", a=1, b=2, call_id="c1"), say("ok")])
    store = MemoryStore()
    async with opened(agent, store, control_poll_s=0.5) as handle:
        await parked(handle)
        await request_cancel(store, "r", reason="stop")
        with trio.fail_after(1):
            result = await handle.wait()
    assert result.stop_reason is StopReason.CANCELLED
    assert tools.executed == []


async def test_the_deadline_of_a_parked_run_expires_its_request(autojump_clock):
    agent, tools = make(
        [call("add", a=1, b=2, call_id="c1"), say("ok")],
        budgets=Budgets(time_budget_s=60),
        limits=Limits(approval_timeout_s=900),
    )
    store = MemoryStore()
    async with opened(agent, store) as handle:
        began = trio.current_time()
        result = await handle.wait()
    assert 899 <= trio.current_time() - began < 901
    assert result.stop_reason is StopReason.FINAL_ANSWER
    assert tools.executed == []
    log = await store.read_log("r")
    (decided,) = [r for r in log.records if isinstance(r, ApprovalDecided)]
    assert decided.decision == "expired"


async def test_each_call_of_a_batch_can_park_in_turn(autojump_clock):
    from treadle.testing.scripted import calls
    from treadle.types import ToolCall

    batch = calls(
        ToolCall(id="a", name="add", arguments={"a": 1, "b": 1}),
        ToolCall(id="b", name="add", arguments={"a": 2, "b": 2}),
    )
    agent, tools = make([batch, say("ok")])
    store = MemoryStore()
    async with opened(agent, store) as handle:
        for call_id in ("a", "b"):
            await parked(handle)
            assert handle.pending_approval.call_id == call_id
            handle.approve(call_id)
            with trio.fail_after(3600):
                await handle.wait_state(RunState.RUNNING, RunState.SUCCEEDED)
        await handle.wait()
    # The batch's calls run concurrently: in any order.
    assert sorted(a.call_id for a in tools.executed) == ["a", "b"]
    log = await store.read_log("r")
    names = [type(r).__name__ for r in log.records]
    # Both decisions precede both intents: a batch is decided before any call starts.
    assert names.index("ActionIntent") > max(
        i for i, n in enumerate(names) if n == "ApprovalDecided"
    )


async def test_parking_can_be_switched_off(autojump_clock):
    agent, _ = make([call("add", a=1, b=2, call_id="c1"), say("ok")])
    store = MemoryStore()
    async with open_run(
        agent, "x", store=store, run_id="r", approval_policy=only_add, park_after_s=None
    ) as handle:
        await trio.sleep(600)
        assert not handle.parked and handle.state is RunState.AWAITING_APPROVAL
        handle.approve()
        await handle.wait()


async def test_a_resumed_run_keeps_waiting_even_without_the_approval_policy(autojump_clock):
    """A call put to a human stays so when the run goes on without the policy (a change of
    definition accepted knowingly: without it the resume is refused)."""
    agent, tools = make([call("add", a=1, b=2, call_id="c1"), say("ok")])
    store = MemoryStore()
    with trio.CancelScope() as crash:
        async with opened(agent, store) as handle:
            await parked(handle)
            crash.cancel()  # the process dies while the run is parked
    async with open_run(
        agent, store=store, run_id="r", park_after_s=PARK_AFTER_S, accept_definition_change=True
    ) as handle:
        await parked(handle)
        assert handle.pending_approval.call_id == "c1"
        assert tools.executed == []
        handle.approve(edit={"a": 5, "b": 5})
        await handle.wait()
    assert [a.arguments for a in tools.executed] == [{"a": 5, "b": 5}]


@tool(requires_approval=True)
async def ping(host: str = "localhost") -> str:
    """Ping ``host``."""
    return f"pong from {host}"


async def test_an_edit_to_empty_arguments_is_an_edit(autojump_clock):
    model = ScriptedModel(turns=[call("ping", host="prod-db", call_id="c1"), say("ok")])
    agent = Agent(model=model, executor=Toolbox([ping]), parser=NativeToolCallParser())
    store = MemoryStore()
    async with open_run(agent, "x", store=store, run_id="r", park_after_s=1) as handle:
        await parked(handle)
        decided = handle.approve(edit={})
        await handle.wait()
    assert decided.decision == "edit" and decided.edited_arguments == {}
    log = await store.read_log("r")
    (intent,) = [r for r in log.records if isinstance(r, ActionIntent)]
    assert intent.arguments == {}  # not the model's {"host": "prod-db"}
    (step,) = [r for r in log.records if isinstance(r, StepRecord)][:1]
    assert step.observations == ("pong from localhost",)


async def test_a_second_control_log_decision_for_the_same_call_is_refused(autojump_clock):
    agent, tools = make([call("add", a=1, b=2, call_id="c1"), say("ok")])
    store = MemoryStore()
    async with opened(agent, store, control_poll_s=0.5) as handle:
        await parked(handle)
        await decide(store, "r", edit={"a": 1000, "b": 0})
        with pytest.raises(UsageError, match="already has a decision"):
            await decide(store, "r", reject="wrong amount")
        await handle.wait()
    assert [a.arguments for a in tools.executed] == [{"a": 1000, "b": 0}]


async def test_a_decision_written_just_before_the_deadline_counts(autojump_clock):
    agent, tools = make(
        [call("add", a=1, b=2, call_id="c1"), say("ok")], limits=Limits(approval_timeout_s=30)
    )
    store = MemoryStore()
    async with opened(agent, store, control_poll_s=0.5) as handle:
        await handle.wait_state(RunState.AWAITING_APPROVAL)
        deadline = trio.current_time() + 30  # the request's approval_timeout_s
        await parked(handle)
        await trio.sleep_until(deadline - 0.1)  # between two polls, 0.1 s before the end
        await decide(store, "r")
        await handle.wait()
    log = await store.read_log("r")
    (decided,) = [r for r in log.records if isinstance(r, ApprovalDecided)]
    assert decided.decision == "approve"
    assert len(tools.executed) == 1


def test_the_shared_control_listing_survives_a_store_used_in_two_trio_runs():
    store = MemoryStore()
    agent, tools = make([call("add", a=1, b=2, call_id="c1"), say("ok")])

    async def drive(run_id):
        async with open_run(
            agent, "x", store=store, run_id=run_id, approval_policy=only_add, park_after_s=1
        ) as handle:
            await parked(handle)
            await decide(store, run_id)  # from "another process": through the control log
            with trio.fail_after(60):
                await handle.wait()

    first = trio.testing.MockClock(autojump_threshold=0)
    first.jump(1_000_000)  # a clock far ahead of the next run's
    trio.run(drive, "a", clock=first)
    trio.run(drive, "b", clock=trio.testing.MockClock(autojump_threshold=0))
    assert len(tools.executed) == 2


async def test_events_refuses_a_seq_below_one(autojump_clock):
    agent, _ = make([say("ok")])
    store = MemoryStore()
    async with open_run(agent, "x", store=store, run_id="r") as handle:
        with pytest.raises(UsageError, match="numbered from 1"):
            async for _ in handle.events(from_seq=0):
                pass
        for wrong in (2.5, "3", True):  # a raw TypeError, or (True) the events from seq 1
            with pytest.raises(UsageError, match="must be a whole number"):
                async for _ in handle.events(from_seq=wrong):  # type: ignore[arg-type]
                    pass


async def test_a_decided_parked_run_reports_running(autojump_clock):
    agent, _ = make([call("add", a=1, b=2, call_id="c1"), say("ok")])
    async with opened(agent, MemoryStore()) as handle:
        await parked(handle)
        handle.approve()
        assert handle.state is RunState.RUNNING and handle.pending_approval is None
        await handle.wait()


class ListSink:
    def __init__(self):
        self.events = []

    async def send(self, event):
        self.events.append(event)


class SlowThenFastSink(ListSink):
    """Takes 1 s per event for its first 5 events: its buffer is full when the run parks."""

    async def send(self, event):
        if len(self.events) < 5:
            await trio.sleep(1)
        self.events.append(event)


class FailingSink:
    def __init__(self):
        self.calls = 0

    async def send(self, event):
        self.calls += 1
        raise RuntimeError("sink is down")


async def test_sinks_see_every_event_and_counters_span_the_parking(autojump_clock):
    agent, _ = make([call("add", a=1, b=2, call_id="c1"), say("3")])
    store = MemoryStore()
    slow, failing = SlowThenFastSink(), FailingSink()
    async with opened(agent, store, sinks=[slow, failing]) as handle:
        await parked(handle)
        parked_failures = handle.statistics().sink_failures
        await trio.sleep(30)  # the slow sink catches up while the run is parked
        handle.approve()
        await handle.wait()
        await trio.sleep(1)
    log = await store.read_log("r")
    # Every durable event (and step-started) reached the slow sink, in order, no hole.
    assert [e.seq for e in slow.events if e.durable] == list(range(1, len(log.records) + 1))
    # The counters of the run-finished record cover the stretches before and after parking.
    assert 0 < parked_failures < log.finished.sink_failures <= failing.calls


async def test_an_edit_that_is_not_strict_json_is_refused(autojump_clock):
    agent, tools = make([call("add", a=1, b=2, call_id="c1"), say("ok")])
    store = MemoryStore()
    async with opened(agent, store, control_poll_s=0.5) as handle:
        await parked(handle)
        with pytest.raises(UsageError, match="not JSON data"):
            handle.approve(edit={"a": float("nan"), "b": 1})
        with pytest.raises(UsageError, match="not JSON data"):
            await decide(store, "r", edit={"a": float("inf"), "b": 1})
        handle.approve()
        await handle.wait()
    assert [a.arguments for a in tools.executed] == [{"a": 1, "b": 2}]


class CountingStore(MemoryStore):
    """Counts readings of control heads and control-stream reads; can fail the readings."""

    def __init__(self):
        super().__init__()
        self.listings = 0
        self.control_reads = 0
        self.failing_heads = 0

    async def control_heads(self, run_ids):
        self.listings += 1
        if self.failing_heads:
            self.failing_heads -= 1
            raise StoreError("the store is unreachable (injected)")
        return await super().control_heads(run_ids)

    async def read_control(self, run_id, *, after=0):
        self.control_reads += 1
        return await super().read_control(run_id, after=after)


class StepCounter(trio.abc.Instrument):
    def __init__(self):
        self.count = 0
        self.by_task = collections.Counter()

    def before_task_step(self, task):
        self.count += 1
        self.by_task[task.name] += 1


async def test_many_parked_runs_share_one_listing_and_read_nothing_else(autojump_clock):
    store = CountingStore()
    async with trio.open_nursery() as nursery:
        parked = await _park_many(store, 50, nursery)
        handles = [parked[f"r{index}"] for index in range(50)]
        listings, reads = store.listings, store.control_reads
        steps = StepCounter()
        trio.lowlevel.add_instrument(steps)
        await trio.sleep(10)
        trio.lowlevel.remove_instrument(steps)
        # 10 s parked: about one listing per 0.5 s for all 50 runs, no control-log reads,
        # and the runs themselves sleep (50 runs polling every 0.5 s would be 1,000 steps).
        assert store.listings - listings <= 25
        assert store.control_reads == reads
        assert steps.count < 200, steps.by_task.most_common(10)
        await decide(store, handles[7].run_id)  # "another process" decides one of them
        with trio.fail_after(2):  # picked up within a few listing intervals
            await handles[7].wait()
        assert all(h.parked for i, h in enumerate(handles) if i != 7)
        for handle in handles:
            handle.cancel()


async def _park_many(store, count, nursery):
    handles = []

    async def one(index):
        agent, _ = make([call("add", a=index, b=1, call_id="c1"), say("ok")])
        async with open_run(
            agent,
            "x",
            store=store,
            run_id=f"r{index}",
            approval_policy=only_add,
            park_after_s=PARK_AFTER_S,
            control_poll_s=0.5,
        ) as handle:
            handles.append(handle)

    for index in range(count):
        nursery.start_soon(one, index)
    with trio.fail_after(3600):
        while len(handles) < count:  # noqa: ASYNC110 (the runs start in their own tasks)
            await trio.sleep(0.5)
        for handle in handles:
            assert await handle.wait_parked()
    return {h.run_id: h for h in handles}


async def test_parked_runs_go_on_being_woken_after_each_reader_leaves(autojump_clock):
    # The parked runs take turns reading the shared heads; deciding them one by one, the
    # first waiters (the readers) included, still wakes every later one.
    store = CountingStore()
    async with trio.open_nursery() as nursery:
        handles = await _park_many(store, 5, nursery)
        for run_id in sorted(handles):
            await decide(store, run_id)
            with trio.fail_after(5):  # a few reading intervals
                await handles[run_id].wait()
            others = [h for r, h in handles.items() if r > run_id]
            assert all(h.parked for h in others)


def _reading_tasks() -> int:
    """Tasks reading control heads: the store's one shared reading."""

    def walk(task) -> int:
        own = "ControlIndex._poll" in task.name
        return own + sum(walk(child) for n in task.child_nurseries for child in n.child_tasks)

    return walk(trio.lowlevel.current_root_task())


async def test_parked_and_driven_runs_share_one_reading_task(autojump_clock):
    # One task reads the heads for the runs of a store, driven or parked. It goes on after
    # the driven run that hosted it ends, and wakes the parked run whose stream grew.
    store = CountingStore()
    ended = {}

    async def driven(run_id: str, sleep_s: float) -> None:
        agent, _ = make([call("sleep", s=sleep_s, call_id="c1"), say("done")])
        async with open_run(agent, "x", store=store, run_id=run_id) as handle:
            ended[run_id] = await handle.wait()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(driven, "d0", 2)  # hosts the reading first
        await trio.sleep(0.1)
        handles = await _park_many(store, 4, nursery)
        assert ended["d0"].stop_reason is StopReason.FINAL_ANSWER  # it ran 2 s, parking 5
        assert _reading_tasks() == 1
        nursery.start_soon(driven, "d1", 50)  # within the tool's default timeout
        await trio.sleep(1)
        assert _reading_tasks() == 1
        handles["r2"].cancel()  # a parked run leaves in process
        await trio.sleep(1)
        assert _reading_tasks() == 1
        listings = store.listings
        await decide(store, "r1")  # "another process" decides one of them
        with trio.fail_after(2):  # picked up within a few listing intervals
            await handles["r1"].wait()
        assert store.listings - listings <= 5
        assert handles["r0"].parked and handles["r3"].parked
        for handle in handles.values():
            handle.cancel()
        await trio.sleep(1)
        assert _reading_tasks() == 1  # "d1" still polls
        nursery.cancel_scope.cancel()
    assert _reading_tasks() == 0


async def test_a_failed_reading_of_the_heads_is_logged_and_made_again(autojump_clock, caplog):
    store = CountingStore()
    async with trio.open_nursery() as nursery:
        handles = await _park_many(store, 3, nursery)
        before = store.listings
        store.failing_heads = 4
        await decide(store, "r1")
        with trio.fail_after(30):  # four failed readings, then the one that sees the decision
            await handles["r1"].wait()
        assert store.listings - before >= 5
        failures = [r for r in caplog.records if "reading the control heads failed" in r.message]
        assert len(failures) == 4
        assert all(handles[r].parked for r in ("r0", "r2"))
        for handle in handles.values():
            handle.cancel()


@pytest.mark.parametrize(("by_handle", "by_store"), [(1, 1), (2, 1), (3, 3)])
async def test_decisions_in_one_turn_leave_someone_reading_for_the_other_parked_runs(
    by_handle, by_store
):
    """Parked runs share one reader of the control heads. When the reader and others leave in
    the same turn (approved through their handles), the reading is handed to a run that
    still waits, so a decision written from elsewhere reaches it at the next reading, not
    at its approval deadline (15 minutes on)."""
    for trial in range(10):  # which run is the reader, and who is woken first, varies
        clock = trio.testing.MockClock(autojump_threshold=0)
        stuck = await trio.to_thread.run_sync(
            functools.partial(trio.run, _parked_then_decided, by_handle, by_store, clock=clock)
        )
        assert stuck == [], f"trial {trial}: {stuck} waited past the next reading"


async def _parked_then_decided(by_handle: int, by_store: int) -> list[str]:
    store = MemoryStore()
    handles = {}
    ids = [f"a{i}" for i in range(by_handle)] + [f"c{i}" for i in range(by_store)]
    all_parked = trio.Event()

    async def one(run_id: str) -> None:
        agent, _ = make([call("add", a=1, b=2, call_id="c1"), say("3")])
        async with open_run(
            agent,
            "x",
            store=store,
            run_id=run_id,
            approval_policy=only_add,
            park_after_s=PARK_AFTER_S,
        ) as handle:
            handles[run_id] = handle
            assert await handle.wait_parked()
            if len(handles) == len(ids) and all(h.parked for h in handles.values()):
                all_parked.set()
            with trio.move_on_after(30):
                await handle.wait()
            if handle.result is None:
                handle.cancel("cleanup")

    async with trio.open_nursery() as nursery:
        for run_id in ids:
            nursery.start_soon(one, run_id)
        await all_parked.wait()
        for i in range(by_handle):
            handles[f"a{i}"].approve()  # all in this one turn
        await trio.sleep(1)
        for i in range(by_store):
            await decide(store, f"c{i}")  # from another process: through the control stream
        began = trio.current_time()
        for i in range(by_store):
            await handles[f"c{i}"].wait()
        late = trio.current_time() - began > 5  # the control poll is 0.5 s
    return [f"c{i}" for i in range(by_store) if late or handles[f"c{i}"].result is None]


@pytest.mark.parametrize("finish", ["approved elsewhere", "cancelled through the store"])
async def test_a_run_finished_elsewhere_while_parked_here_is_not_driven_again(
    finish, autojump_clock
):
    """Parked here with its lease released, the run is finished by another driver (or, with
    nobody driving it, by a cancel through the store). When its parking here ends (the
    deadline, or the cancel it reads), this process reports the stored result instead of
    driving the finished run again, which wrote a second run-finished record."""
    from treadle.testing.invariants import check_invariants

    store = MemoryStore()
    turns = [call("add", a=1, b=2, call_id="c1"), say("3")]
    agent, tools = make(turns, limits=Limits(approval_timeout_s=60))
    async with opened(agent, store) as here:
        await parked(here)
        if finish == "approved elsewhere":
            other_agent, other_tools = make(turns, limits=Limits(approval_timeout_s=60))
            async with open_run(
                other_agent, store=store, run_id="r", approval_policy=only_add, park_after_s=None
            ) as there:
                await there.wait_state(RunState.AWAITING_APPROVAL)
                there.approve()
                assert (await there.wait()).stop_reason is StopReason.FINAL_ANSWER
            assert len(other_tools.executed) == 1
        else:
            await request_cancel(store, "r", reason="stop")
        with trio.fail_after(600):
            result = await here.wait()
    log = await store.read_log("r")
    assert check_invariants(log) == []
    assert [type(r).__name__ for r in log.records].count("RunFinished") == 1
    assert result.state is log.finished.state
    assert tools.executed == []


async def test_cancelling_a_parked_run_never_reports_it_running_again(autojump_clock):
    agent, tools = make([call("add", a=1, b=2, call_id="c1"), say("3")])
    async with opened(agent, MemoryStore()) as handle:
        await parked(handle)
        handle.cancel("stop")
        assert handle.state is RunState.CANCELLING
        # Driven again to write the cancel: cancelling throughout, never running.
        with trio.fail_after(60):
            reached = await handle.wait_state(RunState.RUNNING, RunState.CANCELLED)
        assert reached is RunState.CANCELLED
        assert (await handle.wait()).stop_reason is StopReason.CANCELLED
    assert tools.executed == []


async def test_a_block_failing_as_the_run_parks_still_releases_the_lease(autojump_clock):
    # The run lets its lease go as it parks; the caller's block fails at that moment and
    # cancels the release halfway. The lease is released on the way out all the same, so
    # the run can be driven again at once, not only once the lease has expired.
    agent, tools = make([call("add", a=1, b=2, call_id="c1"), say("3")])
    store = MemoryStore()
    with pytest.raises(KeyError):
        async with opened(agent, store) as handle:
            assert await handle.wait_parked()
            raise KeyError("the caller's block fails")
    lease = await store.read_lease("r")
    assert lease is not None
    assert lease.owner == ""
    with trio.fail_after(1):  # long before the lease's TTL
        async with opened(agent, store) as handle:
            await handle.wait_state(RunState.AWAITING_APPROVAL)
            handle.approve("c1")
            result = await handle.wait()
    assert result.stop_reason is StopReason.FINAL_ANSWER
    assert [a.arguments for a in tools.executed] == [{"a": 1, "b": 2}]


async def test_a_parked_run_finished_as_cancelled_by_another_process_reports_its_result(
    autojump_clock,
):
    # `treadle cancel` finishes a parked run itself: it takes the free lease, writes the
    # cancel, and lets go. The parked run, woken by the cancel in its control stream, found
    # the lease held and its handle raised RunLeased instead of reporting the cancelled run.
    from treadle.supervisors import finish_cancelled

    agent, tools = make([call("add", a=1, b=2, call_id="c1"), say("3")])
    store = MemoryStore()
    async with opened(agent, store, control_poll_s=0.5) as handle:
        await parked(handle)
        await store.acquire_lease("r", owner="the cli", ttl_s=600)  # it holds the lease
        await request_cancel(store, "r", reason="enough", canceller="treadle cancel")
        await trio.sleep(1.5)  # the parked run is woken and finds the lease held
        finished = await finish_cancelled(store, "r", owner="the cli")
        result = await handle.wait()
    assert finished.state is RunState.CANCELLED
    assert result.state is RunState.CANCELLED and result == finished
    assert tools.executed == []


class _LogsKept(MemoryStore):
    """A memory store that keeps a weak reference to every log it hands out."""

    def __init__(self) -> None:
        super().__init__()
        self.handed_out: list[weakref.ref[RunLog]] = []

    async def read_log(self, run_id: str) -> RunLog:
        log = await super().read_log(run_id)
        self.handed_out.append(weakref.ref(log))
        return log


@pytest.mark.parametrize("entry", ["open_run", "run"])
async def test_a_parked_run_keeps_no_log_in_memory(autojump_clock, entry):
    # The frame of the drive lasts as long as the run: it held the log it read first, the
    # whole of a long run's records, for as long as the run stayed parked.
    from treadle.supervisors import run

    agent, tools = make([call("add", a=1, b=2, call_id="c1"), say("3")])
    store = _LogsKept()
    results = []
    async with trio.open_nursery() as nursery:
        if entry == "open_run":

            async def driven() -> None:
                async with opened(agent, store) as handle:
                    results.append(await handle.wait())

        else:

            async def driven() -> None:
                results.append(await run(agent, "x", store=store, run_id="r", **PARKING))

        nursery.start_soon(driven)
        await trio.sleep(PARK_AFTER_S + 10)  # parked: waiting past park_after_s
        gc.collect()
        assert store.handed_out, "the run read no log"
        kept = [ref for ref in store.handed_out if ref() is not None]
        assert kept == [], f"{len(kept)} of {len(store.handed_out)} logs still in memory"
        await decide(store, "r", call_id="c1")
    assert results[0].stop_reason is StopReason.FINAL_ANSWER
    assert [a.arguments for a in tools.executed] == [{"a": 1, "b": 2}]


async def test_the_block_of_open_run_is_entered_once(autojump_clock):
    agent, _ = make([say("done")])
    block = opened(agent, MemoryStore())
    async with block as handle:
        await handle.wait()
    with pytest.raises(UsageError, match="can be entered only once"):
        async with block:
            pass
