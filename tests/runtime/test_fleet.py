"""The fleet: a worker claims queued, orphaned and decided parked runs and drives them.

Every test runs on trio's virtual clock; the store's lease and queue clock and the records'
timestamps follow it (``1e9 + trio time``), so leases, backoffs and approval deadlines
expire in virtual time.
"""

from __future__ import annotations

import datetime as dt
import functools
import itertools
import math
from pathlib import Path

import attrs
import pytest
import trio
import trio.testing

import treadle
from treadle._cli_fleet import stopped_line
from treadle._exceptions import UsageError
from treadle.agent import Agent
from treadle.approvals import decide, request_cancel
from treadle.parsers import NativeToolCallParser
from treadle.stores.jsonl import open_jsonl_store
from treadle.stores.memory import MemoryStore
from treadle.stores.sqlite import open_sqlite_store
from treadle.supervisors import open_fleet, wait_result
from treadle.testing import InterceptingStore, SimulatedCrash
from treadle.testing.invariants import check_invariants
from treadle.testing.scripted import ScriptedModel, call, say
from treadle.tools import Toolbox, ToolContext
from treadle.types import (
    ActionResult,
    ActionStatus,
    ApprovalDecided,
    Limits,
    Liveness,
    Message,
    RunState,
    StopReason,
)

EPOCH = 1e9
_TRIO_CLOCK: list[trio.testing.MockClock] = []


@pytest.fixture(autouse=True)
def _virtual_time(request):
    """The test's virtual clock, for `store_now` (the PostgreSQL tests run in real time)."""
    if "autojump_clock" in request.fixturenames:
        _TRIO_CLOCK[:] = [request.getfixturevalue("autojump_clock")]
    else:  # never an earlier test's clock: `store_now` fails at once without one
        _TRIO_CLOCK.clear()


def store_now() -> float:
    """The store's clock on trio's virtual time (callable from worker threads too)."""
    return EPOCH + _TRIO_CLOCK[0].current_time()


@attrs.define(eq=False)
class VirtualClock:
    """Record timestamps on the store's clock (approval deadlines are compared with it)."""

    def now_iso(self) -> str:
        return dt.datetime.fromtimestamp(store_now(), dt.UTC).isoformat()


@attrs.define(eq=False)
class World:
    """The effects of every tool call of every run, and how many run at once."""

    running: int = 0
    peak: int = 0
    started: list[str] = attrs.Factory(list)
    effects: list[str] = attrs.Factory(list)

    def agent(self, turns, *, version: str | None = "v1", limits: Limits | None = None) -> Agent:
        world = self

        @treadle.tool(timeout_s=600)
        async def work(seconds: float, ctx: ToolContext) -> str:
            """Work for a while."""
            world.started.append(ctx.intent_id)
            world.running += 1
            world.peak = max(world.peak, world.running)
            try:
                await trio.sleep(seconds)
            finally:
                world.running -= 1
            world.effects.append(ctx.intent_id)
            return "worked"

        @treadle.tool(requires_approval=True)
        async def wire(amount: int, ctx: ToolContext) -> str:
            """Send money."""
            world.effects.append(ctx.intent_id)
            return f"sent {amount}"

        return Agent(
            model=ScriptedModel(turns=turns),
            executor=Toolbox([work, wire]),
            parser=NativeToolCallParser(),
            version=version,
            limits=limits or Limits(tool_timeout_s=600),
        )


ONE_STEP = [call("work", seconds=10, call_id="w1"), say("done")]
TWO_STEPS = [
    call("work", seconds=10, call_id="w1"),
    call("work", seconds=10, call_id="w2"),
    say("done"),
]
WIRE = [call("wire", amount=5, call_id="p1"), say("paid")]


def fleet(store, agents, **kwargs):
    kwargs.setdefault("claim_poll_s", 1.0)
    kwargs.setdefault("lease_ttl_s", 3.0)
    kwargs.setdefault("backoff_s", 0.0)
    return open_fleet(store, agents, clock=VirtualClock(), **kwargs)


def new_store() -> MemoryStore:
    return MemoryStore(clock=store_now)


async def until(predicate, *, step_s: float = 0.5, limit_s: float = 600) -> None:
    with trio.fail_after(limit_s):
        while not await predicate():  # noqa: ASYNC110 (polling the store)
            await trio.sleep(step_s)


def liveness_is(store, run_id, *wanted):
    async def check():
        summary = await store.read_summary(run_id)
        return summary is not None and summary.liveness in wanted

    return check


def slot_freed(worker):
    async def check():
        await trio.lowlevel.checkpoint()
        return worker.statistics().running == 0

    return check


# --------------------------------------------------------------------------- submit and result


async def test_a_submitted_run_is_claimed_driven_and_its_result_waited_for(autojump_clock):
    world, store = World(), new_store()
    async with fleet(store, {"calc": lambda: world.agent(ONE_STEP)}) as worker:
        run_id = await worker.submit("calc", "work please")
        assert run_id.startswith("run-")
        with trio.fail_after(60):
            result = await worker.result(run_id)
        stats = worker.statistics()
    assert result.run_id == run_id
    assert result.state is RunState.SUCCEEDED and result.final_answer == "done"
    assert world.effects == [f"{run_id}/s1/a1"]
    assert (stats.claimed, stats.finished, stats.takeovers, stats.left) == (1, 1, 0, 0)
    summary = await store.read_summary(run_id)
    assert summary.liveness is Liveness.FINISHED
    assert (summary.agent, summary.agent_version, summary.claims) == ("calc", "v1", 1)
    assert summary.lease.owner == ""
    log = await store.read_log(run_id)
    assert log.started.input == (Message(role="user", content="work please"),)
    assert check_invariants(log) == []
    # wait_result from anywhere returns the same result.
    assert await wait_result(store, run_id) == result


async def test_submitting_a_run_again_is_idempotent(autojump_clock):
    world, store = World(), new_store()
    async with fleet(store, {"calc": lambda: world.agent(ONE_STEP)}) as worker:
        first = await worker.submit("calc", "work", run_id="job-1")
        again = await worker.submit("calc", "work", run_id="job-1")
        assert first == again == "job-1"
        with pytest.raises(UsageError, match="job-1"):
            await worker.submit("calc", "other work", run_id="job-1")
        with pytest.raises(UsageError, match="job-1"):
            await worker.submit("other-agent", "work", run_id="job-1")
        with trio.fail_after(60):
            await worker.result("job-1")
        # Once finished, the same submission still answers with the same run.
        assert await worker.submit("calc", "work", run_id="job-1") == "job-1"
        await trio.sleep(5)
        stats = worker.statistics()
    assert world.effects == ["job-1/s1/a1"]
    assert stats.claimed == 1
    assert await store.list_runs() == ("job-1",)


