"""The relay: one task for many runs, hosted in one member's nursery at a time."""

from __future__ import annotations

import pytest
import trio
from runtime_fakes import LedgerTools, SimpleParser

import treadle
from treadle._exceptions import StoreError
from treadle.agent import Agent, Limits
from treadle.approvals import request_cancel
from treadle.stores.memory import MemoryStore
from treadle.supervisors import CONTROL_POLL_S
from treadle.supervisors._relay import Relay
from treadle.testing.scripted import ScriptedModel, call, say
from treadle.types import RunState, StopReason


class Ticker:
    """A job that ticks every second of its own, counting its starts and its copies."""

    def __init__(self) -> None:
        self.running = 0
        self.most_at_once = 0
        self.starts = 0
        self.ticks: list[float] = []

    async def job(self) -> None:
        self.starts += 1
        self.running += 1
        self.most_at_once = max(self.most_at_once, self.running)
        try:
            while True:
                await trio.sleep(1)
                self.ticks.append(trio.current_time())
        finally:
            self.running -= 1


async def member(
    relay: Relay, lasts_s: float, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
) -> None:
    """Join ``relay`` (then report started), stay ``lasts_s`` seconds, leave."""
    async with trio.open_nursery() as nursery:
        key = relay.join(nursery)
        task_status.started()
        try:
            await trio.sleep(lasts_s)
        finally:
            relay.leave(key)


async def test_three_members_run_one_job_and_it_moves_on_when_its_host_leaves(autojump_clock):
    ticker = Ticker()
    relay = Relay(ticker.job)
    async with trio.open_nursery() as nursery:
        await nursery.start(member, relay, 3.5)
        await nursery.start(member, relay, 6.2)
        await nursery.start(member, relay, 9.5)
    assert ticker.most_at_once == 1
    assert ticker.starts == 3  # in the first member's nursery, then the second's, the third's
    # Hosted by the first until 3.5, the second from 3.5 to 6.2, the third until 9.5.
    assert ticker.ticks == [1.0, 2.0, 3.0, 4.5, 5.5, 7.2, 8.2, 9.2]
    assert not relay.hosted
    assert ticker.running == 0


async def test_a_host_leaving_mid_tick_keeps_the_jobs_timing(autojump_clock):
    ticks: list[float] = []
    next_at = [1.0]

    async def job() -> None:
        while True:
            await trio.sleep_until(next_at[0])
            ticks.append(trio.current_time())
            next_at[0] += 1

    relay = Relay(job)
    async with trio.open_nursery() as nursery:
        await nursery.start(member, relay, 2.5)
        await nursery.start(member, relay, 5.2)
    assert ticks == [1.0, 2.0, 3.0, 4.0, 5.0]


async def test_a_job_that_fails_fails_its_host_once_and_goes_on_at_the_next_arrival(
    autojump_clock,
):
    starts: list[int] = []

    async def job() -> None:
        starts.append(len(starts))
        await trio.sleep(1)
        if len(starts) == 1:
            raise RuntimeError("the job failed")
        await trio.sleep_forever()

    relay = Relay(job)
    with pytest.raises(BaseException) as failed:
        await member(relay, 5)
    assert "the job failed" in repr(failed.value)  # in an exception group, or alone
    assert starts == [0] and not relay.hosted
    async with trio.open_nursery() as nursery:
        nursery.start_soon(member, relay, 3)
        await trio.sleep(2)
        assert starts == [0, 1] and relay.hosted  # b arrived and hosts it
    assert not relay.hosted


async def test_a_host_cancelled_from_outside_hands_the_job_on_at_once(autojump_clock):
    ticker = Ticker()
    relay = Relay(ticker.job)
    a_scope = trio.CancelScope()

    async def a() -> None:
        with a_scope:
            async with trio.open_nursery() as nursery:
                key = relay.join(nursery)
                try:
                    await trio.sleep_forever()
                finally:
                    with trio.CancelScope(shield=True):
                        await trio.sleep(2)  # a slow exit: a stays a member meanwhile
                    relay.leave(key)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(a)
        await trio.sleep(0.5)
        nursery.start_soon(member, relay, 6)
        await trio.sleep(1)
        a_scope.cancel()
        await trio.sleep(0.1)
        assert relay.hosted and ticker.starts == 2  # b hosts it, without waiting for a
        await trio.sleep(3)
        assert ticker.starts == 2  # a left later: nothing to hand on
    assert ticker.most_at_once == 1


def make(model_turns):
    return Agent(
        model=ScriptedModel(model_turns),
        executor=LedgerTools(),
        parser=SimpleParser(),
        limits=Limits(tool_timeout_s=600),
    )


def _named_tasks(name: str) -> int:
    count = 0
    stack = [trio.lowlevel.current_root_task()]
    while stack:
        task = stack.pop()
        count += name in task.name
        stack.extend(t for n in task.child_nurseries for t in n.child_tasks)
    return count


async def test_the_runs_of_a_store_renew_and_poll_in_one_task_each(autojump_clock):
    store = MemoryStore()
    counted: list[tuple[int, int]] = []

    async def one(i: int) -> None:
        agent = make([call("sleep", s=10, call_id="c1"), say("done")])
        await treadle.run(agent, "x", store=store, run_id=f"r{i}")

    async with trio.open_nursery() as nursery:
        for i in range(10):
            nursery.start_soon(one, i)
        await trio.sleep(5)
        counted.append((_named_tasks("LeaseKeeper.run"), _named_tasks("ControlIndex._poll")))
    assert counted == [(1, 1)]