async def test_submitting_a_run_id_again_says_whether_its_agent_or_its_input_differs(
    fleet_store,
):
    """The same input under another agent was refused as "with another input"."""
    hello = (Message(role="user", content="hello"),)
    await fleet_store.submit("dup", agent="pay", input=hello)
    with pytest.raises(UsageError) as other_agent:
        await fleet_store.submit("dup", agent="approve", input=hello)
    assert str(other_agent.value) == (
        "run 'dup' was already submitted for agent 'pay', not 'approve'; a run id names one run"
    )
    with pytest.raises(UsageError) as other_input:
        await fleet_store.submit("dup", agent="pay", input=(Message(role="user", content="x"),))
    assert "for agent 'pay' with another input" in str(other_input.value)


async def test_a_run_started_without_the_queue_cannot_be_submitted(autojump_clock):
    world, store = World(), new_store()
    await treadle.run(world.agent(ONE_STEP), "work", store=store, run_id="direct")
    async with fleet(store, {"calc": lambda: world.agent(ONE_STEP)}) as worker:
        with pytest.raises(UsageError, match="direct"):
            await worker.submit("calc", "work", run_id="direct")


async def test_submit_refuses_an_invalid_run_id(autojump_clock):
    world, store = World(), new_store()
    async with fleet(store, {"calc": lambda: world.agent(ONE_STEP)}) as worker:
        with pytest.raises(treadle.InvalidRunId):
            await worker.submit("calc", "work", run_id="no spaces")
    assert await store.list_summaries() == ()


async def test_result_of_an_unknown_run_is_a_usage_error(autojump_clock):
    world, store = World(), new_store()
    async with fleet(store, {"calc": lambda: world.agent(ONE_STEP)}) as worker:
        with pytest.raises(UsageError, match="nope"):
            await worker.result("nope")


async def test_a_fleet_needs_a_store_with_a_queue_and_an_agent(tmp_path: Path, autojump_clock):
    world = World()
    _TRIO_CLOCK[0].autojump_threshold = 0.05  # no jump while a store thread works
    async with open_jsonl_store(tmp_path / "runs") as jsonl:
        with pytest.raises(UsageError, match="queue"):
            async with open_fleet(jsonl, {"calc": world.agent(ONE_STEP)}):
                pytest.fail("a fleet opened on a store without a queue")
    with pytest.raises(UsageError):
        async with open_fleet(new_store(), {}):
            pytest.fail("a fleet opened without agents")
    with pytest.raises(UsageError):
        async with open_fleet(new_store(), {"calc": world.agent(ONE_STEP)}, max_running=0):
            pytest.fail("a fleet opened without slots")


async def test_an_agent_factory_failing_when_the_worker_starts_gives_a_usage_error():
    # It escaped open_fleet as the factory's own exception: `treadle worker` printed a raw
    # traceback for a factory whose second call failed (its first is checked by the CLI).
    def broken() -> Agent:
        raise RuntimeError("no model key")

    with pytest.raises(UsageError, match="agent 'calc': its factory raised RuntimeError") as got:
        async with open_fleet(new_store(), {"calc": broken}):
            pytest.fail("a fleet opened with a factory that cannot make its agent")
    assert isinstance(got.value.__cause__, RuntimeError)
    with pytest.raises(UsageError, match="gave str, not an Agent"):
        async with open_fleet(new_store(), {"calc": lambda: "agent"}):
            pytest.fail("a fleet opened with a factory that makes no agent")


@pytest.mark.parametrize(
    ("setting", "value"),
    [
        ("backoff_s", math.nan),
        ("backoff_s", math.inf),
        ("backoff_s", -5.0),
        ("claim_poll_s", -1.0),
        ("claim_poll_s", math.nan),
        ("claim_poll_s", 0.0),
        ("control_poll_s", math.inf),
        ("park_after_s", -1.0),
        ("max_takeovers", 0),
    ],
)
async def test_a_fleet_refuses_a_setting_out_of_range_before_it_claims(
    setting, value, autojump_clock
):
    # Before, a NaN backoff was taken and every claim failed in the store, forever; a
    # negative claim poll failed the worker's claim loop after it had started.
    world, store = World(), new_store()
    await store.submit("job-1", agent="calc", input=(Message(role="user", content="work"),))
    with pytest.raises(UsageError, match=setting):
        async with fleet(store, {"calc": world.agent(ONE_STEP)}, **{setting: value}):
            pytest.fail("a fleet opened with a setting out of range")
    assert world.effects == []


# --------------------------------------------------------------------------- claiming


async def drive_six(store, world, submit_first: bool) -> tuple[list[str], list[int], object]:
    """Six one-step runs through a worker with two slots; ``running`` sampled meanwhile."""
    ids = [f"job-{n}" for n in range(6)]
    task = (Message(role="user", content="work"),)
    if submit_first:
        for run_id in ids:
            await store.submit(run_id, agent="calc", input=task)
    seen_running: list[int] = []
    async with fleet(store, {"calc": lambda: world.agent(ONE_STEP)}, max_running=2) as worker:
        if not submit_first:
            for run_id in ids:
                await worker.submit("calc", "work", run_id=run_id)
        with trio.fail_after(600):
            for run_id in ids:
                while (await store.read_summary(run_id)).liveness is not Liveness.FINISHED:
                    seen_running.append(worker.statistics().running)
                    await trio.sleep(0.5)
        stats = worker.statistics()
    return ids, seen_running, stats


async def test_max_running_bounds_concurrency(autojump_clock):
    world, store = World(), new_store()
    ids, seen_running, stats = await drive_six(store, world, submit_first=True)
    assert world.peak == 2
    assert max(seen_running) == 2
    assert sorted(world.effects) == sorted(f"{r}/s1/a1" for r in ids)
    assert stats.finished == 6 and stats.claimed == 6
    # Oldest first: the first two submitted ran first.
    assert set(world.started[:2]) == {"job-0/s1/a1", "job-1/s1/a1"}


async def test_max_running_holds_when_runs_are_submitted_while_the_worker_runs(autojump_clock):
    world, store = World(), new_store()
    ids, seen_running, _stats = await drive_six(store, world, submit_first=False)
    assert sorted(world.effects) == sorted(f"{r}/s1/a1" for r in ids)
    assert world.peak == 2
    assert max(seen_running) <= 2


async def test_a_worker_claims_only_runs_of_the_agents_it_serves(autojump_clock):
    world, store = World(), new_store()
    async with fleet(store, {"a": lambda: world.agent(ONE_STEP)}) as worker_a:
        await worker_a.submit("b", "for b", run_id="run-b")
        await worker_a.submit("a", "for a", run_id="run-a")
        with trio.fail_after(60):
            await worker_a.result("run-a")
        await trio.sleep(30)
        summary = await store.read_summary("run-b")
        assert summary.liveness is Liveness.QUEUED and summary.claims == 0
        assert worker_a.statistics().claimed == 1
    async with fleet(store, {"b": lambda: world.agent(ONE_STEP)}) as worker_b:
        with trio.fail_after(60):
            result = await worker_b.result("run-b")
    assert result.final_answer == "done"
    assert sorted(world.effects) == ["run-a/s1/a1", "run-b/s1/a1"]


async def test_runs_started_under_one_version_are_left_to_workers_serving_it(autojump_clock):
    world, store = World(), new_store()
    async with fleet(store, {"calc": lambda: world.agent(TWO_STEPS, version="v1")}) as v1:
        await v1.submit("calc", "work", run_id="r")
        await until(lambda: _started(world, "r/s1/a1"))
    # Drained after its first step: an unfinished run of v1, nobody driving it.
    summary = await store.read_summary("r")
    assert summary.agent_version == "v1" and summary.liveness is Liveness.ORPHANED
    async with fleet(store, {"calc": lambda: world.agent(TWO_STEPS, version="v2")}) as v2:
        # A queued run is anyone's: v2 may start a fresh one.
        await v2.submit("calc", "fresh", run_id="fresh")
        with trio.fail_after(60):
            await v2.result("fresh")
        await trio.sleep(30)
        assert (await store.read_summary("r")).liveness is Liveness.ORPHANED
        assert v2.statistics().claimed == 1
    assert (await store.read_summary("fresh")).agent_version == "v2"
    async with fleet(store, {"calc": lambda: world.agent(TWO_STEPS, version="v1")}) as again:
        with trio.fail_after(60):
            result = await again.result("r")
    assert result.stop_reason is StopReason.FINAL_ANSWER
    assert world.effects.count("r/s1/a1") == 1 and world.effects.count("r/s2/a1") == 1


def drifting(world: World, turns, *, version: str | None) -> object:
    """A factory whose definition changes on every call (a time in its system prompt)."""
    calls = itertools.count()

    def make() -> Agent:
        return attrs.evolve(world.agent(turns, version=version), system_prompt=f"{next(calls)}")

    return make


def refused_definition(run_id: str) -> pytest.RaisesGroup:
    """The worker's end on a definition its factory built for ``run_id``'s drive."""
    return pytest.RaisesGroup(
        pytest.RaisesExc(
            UsageError, match=rf"its factory built, for run '{run_id}', .* differs in system_prompt"
        ),
        flatten_subgroups=True,
        allow_unwrapped=True,
    )


@pytest.mark.parametrize("version", [None, "v1"])
async def test_a_worker_starts_no_run_with_a_definition_other_than_the_one_it_serves(
    version, autojump_clock
):
    # Before, the worker started the run with whatever its factory built on that call, under
    # a version it did not serve: once parked or orphaned, no worker claimed it ever again
    # (or, with one version named, its resumes failed until it was quarantined), silently.
    world, store = World(), new_store()
    await store.submit("r", agent="calc", input=(Message(role="user", content="work"),))
    with trio.fail_after(60), refused_definition("r"):
        async with fleet(store, {"calc": drifting(world, ONE_STEP, version=version)}):
            await trio.sleep_forever()
    summary = await store.read_summary("r")
    assert summary.liveness is Liveness.QUEUED and summary.takeovers == 0
    assert summary.quarantined is None and summary.lease.owner == ""
    assert (await store.read_log("r")).records == () and world.started == []
    async with fleet(store, {"calc": lambda: world.agent(ONE_STEP, version=None)}) as worker:
        with trio.fail_after(60):
            result = await worker.result("r")
        assert worker.statistics().takeovers == 0
    assert result.final_answer == "done" and world.effects == ["r/s1/a1"]


async def test_a_parked_run_is_left_parked_when_its_workers_factory_changed_definition(
    autojump_clock,
):
    # "Today is {date}" in a prompt, past midnight: the worker claimed the decided run it
    # had parked, resumed it with the new definition and failed it until it was quarantined.
    world, store = World(), new_store()
    prompt = ["before midnight"]

    def make() -> Agent:
        return attrs.evolve(world.agent(WIRE, version=None), system_prompt=prompt[0])

    with trio.fail_after(120), refused_definition("p"):
        async with fleet(store, {"pay": make}, park_after_s=5) as worker:
            await worker.submit("pay", "pay", run_id="p")
            await until(liveness_is(store, "p", Liveness.PARKED))
            prompt[0] = "after midnight"
            await decide(store, "p", call_id="p1", clock=VirtualClock())
            await trio.sleep_forever()
    summary = await store.read_summary("p")
    assert summary.liveness is Liveness.PARKED and summary.state is RunState.AWAITING_APPROVAL
    assert summary.takeovers == 0 and summary.quarantined is None
    prompt[0] = "before midnight"  # a worker serving the run's definition finishes it
    async with fleet(store, {"pay": make}) as worker:
        with trio.fail_after(60):
            result = await worker.result("p")
        assert worker.statistics().takeovers == 0
    assert result.final_answer == "paid" and world.effects == ["p/s1/a1"]


async def _started(world: World, intent_id: str) -> bool:
    await trio.lowlevel.checkpoint()
    return intent_id in world.started


# --------------------------------------------------------------------------- drain


class _ReleaseStuck(MemoryStore):
    """Once ``stuck`` holds an event, the next lease release sets it and waits 30 s (as one
    under a row lock another transaction keeps)."""

    stuck: list[trio.Event] = []

    async def release_lease(self, lease, **more):  # type: ignore[no-untyped-def]
        if self.stuck:
            self.stuck.pop().set()
            await trio.sleep(30)  # the lock is let go after the drain's deadline
        return await super().release_lease(lease, **more)


async def test_a_run_finished_before_the_drain_cut_its_release_counts_as_finished(
    autojump_clock, monkeypatch
):
    """Its run-finished record was durable; the drain deadline cut its lease release: the
    worker said "1 drive ended with the run unfinished"."""
    world = World()
    store = _ReleaseStuck(clock=store_now)
    released = trio.Event()
    monkeypatch.setattr(_ReleaseStuck, "stuck", [released])
    with trio.fail_after(600):
        agents = {"calc": lambda: world.agent([say("done")])}
        async with fleet(store, agents, drain_s=1) as worker:
            await worker.submit("calc", "work", run_id="r")
            await released.wait()
    assert (await store.read_log("r")).finished is not None
    stats = worker.statistics()
    assert (stats.finished, stats.left) == (1, 0)
    assert stats.unreleased == 1  # its lease was never released: it expires
    assert "1 lease not released" in stopped_line(stats)


class _ReleaseRefused(MemoryStore):
    """Every lease release fails (another transaction keeps the row locked)."""

    async def release_lease(self, lease, **more):  # type: ignore[no-untyped-def]
        raise treadle.StoreError("the row stayed locked by another transaction")