async def test_a_cancel_reaches_a_run_after_the_run_that_polled_for_it_ended(autojump_clock):
    store = MemoryStore()
    results = {}

    async def one(run_id: str, sleep_s: float) -> None:
        agent = make([call("sleep", s=sleep_s, call_id="c1"), say("done")])
        results[run_id] = await treadle.run(agent, "x", store=store, run_id=run_id)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(one, "first", 2)
        await trio.sleep(1)  # "first" hosts the polling by now
        nursery.start_soon(one, "second", 60)
        await trio.sleep(5)
        assert results["first"].stop_reason is StopReason.FINAL_ANSWER
        requested = trio.current_time()
        await request_cancel(store, "second", reason="from the CLI")
        await trio.sleep(CONTROL_POLL_S + 0.01)
        assert "second" in results, "the cancel did not land within one poll interval"
        landed = trio.current_time() - requested
    assert results["second"].state is RunState.CANCELLED
    assert landed <= CONTROL_POLL_S + 0.01


async def test_run_drives_in_the_calling_task_and_open_run_in_a_task_of_its_own(autojump_clock):
    store = MemoryStore()
    counted: dict[str, int] = {}

    async def with_run() -> None:
        agent = make([call("sleep", s=10, call_id="c1"), say("done")])
        result = await treadle.run(agent, "x", store=store, run_id="a")
        assert result.stop_reason is StopReason.FINAL_ANSWER

    async def with_open_run() -> None:
        agent = make([call("sleep", s=10, call_id="c1"), say("done")])
        async with treadle.open_run(agent, "x", store=store, run_id="b") as handle:
            await trio.sleep(5)
            counted["open_run"] = _named_tasks("_supervise")
            assert (await handle.wait()).stop_reason is StopReason.FINAL_ANSWER

    async with trio.open_nursery() as nursery:
        nursery.start_soon(with_run)
        await trio.sleep(5)
        counted["run"] = _named_tasks("_supervise")
    await with_open_run()
    assert counted == {"run": 0, "open_run": 1}


class FlakyControl(MemoryStore):
    """Fails the readings of control heads and streams while ``failing`` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.failing: set[str] = set()
        self.failed: list[str] = []

    async def control_heads(self, run_ids):
        if "heads" in self.failing:
            self.failed.append("heads")
            raise StoreError("the heads cannot be read")
        return await super().control_heads(run_ids)

    async def read_control(self, run_id, *, after=0):
        if "streams" in self.failing:
            self.failed.append("stream")
            raise StoreError("the stream cannot be read")
        return await super().read_control(run_id, after=after)


@pytest.mark.parametrize("what", ["heads", "streams"])
async def test_a_failed_control_reading_is_logged_and_made_again(what, autojump_clock, caplog):
    store = FlakyControl()
    results = {}

    async def one(run_id: str) -> None:
        agent = make([call("sleep", s=60, call_id="c1"), say("done")])
        results[run_id] = await treadle.run(agent, "x", store=store, run_id=run_id)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(one, "polled")  # hosts the polling
        nursery.start_soon(one, "cancelled")
        await trio.sleep(2)
        store.failing.add(what)
        await request_cancel(store, "cancelled", reason="stop")
        await trio.sleep(3 * CONTROL_POLL_S)
        assert store.failed and not results  # failing readings stopped no run
        store.failing.clear()
        await trio.sleep(CONTROL_POLL_S + 0.01)
        assert results["cancelled"].state is RunState.CANCELLED
        nursery.cancel_scope.cancel()
    assert "polled" not in results  # still driven when the test ended it
    assert "trying again" in caplog.text


async def test_a_run_polling_more_often_shortens_the_wait_under_way(autojump_clock):
    store = MemoryStore()
    results = {}

    async def one(run_id: str, poll_s: float) -> None:
        agent = make([call("sleep", s=60, call_id="c1"), say("done")])
        results[run_id] = await treadle.run(
            agent, "x", store=store, run_id=run_id, control_poll_s=poll_s
        )

    async with trio.open_nursery() as nursery:
        nursery.start_soon(one, "slow", 30)  # hosts the polling, every 30 s
        await trio.sleep(1)
        nursery.start_soon(one, "fast", 0.5)
        await trio.sleep(1)
        await request_cancel(store, "fast", reason="stop")
        await trio.sleep(0.5 + 0.01)
        assert results["fast"].state is RunState.CANCELLED
        nursery.cancel_scope.cancel()


class SlowRenewals(MemoryStore):
    """Renewals take 0.2 s (a slow store); records when each began."""

    def __init__(self) -> None:
        super().__init__(clock=trio.current_time)
        self.began: list[float] = []

    async def renew_leases(self, leases, *, ttl_s):
        self.began.append(trio.current_time())
        await trio.sleep(0.2)
        return await super().renew_leases(leases, ttl_s=ttl_s)


async def test_a_renewal_cut_short_with_its_host_is_made_again_at_once(autojump_clock):
    store = SlowRenewals()
    results = {}
    host = trio.CancelScope()

    async def one(run_id: str) -> None:
        agent = make([call("sleep", s=5, call_id="c1"), say("done")])
        results[run_id] = await treadle.run(agent, "x", store=store, run_id=run_id, lease_ttl_s=1.5)

    async def hosting() -> None:
        with host:
            await one("host")

    async with trio.open_nursery() as nursery:
        nursery.start_soon(hosting)  # joins first: it renews, every 0.5 s
        await trio.sleep(0.1)
        nursery.start_soon(one, "other")
        await trio.sleep_until(0.6)  # the renewal of 0.5 s is under way
        host.cancel()
    assert results["other"].stop_reason is StopReason.FINAL_ANSWER
    assert "host" not in results
    # The renewal begun at 0.5 was cut with its host; the next host made it again at once,
    # not half an interval later.
    assert any(0.6 <= at < 0.7 for at in store.began), store.began