async def test_the_worker_counts_the_leases_it_did_not_release(autojump_clock):
    """The worker's last line said "leases released" when a release had failed and the
    lease was left to expire (the run then waits a TTL, and its next claim is a takeover)."""
    world = World()
    store = _ReleaseRefused(clock=store_now)
    with trio.fail_after(600):
        agents = {"calc": lambda: world.agent([say("done")])}
        async with fleet(store, agents) as worker:
            await worker.submit("calc", "work", run_id="r")
            await worker.result("r")
            await until(lambda: _stats_drove(worker, 1))
    stats = worker.statistics()
    assert (stats.finished, stats.unreleased) == (1, 1)
    assert "1 lease not released (each expires" in stopped_line(stats)
    assert "leases released" not in stopped_line(stats)


def _failing_after(world: World, calls: int, *, then_works: bool) -> object:
    """An agent factory whose calls after the first ``calls`` raise (all of them, or only the
    next one when ``then_works``): each such drive fails, its lease left to expire."""
    made = [0]

    def factory() -> Agent:
        made[0] += 1
        if made[0] > calls and (not then_works or made[0] == calls + 1):
            raise RuntimeError("the agent cannot be built")
        return world.agent([say("done")])

    return factory


async def test_a_lease_this_worker_took_again_and_released_is_not_counted_unreleased(
    autojump_clock,
):
    """The run's first drive failed (its lease left to expire); the same worker claimed it
    again and finished it. Its last line still said "1 lease not released (each expires after
    its TTL, and the run is then taken over)" about that finished run."""
    world, store = World(), new_store()
    agents = {"calc": _failing_after(world, 1, then_works=True)}  # 1: open_fleet's look
    async with fleet(store, agents) as worker:
        await worker.submit("calc", "work", run_id="r")
        with trio.fail_after(600):
            result = await worker.result("r")
        await until(lambda: _stats_drove(worker, 1))
    assert result.stop_reason is StopReason.FINAL_ANSWER
    stats = worker.statistics()
    assert (stats.left, stats.takeovers, stats.unreleased) == (1, 1, 0)
    assert stopped_line(stats).endswith("leases released")


async def test_a_run_failed_until_quarantined_counts_one_lease_and_is_not_said_taken_over(
    autojump_clock,
):
    """Each failed drive of the same run counted a lease (3 for one run), and the line said
    each run would be taken over: a quarantined run is claimed by nobody."""
    world, store = World(), new_store()
    agents = {"calc": _failing_after(world, 1, then_works=False)}
    async with fleet(store, agents, max_takeovers=3) as worker:
        await worker.submit("calc", "work", run_id="r")
        await until(liveness_is(store, "r", Liveness.QUARANTINED))
        stats = worker.statistics()
    assert stats.left == stats.claimed == 3  # the first claim, then two takeovers
    assert stats.unreleased == 1
    line = stopped_line(stats)
    assert "1 lease not released (each expires after its TTL; an unfinished run" in line
    assert "unless it is quarantined" in line


async def _stats_drove(worker, count: int) -> bool:
    await trio.lowlevel.checkpoint()
    return worker.statistics().finished == count


@pytest.mark.parametrize("kind", ["memory", "sqlite"])
async def test_drain_at_the_end_of_the_block_leaves_runs_resumable(kind, tmp_path, autojump_clock):
    world = World()
    async with opened_store(kind, tmp_path) as store:
        ids = [f"job-{n}" for n in range(3)]
        # A long lease: with the SQLite store, the virtual clock jumps while a commit thread
        # works on a loaded machine, and a 3 s lease could expire between two renewals and
        # make a resume look like a takeover.
        agents = {"calc": lambda: world.agent(TWO_STEPS)}
        async with fleet(store, agents, lease_ttl_s=60.0) as first:
            for run_id in ids:
                await first.submit("calc", "work", run_id=run_id)
            await until(lambda: _all_started(world, [f"{r}/s1/a1" for r in ids]))
            leaving = trio.current_time()
        # The drain waited for each run's first step to end, and started no second one. The
        # memory store's virtual time is exact; with SQLite the clock jumps to the next timer
        # whenever every task waits on the commit thread, so only the counts below bound it.
        if kind == "memory":
            assert trio.current_time() - leaving < 15
        stats = first.statistics()
        assert stats.running == 0 and stats.left == 3 and stats.finished == 0
        assert stats.unreleased == 0 and stopped_line(stats).endswith("leases released")
        assert sorted(world.effects) == sorted(f"{r}/s1/a1" for r in ids)
        assert all(not i.endswith("/s2/a1") for i in world.started)
        for run_id in ids:
            summary = await store.read_summary(run_id)
            assert summary.liveness is Liveness.ORPHANED, summary
            assert summary.lease.owner == ""
            assert (await store.read_log(run_id)).finished is None
        async with fleet(store, agents, lease_ttl_s=60.0) as second:
            with trio.fail_after(120):
                results = [await second.result(run_id) for run_id in ids]
            takeovers = second.statistics().takeovers
        logs = [await store.read_log(run_id) for run_id in ids]
    assert all(r.stop_reason is StopReason.FINAL_ANSWER for r in results)
    assert takeovers == 0  # released leases: resumed, not taken over
    # No finished tool call ran twice.
    assert sorted(world.effects) == sorted(f"{r}/s{s}/a1" for r in ids for s in (1, 2))
    assert all(check_invariants(log) == [] for log in logs)


async def _all_started(world: World, intent_ids: list[str]) -> bool:
    await trio.lowlevel.checkpoint()
    return all(i in world.started for i in intent_ids)


class _memory:
    async def __aenter__(self):
        return new_store()

    async def __aexit__(self, *exc):
        return None


def opened_store(kind: str, tmp_path: Path):
    """A fresh memory or SQLite store on the virtual clock."""
    if kind == "memory":
        return _memory()
    _TRIO_CLOCK[0].autojump_threshold = 0.05  # no jump while a store thread works
    return open_sqlite_store(tmp_path / "runs.db", clock=store_now)


async def test_drain_cuts_runs_that_reach_no_safe_point_in_time_and_releases_them(autojump_clock):
    world, store = World(), new_store()
    turns = [call("work", seconds=100, call_id="w1"), say("done")]
    async with fleet(store, {"calc": lambda: world.agent(turns)}, drain_s=2) as worker:
        await worker.submit("calc", "work", run_id="r")
        await until(lambda: _started(world, "r/s1/a1"))
        leaving = trio.current_time()
    assert trio.current_time() - leaving <= 3
    assert world.effects == []  # cut in the middle of its tool call
    summary = await store.read_summary("r")
    assert summary.liveness is Liveness.ORPHANED and summary.lease.owner == ""
    async with fleet(store, {"calc": lambda: world.agent(turns)}) as again:
        with trio.fail_after(60):
            result = await again.result("r")
    assert result.stop_reason is StopReason.FINAL_ANSWER
    log = await store.read_log("r")
    (outcome,) = [r.outcome for r in log.records if isinstance(r, ActionResult)]
    assert outcome.status is ActionStatus.UNKNOWN  # never-policy: not run again
    assert world.started == ["r/s1/a1"]


# --------------------------------------------------------------------------- takeover


async def test_a_queued_run_whose_claimer_died_is_taken_over(autojump_clock):
    world, store = World(), new_store()
    await store.submit("r", agent="calc", input=(Message(role="user", content="work"),))
    (dead,) = await store.claim(
        owner="dead", agents={"calc": ("v1",)}, limit=1, ttl_s=3, max_takeovers=5, backoff_s=0
    )
    assert dead.lease.generation == 1 and dead.submission is not None
    async with fleet(store, {"calc": lambda: world.agent(ONE_STEP)}) as worker:
        await trio.sleep(2)
        assert worker.statistics().claimed == 0  # its lease is still live
        with trio.fail_after(60):
            result = await worker.result("r")
        stats = worker.statistics()
    assert result.stop_reason is StopReason.FINAL_ANSWER
    lease = await store.read_lease("r")
    assert lease.generation == 2 and lease.owner == ""
    assert stats.claimed == 1
    assert world.effects == ["r/s1/a1"]


async def test_the_death_of_a_queued_runs_claimer_counts_as_a_takeover(autojump_clock):
    world, store = World(), new_store()
    await store.submit("r", agent="calc", input=(Message(role="user", content="work"),))
    await store.claim(
        owner="dead", agents={"calc": ("v1",)}, limit=1, ttl_s=3, max_takeovers=5, backoff_s=0
    )
    async with fleet(store, {"calc": lambda: world.agent(ONE_STEP)}) as worker:
        with trio.fail_after(60):
            await worker.result("r")
        stats = worker.statistics()
    assert stats.takeovers == 1
    assert (await store.read_summary("r")).takeovers == 1


async def test_a_started_run_whose_driver_died_is_taken_over_with_a_new_generation(autojump_clock):
    world, store = World(), new_store()
    async with fleet(store, {"calc": lambda: world.agent(TWO_STEPS)}) as first:
        await first.submit("calc", "work", run_id="r")
        await until(lambda: _started(world, "r/s1/a1"))
    # Drained after step 1. A driver claims it and dies at once (its lease is never renewed).
    (dead,) = await store.claim(
        owner="dead", agents={"calc": ("v1",)}, limit=1, ttl_s=3, max_takeovers=5, backoff_s=0
    )
    assert dead.lease.generation == 2 and not dead.takeover
    async with fleet(store, {"calc": lambda: world.agent(TWO_STEPS)}) as second:
        with trio.fail_after(60):
            result = await second.result("r")
        stats = second.statistics()
    assert result.stop_reason is StopReason.FINAL_ANSWER
    assert stats.takeovers == 1 and stats.claimed == 1
    summary = await store.read_summary("r")
    assert summary.takeovers == 1 and summary.claims == 3
    assert summary.lease.generation == 3
    assert sorted(world.effects) == ["r/s1/a1", "r/s2/a1"]


class Dying(InterceptingStore):
    """A worker process's view of the store: once ``dead``, nothing reaches the store."""

    def __init__(self, inner) -> None:
        super().__init__(inner)
        self.dead = False

    async def before_write(self, op, records, seq):
        if self.dead:
            raise SimulatedCrash("the worker died")
        return False

    def check_other(self) -> None:
        if self.dead:
            raise SimulatedCrash("the worker died")


async def test_a_run_of_a_worker_that_died_is_taken_over_by_another(autojump_clock):
    world, store = World(), new_store()
    dying = Dying(store)
    agents = {"calc": lambda: world.agent(TWO_STEPS)}
    with trio.fail_after(600):
        async with fleet(dying, agents, owner="w1") as w1:
            await w1.submit("calc", "work", run_id="r")
            await until(lambda: _started(world, "r/s1/a1"))
            assert (await store.read_lease("r")).owner == "w1"
            async with fleet(store, agents, owner="w2") as w2:
                dying.dead = True  # w1 can reach the store no more; its lease lapses
                result = await w2.result("r")
                stats = w2.statistics()
    assert result.stop_reason is StopReason.FINAL_ANSWER
    assert stats.takeovers == 1 and stats.claimed == 1
    summary = await store.read_summary("r")
    assert summary.takeovers == 1 and summary.lease.generation == 2
    log = await store.read_log("r")
    # w1's first tool call was under way when it died: its outcome never reached the log,
    # and the call was not run again.
    statuses = [r.outcome.status for r in log.records if isinstance(r, ActionResult)]
    assert statuses[0] is ActionStatus.UNKNOWN
    assert world.started.count("r/s1/a1") == 1
    assert world.effects.count("r/s2/a1") == 1
    assert check_invariants(log) == []


class PausedClock:
    """The store's clock of a worker process paused (SIGSTOP) for ``paused_s`` seconds: the
    store's time ran on while the worker's trio time stood still."""

    def __init__(self) -> None:
        self.paused_s = 0.0

    def __call__(self) -> float:
        return store_now() + self.paused_s


class ForgetsDriving(InterceptingStore):
    """A queue that does not honour ``driving``: it hands a worker its own expired runs."""

    async def claim(self, *, driving=(), **kwargs):
        return await super().claim(**kwargs)


LONG_SECOND_STEP = [
    call("work", seconds=10, call_id="w1"),
    call("work", seconds=100, call_id="w2"),
    say("done"),
]


def claimed(worker, count):
    async def check():
        await trio.lowlevel.checkpoint()
        return worker.statistics().claimed >= count

    return check


async def test_a_worker_paused_past_its_ttl_goes_on_with_its_runs_without_taking_them_over(
    autojump_clock,
):
    """Woken, a lone worker's claim found its own runs' leases expired and took each over
    from itself (generation + 1, a takeover counted) while its old drives still ran: one
    pause cost two takeovers per run, and quarantined runs at ``max_takeovers=2``."""
    world, paused = World(), PausedClock()
    store = MemoryStore(clock=paused)
    agents = {"calc": lambda: world.agent(TWO_STEPS), "quick": lambda: world.agent([say("hi")])}
    async with fleet(store, agents, lease_ttl_s=3.0, max_takeovers=2) as worker:
        await worker.submit("calc", "work", run_id="r")
        await until(lambda: _started(world, "r/s1/a1"))
        paused.paused_s = 10.0  # its lease expired while it was paused; nobody took it over
        await worker.submit("quick", "hello", run_id="other")  # claims at once on waking
        await until(claimed(worker, 2))
        with trio.fail_after(120):
            result = await worker.result("r")
        stats = worker.statistics()
    assert result.stop_reason is StopReason.FINAL_ANSWER
    assert (stats.claimed, stats.takeovers, stats.left) == (2, 0, 0)
    summary = await store.read_summary("r")
    assert (summary.claims, summary.takeovers, summary.lease.generation) == (1, 0, 1)
    assert world.started.count("r/s1/a1") == 1 and sorted(world.effects) == ["r/s1/a1", "r/s2/a1"]


async def test_a_run_claimed_again_while_its_old_drive_ends_keeps_its_slot(autojump_clock):
    """The old drive's end removed the new drive's handle and slot (by run id): the worker
    counted one run fewer than it drove (past ``max_running``), and a drain missed it."""
    world, paused = World(), PausedClock()
    inner = MemoryStore(clock=paused)
    store = ForgetsDriving(inner)
    agents = {
        "calc": lambda: world.agent(LONG_SECOND_STEP),
        "quick": lambda: world.agent([say("hi")]),
    }
    async with fleet(store, agents, lease_ttl_s=3.0, drain_s=5) as worker:
        await worker.submit("calc", "work", run_id="r")
        await until(lambda: _started(world, "r/s1/a1"))
        paused.paused_s = 10.0
        await worker.submit("quick", "hello", run_id="other")
        await until(claimed(worker, 3))  # "r" a second time (the queue forgot), and "other"
        await worker.result("other")
        await until(lambda: _started(world, "r/s2/a1"))  # the new drive goes on
        await until(lambda: _left(worker, 1))  # the old drive stopped: its lease was lost
        assert worker.statistics().running == 1  # the new drive of "r" keeps its slot
        assert "r" in worker._handles  # and its handle: the drain below reaches it
    assert (await inner.read_summary("r")).lease.generation == 2
    assert "r/s2/a1" not in world.effects  # the new drive was drained (cut) mid-step


class RenewalsFail(InterceptingStore):
    """While ``failing``, the worker's lease renewals fail (the store is out of its reach)."""

    def __init__(self, inner) -> None:
        super().__init__(inner)
        self.failing = False

    async def renew_leases(self, leases, *, ttl_s):
        if self.failing:
            raise treadle.StoreError("the store is out of reach")
        return await super().renew_leases(leases, ttl_s=ttl_s)


async def test_a_run_cancelled_elsewhere_while_its_worker_was_paused_is_no_unreleased_lease(
    autojump_clock, caplog
):
    """The worker's write found the run finished by `treadle cancel` (its lease taken, then
    released): the worker counted "1 lease not released (each expires after its TTL ...)"
    for a lease that was no longer its own, and logged "run 'r': run 'r': ..."."""
    from treadle.supervisors._finishing import finish_cancelled

    world, paused = World(), PausedClock()
    inner = MemoryStore(clock=paused)
    store = RenewalsFail(inner)
    async with fleet(store, {"calc": lambda: world.agent(TWO_STEPS)}) as worker:
        await worker.submit("calc", "work", run_id="r")
        await until(lambda: _started(world, "r/s1/a1"))
        store.failing, paused.paused_s = True, 10.0  # paused past its TTL, out of reach
        cancelled = await finish_cancelled(inner, "r", owner="canceller", reason="stop")
        assert cancelled.state is RunState.CANCELLED
        await until(lambda: _left(worker, 1))  # its next write: LeaseLost
        stats = worker.statistics()
    assert (stats.left, stats.unreleased) == (1, 0)
    assert "leases released" in stopped_line(stats)
    said = [r.getMessage() for r in caplog.records if "was lost" in r.getMessage()]
    assert said and all(text.count("run 'r'") == 1 for text in said), said


async def _left(worker, count: int) -> bool:
    await trio.lowlevel.checkpoint()
    return worker.statistics().left >= count


async def drivers_die(store, *, max_takeovers: int) -> int:
    """Claim the run again and again, each claimer dying at once; the deaths until none can."""
    deaths = 0
    for n in range(10):
        claims = await store.claim(
            owner=f"dead-{n}",
            agents={"calc": ("v1",)},
            limit=1,
            ttl_s=3,
            max_takeovers=max_takeovers,
            backoff_s=0,
        )
        if not claims:
            return deaths
        deaths += 1
        await trio.sleep(4)  # the driver dies: its lease lapses unrenewed
    return deaths


async def test_a_run_that_keeps_killing_its_drivers_is_quarantined_until_released(autojump_clock):
    world, store = World(), new_store()
    await store.submit("r", agent="calc", input=(Message(role="user", content="work"),))
    async with fleet(store, {"calc": lambda: world.agent(TWO_STEPS)}) as first:
        await until(lambda: _started(world, "r/s1/a1"))
    deaths = await drivers_die(store, max_takeovers=3)
    summary = await store.read_summary("r")
    assert summary.liveness is Liveness.QUARANTINED, summary
    assert summary.quarantined and "unquarantine" in summary.quarantined
    # a drive that failed counts too (decision 0015): the reason said only "drivers died"
    assert "its drives ended unfinished 3 times" in summary.quarantined
    assert "a driver died, or its drive failed" in summary.quarantined
    assert deaths == 3  # the first claim, then two takeovers; the third death quarantines
    async with fleet(store, {"calc": lambda: world.agent(TWO_STEPS)}, max_takeovers=3) as worker:
        await trio.sleep(30)
        assert worker.statistics().claimed == 0
        assert (await store.read_summary("r")).liveness is Liveness.QUARANTINED
        assert await store.release_quarantine("r") is True
        with trio.fail_after(60):
            result = await worker.result("r")
    assert result.stop_reason is StopReason.FINAL_ANSWER
    assert await store.release_quarantine("r") is False
    assert first.statistics().left == 1


async def test_a_quarantined_run_cancelled_no_longer_says_it_can_be_released(autojump_clock):
    # Finished as cancelled, its summary still said "`treadle unquarantine RUN_ID` makes it
    # claimable again": a finished run has nothing to claim.
    from treadle.supervisors._finishing import finish_cancelled

    world, store = World(), new_store()
    await store.submit("r", agent="calc", input=(Message(role="user", content="work"),))
    async with fleet(store, {"calc": lambda: world.agent(TWO_STEPS)}):
        await until(lambda: _started(world, "r/s1/a1"))
    assert await drivers_die(store, max_takeovers=2) == 2
    assert (await store.read_summary("r")).liveness is Liveness.QUARANTINED
    result = await finish_cancelled(store, "r", owner="canceller", reason="poison")
    assert result.state is RunState.CANCELLED
    summary = await store.read_summary("r")
    assert summary.liveness is Liveness.FINISHED and summary.quarantined is None


class CountingClaims(InterceptingStore):
    """Counts the runs claimed; sets ``too_many`` past ``limit`` claims."""

    def __init__(self, inner, limit: int) -> None:
        super().__init__(inner)
        self.claimed = 0
        self.limit = limit
        self.too_many = trio.Event()

    async def claim(self, **kwargs):
        claims = await super().claim(**kwargs)
        self.claimed += len(claims)
        if self.claimed > self.limit:
            self.too_many.set()
        return claims


async def test_a_run_that_fails_to_start_is_not_claimed_again_in_a_hot_loop(autojump_clock):
    world, store = World(), new_store()
    async with fleet(store, {"calc": lambda: world.agent(TWO_STEPS)}) as first:
        await first.submit("calc", "work", run_id="r")
        await until(lambda: _started(world, "r/s1/a1"))

    def changed() -> Agent:  # same version label, another system prompt: it cannot resume r
        return attrs.evolve(world.agent(TWO_STEPS), system_prompt="changed")

    counting = CountingClaims(store, limit=40)
    async with fleet(counting, {"calc": changed}, claim_poll_s=1.0) as worker:
        with trio.move_on_after(30):
            await counting.too_many.wait()
        stats = worker.statistics()
    # At most one claim per poll interval (30 in 30 s), let alone a backoff.
    assert counting.claimed <= 40, stats


async def test_cancelling_a_fleet_block_releases_the_leases_of_its_runs(autojump_clock):
    world, store = World(), new_store()
    with trio.move_on_after(5):
        async with fleet(store, {"calc": lambda: world.agent(TWO_STEPS)}) as worker:
            await worker.submit("calc", "work", run_id="r")
            await trio.sleep_forever()
    assert world.started == ["r/s1/a1"] and world.effects == []
    lease = await store.read_lease("r")
    assert lease.owner == ""
    summary = await store.read_summary("r")
    assert summary.liveness is Liveness.ORPHANED
    async with fleet(store, {"calc": lambda: world.agent(TWO_STEPS)}) as again:
        with trio.fail_after(60):
            result = await again.result("r")
        assert again.statistics().takeovers == 0
    assert result.stop_reason is StopReason.FINAL_ANSWER


class LostThenBlip(InterceptingStore):
    """While ``flaky``: renewals report every lease lost, and reading a lease fails."""

    def __init__(self, inner) -> None:
        super().__init__(inner)
        self.flaky = False

    async def renew_leases(self, leases, *, ttl_s):
        if self.flaky:
            await trio.lowlevel.checkpoint()
            return ()
        return await super().renew_leases(leases, ttl_s=ttl_s)

    async def read_lease(self, run_id):
        if self.flaky:
            await trio.lowlevel.checkpoint()
            raise treadle.StoreError("the connection dropped")
        return await super().read_lease(run_id)


async def test_a_store_error_after_a_lost_renewal_does_not_bring_the_worker_down(
    autojump_clock, caplog
):
    world, inner = World(), new_store()
    store = LostThenBlip(inner)
    async with fleet(store, {"calc": lambda: world.agent(TWO_STEPS)}) as worker:
        await worker.submit("calc", "work", run_id="r")
        await until(lambda: _started(world, "r/s1/a1"))
        store.flaky = True
        await trio.sleep(3)
        store.flaky = False
        await worker.submit("calc", "work", run_id="later")
        with trio.fail_after(120):
            result = await worker.result("later")
    assert result.stop_reason is StopReason.FINAL_ANSWER
    # The lost lease is a warning, which `treadle worker` prints (an INFO line it does not).
    lost = [r for r in caplog.records if r.getMessage().startswith("run 'r': ")]
    assert lost and all(r.levelname == "WARNING" for r in lost)
    assert "lease" in lost[0].getMessage()


async def test_statistics_count_a_run_cut_at_the_drain_deadline_as_left(autojump_clock):
    world, store = World(), new_store()
    turns = [call("work", seconds=100, call_id="w1"), say("done")]
    async with fleet(store, {"calc": lambda: world.agent(turns)}, drain_s=2) as worker:
        await worker.submit("calc", "work", run_id="r")
        await until(lambda: _started(world, "r/s1/a1"))
    stats = worker.statistics()
    assert (stats.running, stats.finished, stats.left) == (0, 0, 1)


# --------------------------------------------------------------------------- approvals


@pytest.mark.parametrize("kind", ["memory", "sqlite"])
async def test_a_parked_run_frees_its_slot_and_a_decision_brings_it_back(
    kind, tmp_path, autojump_clock
):
    world = World()
    async with opened_store(kind, tmp_path) as store:
        await _park_decide_and_finish(store, world)


async def _park_decide_and_finish(store, world):
    agents = {"pay": lambda: world.agent(WIRE), "calc": lambda: world.agent(ONE_STEP)}
    async with fleet(store, agents, max_running=1, park_after_s=5) as worker:
        await worker.submit("pay", "pay", run_id="p")
        await until(liveness_is(store, "p", Liveness.PARKED))
        # The store shows the park as soon as the lease release is durable; the worker frees
        # the slot when its driving task resumes after that write (an event, not a time).
        await until(slot_freed(worker))
        assert worker.statistics().running == 0
        lease = await store.read_lease("p")
        assert lease.owner == "" and lease.generation == 1
        # Its slot serves another run meanwhile.
        await worker.submit("calc", "work", run_id="c")
        with trio.fail_after(60):
            await worker.result("c")
        await trio.sleep(30)
        assert (await store.read_summary("p")).liveness is Liveness.PARKED
        assert world.effects == ["c/s1/a1"]
        await decide(store, "p", call_id="p1", clock=VirtualClock())
        with trio.fail_after(30):
            result = await worker.result("p")
        stats = worker.statistics()
    assert result.final_answer == "paid"
    assert world.effects == ["c/s1/a1", "p/s1/a1"]
    assert stats.takeovers == 0
    assert (await store.read_lease("p")).generation == 2
    log = await store.read_log("p")
    (decided,) = [r for r in log.records if isinstance(r, ApprovalDecided)]
    assert decided.decision == "approve"
    assert check_invariants(log) == []


@pytest.mark.parametrize("kind", ["memory", "sqlite"])
async def test_a_parked_run_is_claimed_again_at_its_approval_deadline(
    kind, tmp_path, autojump_clock
):
    world = World()
    async with opened_store(kind, tmp_path) as store:
        # On SQLite the virtual clock jumps while a commit thread works, as far as the load on
        # the machine makes it: the deadline is checked there by the claims, not by the time.
        await _park_until_the_deadline(store, world, exact_clock=kind == "memory")


async def _park_until_the_deadline(store, world, *, exact_clock=True):
    limits = Limits(approval_timeout_s=40, tool_timeout_s=600)
    async with fleet(
        store, {"pay": lambda: world.agent(WIRE, limits=limits)}, park_after_s=5
    ) as worker:
        began = trio.current_time()
        await worker.submit("pay", "pay", run_id="p")
        await until(liveness_is(store, "p", Liveness.PARKED))
        # The store shows the park as soon as the lease release is durable; the worker frees
        # the slot when its driving task resumes after that write (an event, not a time).
        await until(slot_freed(worker))
        assert worker.statistics().running == 0
        with trio.fail_after(600):
            result = await worker.result("p")
        took = trio.current_time() - began
        claims = worker.statistics().claimed
    assert took >= 39
    if exact_clock:
        assert took < 50
    assert claims == 2  # submitted, then claimed again once at the deadline
    assert result.stop_reason is StopReason.FINAL_ANSWER
    assert world.effects == []  # the call expired unapproved
    log = await store.read_log("p")
    (decided,) = [r for r in log.records if isinstance(r, ApprovalDecided)]
    assert decided.decision == "expired"
    (outcome,) = [r.outcome for r in log.records if isinstance(r, ActionResult)]
    assert outcome.status is ActionStatus.NOT_EXECUTED
    assert check_invariants(log) == []


async def test_a_run_parks_again_at_its_next_approval_and_each_decision_brings_it_back(
    autojump_clock,
):
    world, store = World(), new_store()
    turns = [
        call("wire", amount=5, call_id="p1"),
        call("wire", amount=7, call_id="p2"),
        say("paid twice"),
    ]
    async with fleet(store, {"pay": lambda: world.agent(turns)}, park_after_s=5) as worker:
        await worker.submit("pay", "pay", run_id="p")
        for call_id in ("p1", "p2"):
            await until(liveness_is(store, "p", Liveness.PARKED))
            await trio.sleep(20)  # nobody claims a parked run without a decision
            assert (await store.read_summary("p")).liveness is Liveness.PARKED
            decided = await decide(store, "p", clock=VirtualClock())
            assert decided.call_id == call_id
            await until(functools.partial(_effect, world, f"p/s{call_id[1]}/a1"))
        with trio.fail_after(60):
            result = await worker.result("p")
        stats = worker.statistics()
    assert result.final_answer == "paid twice"
    assert world.effects == ["p/s1/a1", "p/s2/a1"]
    assert stats.claimed == 3 and stats.takeovers == 0
    log = await store.read_log("p")
    assert [r.call_id for r in log.records if isinstance(r, ApprovalDecided)] == ["p1", "p2"]
    assert check_invariants(log) == []


def only_work(tool: str, arguments) -> bool:
    """An approval policy: every call of ``work`` waits for a human."""
    return tool == "work"


async def test_a_served_agents_approval_policy_puts_its_calls_to_a_human_in_every_drive(
    autojump_clock,
):
    """The policy is part of the definition the worker serves (`Agent.approval_policy`):
    each call it selects waits for a decision, in the drive that claimed the run and in the
    one that claimed it again after its park. A fleet ran every drive with no policy."""
    world, store = World(), new_store()
    turns = [
        call("work", seconds=1, call_id="w1"),
        call("work", seconds=1, call_id="w2"),
        say("done"),
    ]

    def gated() -> Agent:
        return attrs.evolve(world.agent(turns), approval_policy=only_work)

    async with fleet(store, {"calc": gated}, park_after_s=5) as worker:
        await worker.submit("calc", "work", run_id="c")
        for step, call_id in enumerate(("w1", "w2"), start=1):
            await until(liveness_is(store, "c", Liveness.PARKED))
            assert world.started == [f"c/s{n}/a1" for n in range(1, step)]
            decided = await decide(store, "c", clock=VirtualClock())
            assert decided.call_id == call_id
            await until(functools.partial(_effect, world, f"c/s{step}/a1"))
        with trio.fail_after(60):
            result = await worker.result("c")
        claimed = worker.statistics().claimed
    assert result.final_answer == "done"
    assert world.effects == ["c/s1/a1", "c/s2/a1"]
    assert claimed == 3
    log = await store.read_log("c")
    assert [r.call_id for r in log.records if isinstance(r, ApprovalDecided)] == ["w1", "w2"]


async def _effect(world: World, intent_id: str) -> bool:
    await trio.lowlevel.checkpoint()
    return intent_id in world.effects


async def test_a_cancel_reaches_a_run_the_fleet_drives(autojump_clock):
    world, store = World(), new_store()
    turns = [call("work", seconds=100, call_id="w1"), say("done")]
    async with fleet(store, {"calc": lambda: world.agent(turns)}) as worker:
        await worker.submit("calc", "work", run_id="r")
        await until(lambda: _started(world, "r/s1/a1"))
        await request_cancel(store, "r", reason="stop", canceller="ops")
        with trio.fail_after(5):
            result = await worker.result("r")
    assert result.state is RunState.CANCELLED
    assert world.effects == []


async def test_a_cancel_reaches_a_parked_run_of_the_fleet(autojump_clock):
    world, store = World(), new_store()
    async with fleet(store, {"pay": lambda: world.agent(WIRE)}, park_after_s=5) as worker:
        await worker.submit("pay", "pay", run_id="p")
        await until(liveness_is(store, "p", Liveness.PARKED))
        await request_cancel(store, "p", reason="stop")
        with trio.fail_after(30):
            result = await worker.result("p")
    assert result.state is RunState.CANCELLED
    assert world.effects == []


async def test_a_queued_run_can_be_cancelled(autojump_clock):
    store = new_store()
    await store.submit("q", agent="nobody-serves-me", input=(Message(role="user", content="x"),))
    await request_cancel(store, "q", reason="not needed")
    entries = await store.read_control("q")
    assert len(entries) == 1


# --------------------------------------------------------------------------- PostgreSQL (real time)


async def test_postgres_a_fleet_drives_claims_parks_and_resumes(postgres_dsn, postgres_schema):
    """On PostgreSQL (its own clock: real seconds, short waits): submit, drive, park, decide."""
    from treadle.stores.postgres import open_postgres_store

    world = World()
    quick = [call("work", seconds=0.1, call_id="w1"), say("done")]
    agents = {"calc": lambda: world.agent(quick), "pay": lambda: world.agent(WIRE)}
    with trio.fail_after(60):
        async with open_postgres_store(postgres_dsn, schema=postgres_schema) as store:
            async with open_fleet(
                store, agents, max_running=2, claim_poll_s=0.1, park_after_s=0.5
            ) as worker:
                await worker.submit("pay", "pay", run_id="p")
                await worker.submit("calc", "work", run_id="c")
                done = await worker.result("c", poll_s=0.1)
                await until(liveness_is(store, "p", Liveness.PARKED), step_s=0.1)
                assert (await store.read_lease("p")).owner == ""
                await decide(store, "p")  # real time, as the store's clock
                paid = await worker.result("p", poll_s=0.1)
                # result() reads the store; the worker counts the drive when its task ends
                await until(slot_freed(worker), step_s=0.1)
                stats = worker.statistics()
            log = await store.read_log("p")
    assert done.final_answer == "done" and paid.final_answer == "paid"
    assert sorted(world.effects) == ["c/s1/a1", "p/s1/a1"]
    assert stats.finished == 2 and stats.takeovers == 0
    assert check_invariants(log) == []
