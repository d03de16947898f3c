"""Runs on leases: one driver at a time, renewal, takeover with fencing, release, parking.

Also `finish_cancelled`: finishing a run that nobody drives (crashed, or queued and never
started) as cancelled, leaving no intent without an outcome.

The stores' lease clock is trio's virtual clock (``1e9 + trio.current_time()``), so leases
expire in virtual time under ``autojump_clock``.
"""

from __future__ import annotations

import datetime as dt
import functools
import sqlite3
import unittest.mock
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager, contextmanager
from pathlib import Path

import attrs
import pytest
import trio
import trio.testing
from runtime_fakes import LedgerTools, SimpleParser

import treadle
from treadle._exceptions import InvalidRunId, LeaseLost, RunLeased
from treadle.agent import Agent
from treadle.approvals import decide, request_cancel
from treadle.ports import RunStore
from treadle.stores.jsonl import open_jsonl_store
from treadle.stores.memory import MemoryStore
from treadle.stores.sqlite import open_sqlite_store
from treadle.supervisors import finish_cancelled, open_run
from treadle.testing import CrashingExecutor, CrashingStore, InterceptingStore, SimulatedCrash
from treadle.testing.invariants import check_approvals, check_invariants
from treadle.testing.scripted import ScriptedModel, call, calls, say
from treadle.types import (
    Action,
    ActionIntent,
    ActionOutcome,
    ActionResult,
    ActionStatus,
    ApprovalDecided,
    CancelRequested,
    Lease,
    Limits,
    Liveness,
    Message,
    ModelResult,
    RunFinished,
    RunStarted,
    RunState,
    StopReason,
    ToolCall,
)

EPOCH = 1e9
THREAD_STORE_AUTOJUMP_S = 0.005
"""Real seconds of idleness before the virtual clock jumps (or asks again whether a store's
thread is still at work), with a store that uses threads."""


_TRIO_CLOCK: list[trio.testing.MockClock] = []


@pytest.fixture(autouse=True)
def _virtual_time(request):
    """The test's virtual clock, for `store_now` (the PostgreSQL tests run in real time)."""
    if "autojump_clock" in request.fixturenames:
        _TRIO_CLOCK[:] = [request.getfixturevalue("autojump_clock")]
    else:  # never an earlier test's clock: `store_now` fails at once without one
        _TRIO_CLOCK.clear()


def store_now() -> float:
    """The stores' clock: epoch seconds that move with trio's (virtual) clock.

    It reads the clock object itself, so that a store may call it from a worker thread (the
    SQLite store does; `trio.current_time` works only in the trio thread).
    """
    return EPOCH + _TRIO_CLOCK[0].current_time()


@attrs.define(eq=False)
class VirtualClock:
    """Record timestamps on the same virtual clock as the store's leases."""

    def now_iso(self) -> str:
        return dt.datetime.fromtimestamp(store_now(), dt.UTC).isoformat()


def only_add(tool_name, arguments):
    return tool_name == "add"


def make(turns, *, latency_s=0.0, tools=None, **kwargs):
    tools = tools or LedgerTools()
    model = ScriptedModel(turns=turns, latency_s=latency_s)
    kwargs.setdefault("limits", Limits(tool_timeout_s=600))
    return Agent(model=model, executor=tools, parser=SimpleParser(), **kwargs), tools


@asynccontextmanager
async def opened_store(kind: str, tmp_path: Path, clock=store_now) -> AsyncIterator[RunStore]:
    """A fresh store of ``kind`` whose lease clock is ``clock``."""
    if kind == "memory":
        yield MemoryStore(clock=clock)
        return
    if kind == "sqlite":
        opened = open_sqlite_store(tmp_path / "runs.db", clock=clock)
    else:
        opened = open_jsonl_store(tmp_path / "runs", clock=clock)
    with virtual_time_waits_for_threads() as store_opened:
        async with opened as store:
            store_opened(store)
            yield store


_IN_THREADS = [0]


async def _counted_run_sync(fn, *args, **kwargs):
    _IN_THREADS[0] += 1
    try:
        return await _REAL_RUN_SYNC(fn, *args, **kwargs)
    finally:
        _IN_THREADS[0] -= 1


_REAL_RUN_SYNC = trio.to_thread.run_sync


@contextmanager
def virtual_time_waits_for_threads():
    """Let the virtual clock jump only while no store works in a thread.

    The file stores do their I/O in worker threads (``trio.to_thread.run_sync`` and the
    commit engine's committer thread). Trio counts a task waiting on a thread as blocked, so
    the autojump clock would skip virtual seconds, past lease expiries, while a write is in
    flight on a loaded machine. Here a jump waits until no ``run_sync`` call is out and the
    store's engine has nothing pending. Yields the function that names the opened store.
    """
    mock = _TRIO_CLOCK[0]
    stores: list[RunStore] = []
    jump = mock._autojump

    def busy() -> bool:
        return _IN_THREADS[0] > 0 or any(s.statistics().pending for s in stores)

    def held_jump() -> None:
        if not busy():  # else the run loop asks again after the next idle threshold
            jump()

    mock._autojump = held_jump
    mock.autojump_threshold = THREAD_STORE_AUTOJUMP_S
    try:
        with unittest.mock.patch.object(trio.to_thread, "run_sync", _counted_run_sync):
            yield stores.append
    finally:
        del mock._autojump


def sqlite_generations(tmp_path: Path, run_id: str) -> list[int]:
    """The ``gen`` column of the run's records, in seq order (read with sqlite3 directly)."""
    with sqlite3.connect(tmp_path / "runs.db") as conn:
        rows = conn.execute(
            "SELECT seq, gen FROM records WHERE run_id = ? ORDER BY seq", (run_id,)
        ).fetchall()
    assert [seq for seq, _ in rows] == list(range(1, len(rows) + 1))
    return [gen for _, gen in rows]


async def generations(kind: str, store: RunStore, tmp_path: Path, run_id: str) -> list[int] | None:
    """Each record's writer generation, where the store keeps it (``None`` in memory)."""
    if kind == "sqlite":
        return sqlite_generations(tmp_path, run_id)
    if kind == "jsonl":
        return list(await store.read_generations(run_id))
    return None


async def until(predicate, *, step_s: float = 0.1, limit_s: float = 600) -> None:
    """Sleep (virtual time) until ``predicate()`` holds."""
    with trio.fail_after(limit_s):
        while not predicate():  # noqa: ASYNC110 (polling a plain attribute)
            await trio.sleep(step_s)


async def parked(handle) -> None:
    """Wait until the run is parked (its coordinator gone, the request pending)."""
    with trio.fail_after(600):
        assert await handle.wait_parked(), f"the run ended instead of parking: {handle.state}"
    await trio.sleep(0.1)  # let the stopped actors end


async def until_released(store: RunStore, run_id: str) -> None:
    """Wait until the run's lease is released (a parked run releases it after parking)."""
    with trio.fail_after(60):
        while (await store.read_lease(run_id)).owner:  # noqa: ASYNC110 (polling the store)
            await trio.sleep(0.1)


class FrozenRenewals(InterceptingStore):
    """Renewals reach no store once frozen, but report the leases as renewed (a hung host)."""

    def __init__(self, inner: RunStore) -> None:
        super().__init__(inner)
        self.frozen = False
        self.renewals = 0

    async def renew_leases(self, leases, *, ttl_s):
        self.renewals += 1
        if self.frozen:
            await trio.lowlevel.checkpoint()
            return tuple(leases)
        return await super().renew_leases(leases, ttl_s=ttl_s)


class DiesAtReacquire(InterceptingStore):
    """The process dies when it takes the lease a second time (a parked run coming back)."""

    def __init__(self, inner: RunStore) -> None:
        super().__init__(inner)
        self.acquired = 0

    async def acquire_lease(self, run_id, *, owner, ttl_s):
        self.acquired += 1
        if self.acquired == 2:
            raise SimulatedCrash("the process died while the run came back from parking")
        return await super().acquire_lease(run_id, owner=owner, ttl_s=ttl_s)


class Recording(InterceptingStore):
    """Records the lease and control-stream operations, in order."""

    def __init__(self, inner: RunStore) -> None:
        super().__init__(inner)
        self.ops: list[tuple[str, object]] = []

    async def acquire_lease(self, run_id, *, owner, ttl_s):
        lease = await super().acquire_lease(run_id, owner=owner, ttl_s=ttl_s)
        self.ops.append(("acquire", lease))
        return lease

    async def release_lease(self, lease, *, control_seen=0):
        self.ops.append(("release", lease))
        await super().release_lease(lease, control_seen=control_seen)

    async def append_control(self, record):
        entry = await super().append_control(record)
        self.ops.append(("control", record))
        return entry


# --------------------------------------------------------------------------- one driver at a time


@pytest.mark.parametrize("kind", ["memory", "sqlite", "jsonl"])
async def test_a_second_driver_of_a_run_is_refused_naming_the_holder(
    kind, tmp_path, autojump_clock
):
    agent, tools = make([call("sleep", s=15, call_id="c1"), say("done")])
    async with (
        opened_store(kind, tmp_path) as store,
        open_run(agent, "x", store=store, run_id="r", owner="first-owner") as first,
    ):
        await trio.sleep(5)  # the first driver is in its tool call
        before = (await store.read_log("r")).records
        assert before
        with pytest.raises(RunLeased) as refused:
            async with open_run(agent, "x", store=store, run_id="r", owner="second-owner"):
                pytest.fail("a second driver was let in")
        assert refused.value.holder.owner == "first-owner"
        assert refused.value.run_id == "r"
        assert "first-owner" in str(refused.value)
        with pytest.raises(RunLeased, match="first-owner"):
            await treadle.run(agent, "x", store=store, run_id="r", owner="third-owner")
        # The refused drivers wrote nothing and took nothing.
        assert (await store.read_log("r")).records == before
        lease = await store.read_lease("r")
        assert lease is not None and lease.owner == "first-owner" and lease.generation == 1
        result = await first.wait()
    assert result.stop_reason is StopReason.FINAL_ANSWER
    assert [a.call_id for a in tools.executed] == ["c1"]


async def test_a_second_driver_is_refused_while_the_first_waits_on_a_human(autojump_clock):
    agent, _tools = make([call("add", a=1, b=2, call_id="c1"), say("3")])
    store = MemoryStore(clock=store_now)
    async with open_run(
        agent, "x", store=store, run_id="r", owner="a", approval_policy=only_add, park_after_s=None
    ) as handle:
        await trio.sleep(100)  # many TTLs of waiting, actors running
        assert handle.state is RunState.AWAITING_APPROVAL
        with pytest.raises(RunLeased):
            await treadle.run(agent, store=store, run_id="r", owner="b")
        handle.approve()
        result = await handle.wait()
    assert result.stop_reason is StopReason.FINAL_ANSWER
    lease = await store.read_lease("r")
    assert lease is not None and lease.generation == 1


# --------------------------------------------------------------------------- renewal


@pytest.mark.parametrize("kind", ["memory", "sqlite"])
async def test_the_lease_is_renewed_across_many_ttls(kind, tmp_path, autojump_clock):
    agent, tools = make(
        [call("sleep", s=20, call_id="c1"), call("sleep", s=20, call_id="c2"), say("done")],
        latency_s=1.0,
    )
    async with opened_store(kind, tmp_path) as raw:
        store = FrozenRenewals(raw)  # never frozen here: it only counts the renewals
        async with open_run(
            agent, "x", store=store, run_id="r", owner="a", lease_ttl_s=3, control_poll_s=None
        ) as handle:
            beats = []
            for _ in range(8):
                await trio.sleep(5)
                lease = await store.read_lease("r")
                assert lease is not None and lease.owner == "a" and lease.generation == 1
                assert lease.expires_at > store_now()  # still live, 13 TTLs after the start
                beats.append(lease.heartbeat_at)
            result = await handle.wait()
        assert beats == sorted(set(beats))  # the heartbeat moved on every time
        final = await store.read_lease("r")
        gens = await generations(kind, raw, tmp_path, "r")
    assert result.stop_reason is StopReason.FINAL_ANSWER
    assert [a.call_id for a in tools.executed] == ["c1", "c2"]
    # About one renewal per second (TTL / 3) over the 43 s the run took.
    assert store.renewals >= 35
    assert final is not None and final.generation == 1 and final.owner == ""
    if gens is not None:
        assert set(gens) == {1}


class RenewalCalls(FrozenRenewals):
    """Records which runs each renewal call renewed."""

    def __init__(self, inner: RunStore) -> None:
        super().__init__(inner)
        self.calls: list[tuple[float, frozenset[str]]] = []

    async def renew_leases(self, leases, *, ttl_s):
        self.calls.append((trio.current_time(), frozenset(lease.run_id for lease in leases)))
        return await super().renew_leases(leases, ttl_s=ttl_s)


async def test_runs_driven_on_their_own_share_one_renewal_per_interval(autojump_clock):
    """Ten runs of one store renew in one call per TTL/3, and when the run that renewed ends
    first, another goes on renewing the ones still driven."""
    store = RenewalCalls(MemoryStore(clock=store_now))
    lengths = {f"r{i}": 20 if i else 4 for i in range(10)}  # r0 ends first
    results = {}

    async def one(run_id):
        agent, _ = make([call("sleep", s=lengths[run_id], call_id="c1"), say("done")])
        results[run_id] = await treadle.run(
            agent, "x", store=store, run_id=run_id, owner=f"o-{run_id}", lease_ttl_s=3
        )

    async with trio.open_nursery() as nursery:
        for run_id in lengths:
            nursery.start_soon(one, run_id)
        await trio.sleep(12)  # r0 has finished; the other nine are inside their tool
        lease = await store.read_lease("r5")
        assert lease is not None and lease.expires_at > store_now()
    assert all(r.stop_reason is StopReason.FINAL_ANSWER for r in results.values())
    assert max(len(ids) for _, ids in store.calls) == 10  # all ten in one call
    early = [ids for at, ids in store.calls if at < 4]
    late = [ids for at, ids in store.calls if at > 5]
    assert early and all(len(ids) == 10 for ids in early)
    assert late and all("r0" not in ids and len(ids) == 9 for ids in late)
    # One call per second (TTL/3) over the ~20 s, not one per run: fewer than 30, not 200.
    assert 15 <= len(store.calls) < 30, len(store.calls)
    for run_id in lengths:
        final = await store.read_lease(run_id)
        assert final is not None and final.generation == 1 and final.owner == ""


# --------------------------------------------------------------------------- takeover


async def fence_a_frozen_driver(raw: RunStore, agent: Agent) -> tuple[Lease, int]:
    """Drive ``r`` with renewals frozen, take it over as ``b``, check the driver was fenced.

    Returns:
        The lease ``b`` took, and the number of records at the takeover.
    """
    store = FrozenRenewals(raw)
    async with open_run(agent, "x", store=store, run_id="r", owner="a", lease_ttl_s=3) as handle:
        await trio.sleep(2)  # in the tool call
        store.frozen = True
        await trio.sleep(5)  # the lease lapsed unrenewed
        taken = await raw.acquire_lease("r", owner="b", ttl_s=3600)
        assert taken.generation == 2
        at_takeover = len((await raw.read_log("r")).records)
        with pytest.raises(LeaseLost) as lost:
            await handle.wait()
    assert lost.value.run_id == "r" and lost.value.generation == 1
    assert lost.value.current == 2
    assert len((await raw.read_log("r")).records) == at_takeover
    # The stale driver did not release (nor touch) the new holder's lease.
    assert await raw.read_lease("r") == taken
    return taken, at_takeover


@asynccontextmanager
async def another_process(kind: str, tmp_path: Path, store: RunStore) -> AsyncIterator[RunStore]:
    """A second store object on the same data (the same object for the memory store)."""
    if kind == "sqlite":
        async with open_sqlite_store(tmp_path / "runs.db", clock=store_now) as other:
            yield other
    else:
        yield store


@pytest.mark.parametrize("kind", ["memory", "sqlite"])
async def test_a_frozen_driver_is_fenced_after_a_takeover(kind, tmp_path, autojump_clock):
    """Renewals stop reaching the store; the lease expires; another owner takes the run.

    The first driver does not know (its renewals "succeed"), so its next write is refused by
    the store's fencing: it stops with LeaseLost and nothing of it lands after the takeover.
    """
    agent, tools = make([call("sleep", s=12, call_id="c1"), say("done")])
    async with opened_store(kind, tmp_path) as raw:
        _, at_takeover = await fence_a_frozen_driver(raw, agent)
        gens = await generations(kind, raw, tmp_path, "r")
        # The new holder (another process) resumes the run from its log and finishes it.
        async with another_process(kind, tmp_path, raw) as other:
            result = await treadle.run(agent, store=other, run_id="r", owner="b")
            log = await other.read_log("r")
        after = await generations(kind, raw, tmp_path, "r")
    assert result.stop_reason is StopReason.FINAL_ANSWER
    if gens is not None:
        assert gens == [1] * at_takeover
        assert after[:at_takeover] == gens and set(after[at_takeover:]) == {2}
    # The tool ran once (under the stale driver); its outcome is unknown to the log.
    assert [a.call_id for a in tools.executed] == ["c1"]
    (outcome,) = [r.outcome for r in log.records if isinstance(r, ActionResult)]
    assert outcome.status is ActionStatus.UNKNOWN
    assert check_invariants(log) == []


@pytest.mark.parametrize("kind", ["memory", "sqlite"])
async def test_the_same_store_object_drives_a_run_again_after_a_stale_driver_was_fenced(
    kind, tmp_path, autojump_clock
):
    """One worker process, one store object: its stale driver is fenced; later it (or any
    driver sharing the object) takes the run over legitimately and must be able to write."""
    agent, _tools = make([call("sleep", s=12, call_id="c1"), say("done")])
    async with opened_store(kind, tmp_path) as raw:
        await fence_a_frozen_driver(raw, agent)
        result = await treadle.run(agent, store=raw, run_id="r", owner="b")
    assert result.stop_reason is StopReason.FINAL_ANSWER


@pytest.mark.parametrize("kind", ["memory", "sqlite"])
async def test_a_driver_whose_lease_was_taken_stops_at_its_next_renewal(
    kind, tmp_path, autojump_clock
):
    """A clock jump expires the lease; once taken over, the first driver's renewal fails."""
    jump = [0.0]

    def jumping() -> float:
        return store_now() + jump[0]

    agent, _tools = make([call("sleep", s=30, call_id="c1"), say("done")])
    async with opened_store(kind, tmp_path, jumping) as store:
        async with open_run(
            agent, "x", store=store, run_id="r", owner="a", lease_ttl_s=3
        ) as handle:
            await trio.sleep(2.5)  # between two renewals (every second)
            jump[0] = 100.0  # the store's clock leaps past the lease's expiry
            taken = await store.acquire_lease("r", owner="b", ttl_s=3600)
            at_takeover = len((await store.read_log("r")).records)
            took_at = trio.current_time()
            with pytest.raises(LeaseLost) as lost:
                await handle.wait()
            # Stopped at the next renewal (TTL / 3), not at the end of its 30 s tool call.
            assert trio.current_time() - took_at <= 1.5
        assert lost.value.generation == 1 and taken.generation == 2
        assert len((await store.read_log("r")).records) == at_takeover
        assert await store.read_lease("r") == taken
    if kind == "sqlite":
        assert sqlite_generations(tmp_path, "r") == [1] * at_takeover


async def test_treadle_run_raises_lease_lost(autojump_clock):
    jump = [0.0]
    store = MemoryStore(clock=lambda: store_now() + jump[0])
    agent, _ = make([call("sleep", s=30, call_id="c1"), say("done")])
    raised: list[BaseException] = []

    async def drive():
        try:
            await treadle.run(agent, "x", store=store, run_id="r", owner="a", lease_ttl_s=3)
        except LeaseLost as exc:
            raised.append(exc)

    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(drive)
            await trio.sleep(2.5)  # between two renewals (every second)
            jump[0] = 100.0
            await store.acquire_lease("r", owner="b", ttl_s=3600)
    assert len(raised) == 1 and raised[0].generation == 1


class StaleToken(Exception):
    """What `FencedPayments` raises for a request whose fencing token is older than one it saw."""


@attrs.define(eq=False)
class FencedPayments:
    """A payment system that takes a fencing token with each request (the classic pattern).

    It keeps the newest token it has seen for each run and refuses a request carrying an older
    one, recording what it charged and what it refused.
    """

    newest: dict[str, int] = attrs.Factory(dict)
    charged: list[tuple[str, int]] = attrs.Factory(list)
    refused: list[tuple[str, int]] = attrs.Factory(list)

    def fence(self, run_id: str, token: int) -> None:
        """From now on, refuse the run's requests carrying a token older than ``token``."""
        self.newest[run_id] = max(self.newest.get(run_id, 0), token)

    def charge(self, run_id: str, key: str, token: int) -> None:
        """Charge once under ``key``; raises `StaleToken` for a token older than the newest."""
        if token < self.newest.get(run_id, 0):
            self.refused.append((key, token))
            raise StaleToken(f"token {token} is older than {self.newest[run_id]}")
        self.fence(run_id, token)
        self.charged.append((key, token))


@attrs.define(eq=False)
class FencedPay:
    """A ``never`` tool ``pay`` on `FencedPayments`, held in flight until ``release`` is set.

    Its reconcile hook fences the payment system with the resuming drive's generation before
    it looks for the charge: from then on, a call of an older driver is refused there.
    """

    payments: FencedPayments = attrs.Factory(FencedPayments)
    started: trio.Event = attrs.Factory(trio.Event)
    release: trio.Event = attrs.Factory(trio.Event)
    called_with: list[int] = attrs.Factory(list)
    reconciled_with: list[int] = attrs.Factory(list)

    async def reconcile(self, action: Action) -> ActionOutcome:
        self.payments.fence(action.run_id, action.generation)
        self.reconciled_with.append(action.generation)
        if any(key == action.intent_id for key, _ in self.payments.charged):
            return ActionOutcome(status=ActionStatus.EXECUTED, observation="charged")
        return ActionOutcome(
            status=ActionStatus.NOT_EXECUTED, observation="not charged", detail="no charge"
        )

    def agent(self) -> Agent:
        @treadle.tool(reconcile=self.reconcile, timeout_s=600)
        async def pay(amount: int, ctx: treadle.ToolContext) -> str:
            """Charge an amount."""
            self.started.set()
            self.called_with.append(ctx.generation)
            await self.release.wait()  # the driver is paused: it knows nothing of a takeover
            self.payments.charge(ctx.run_id, ctx.intent_id, ctx.generation)
            return "charged"

        agent, _ = make(
            [call("pay", amount=5, call_id="c1"), say("done")], tools=treadle.Toolbox([pay])
        )
        return agent


async def a_paused_call_after_a_takeover(
    raw: RunStore, other: Callable[[], AbstractAsyncContextManager[RunStore]], pay: FencedPay
) -> treadle.types.RunLog:
    """Driver ``a`` starts ``pay`` and stops renewing; ``b`` takes the run over and finishes it
    (reconciling the call); then ``a``'s call goes on. The log ``b`` left."""
    agent = pay.agent()
    store = FrozenRenewals(raw)
    async with open_run(agent, "x", store=store, run_id="r", owner="a", lease_ttl_s=1) as handle:
        await pay.started.wait()
        store.frozen = True  # paused: its renewals reach no store
        async with other() as second:  # another process
            while True:  # until the lease lapsed by the store's clock
                try:
                    await second.acquire_lease("r", owner="b", ttl_s=600)
                    break
                except RunLeased:
                    await trio.sleep(0.1)
            result = await treadle.run(agent, store=second, run_id="r", owner="b")
            log = await second.read_log("r")
        assert result.stop_reason is StopReason.FINAL_ANSWER
        pay.release.set()  # ``a`` wakes, its call goes on after the run finished elsewhere
        with pytest.raises(LeaseLost):
            await handle.wait()
    return log


def check_the_stale_call_was_refused(log: treadle.types.RunLog, pay: FencedPay) -> None:
    """``a``'s call carried generation 1, ``b``'s reconcile fenced with 2: it was refused."""
    assert pay.called_with == [1] and pay.reconciled_with == [2]
    assert pay.payments.refused == [("r/s1/a1", 1)] and pay.payments.charged == []
    (result,) = [r for r in log.records if isinstance(r, ActionResult)]
    assert result.outcome.status is ActionStatus.NOT_EXECUTED and result.reconciled
    assert check_invariants(log) == []


async def test_a_paused_drivers_call_carries_its_generation_and_is_refused_after_a_takeover(
    tmp_path, autojump_clock
):
    """A driver paused with a ``never`` call in flight may make it after another driver
    reconciled it as not executed; the call's fencing generation lets the system refuse it."""
    pay = FencedPay()
    with trio.fail_after(600):
        async with opened_store("sqlite", tmp_path) as raw:
            log = await a_paused_call_after_a_takeover(
                raw, functools.partial(another_process, "sqlite", tmp_path, raw), pay
            )
    check_the_stale_call_was_refused(log, pay)


# --------------------------------------------------------------------------- release


@pytest.mark.parametrize("kind", ["memory", "sqlite", "jsonl"])
async def test_a_finished_run_releases_its_lease(kind, tmp_path, autojump_clock):
    agent, _ = make([call("add", a=1, b=2, call_id="c1"), say("3")])
    async with opened_store(kind, tmp_path) as store:
        result = await treadle.run(agent, "x", store=store, run_id="r", owner="a")
        lease = await store.read_lease("r")
        assert lease is not None and lease.owner == "" and lease.generation == 1
        # Anyone may open it now: it reports the stored result without writing.
        before = (await store.read_log("r")).records
        again = await treadle.run(agent, store=store, run_id="r", owner="b")
        assert (await store.read_log("r")).records == before
        assert (await store.read_lease("r")).owner == ""
    assert result.stop_reason is StopReason.FINAL_ANSWER
    assert again.final_answer == result.final_answer == "3"


@pytest.mark.parametrize("kind", ["memory", "sqlite", "jsonl"])
async def test_an_exception_in_the_block_releases_the_lease(kind, tmp_path, autojump_clock):
    agent, _tools = make([call("sleep", s=30, call_id="c1"), say("done")])
    async with opened_store(kind, tmp_path) as store:
        with pytest.raises(RuntimeError, match="caller failed"):
            async with open_run(agent, "x", store=store, run_id="r", owner="a"):
                await trio.sleep(1)
                raise RuntimeError("caller failed")
        lease = await store.read_lease("r")
        assert lease is not None and lease.owner == ""
        log = await store.read_log("r")
        assert log.finished is None  # left resumable, not cancelled
        # Another driver takes it at once (no TTL to wait out) and finishes it.
        result = await treadle.run(agent, store=store, run_id="r", owner="b")
        lease = await store.read_lease("r")
    assert result.stop_reason is StopReason.FINAL_ANSWER
    assert lease.generation == 2 and lease.owner == ""


async def test_a_run_cancelled_from_outside_releases_its_lease(autojump_clock):
    store = MemoryStore(clock=store_now)
    agent, _ = make([call("sleep", s=30, call_id="c1"), say("done")])
    with trio.move_on_after(5):
        await treadle.run(agent, "x", store=store, run_id="r", owner="a")
    lease = await store.read_lease("r")
    assert lease is not None and lease.owner == ""
    summary = await store.read_summary("r")
    assert summary.liveness is Liveness.ORPHANED


@pytest.mark.parametrize("ttl", [0, -1, float("inf"), float("nan")])
async def test_a_lease_ttl_that_is_no_duration_is_refused(ttl, autojump_clock):
    agent, _ = make([say("hi")])
    store = MemoryStore(clock=store_now)
    with pytest.raises(treadle.UsageError, match="TTL"):
        await treadle.run(agent, "x", store=store, run_id="r", lease_ttl_s=ttl)
    assert await store.list_runs() == ()
    assert agent.model.requests == []


# --------------------------------------------------------------------------- drain


async def test_drain_stops_between_steps_and_lets_go_of_the_lease(autojump_clock):
    agent, tools = make(
        [call("sleep", s=10, call_id="c1"), call("sleep", s=10, call_id="c2"), say("done")]
    )
    store = MemoryStore(clock=store_now)
    async with open_run(agent, "x", store=store, run_id="r", owner="a") as handle:
        await trio.sleep(3)  # in the first tool call
        handle.drain()
        with pytest.raises(treadle.RunInterrupted, match="drained"):
            await handle.wait()
        assert trio.current_time() == pytest.approx(10, abs=0.5)  # after the step, not at once
    assert handle.left == "drained"
    # Nothing here drives it: a cancel through this handle is refused, not dropped.
    with pytest.raises(treadle.UsageError, match=r"not driven here any more \(drained\)"):
        handle.cancel("too late")
    assert [a.call_id for a in tools.executed] == ["c1"]  # the step finished, none began after
    log = await store.read_log("r")
    assert log.finished is None and len(log.steps) == 1
    lease = await store.read_lease("r")
    assert lease.owner == "" and lease.generation == 1
    assert (await store.read_summary("r")).liveness is Liveness.ORPHANED
    result = await treadle.run(agent, store=store, run_id="r", owner="b")
    assert result.stop_reason is StopReason.FINAL_ANSWER
    assert [a.call_id for a in tools.executed] == ["c1", "c2"]


async def test_drain_while_waiting_on_a_human_stops_at_once(autojump_clock):
    agent, tools = make([call("add", a=1, b=2, call_id="c1"), say("3")])
    store = MemoryStore(clock=store_now)
    async with open_run(
        agent, "x", store=store, run_id="r", owner="a", approval_policy=only_add, park_after_s=None
    ) as handle:
        await trio.sleep(3)
        assert handle.state is RunState.AWAITING_APPROVAL
        drained_at = trio.current_time()
        handle.drain()
        with pytest.raises(treadle.RunInterrupted):
            await handle.wait()
        assert trio.current_time() - drained_at < 1
    assert handle.left == "parked"
    assert tools.executed == []
    assert (await store.read_lease("r")).owner == ""
    assert (await store.read_summary("r")).liveness is Liveness.PARKED
    await decide(store, "r", clock=VirtualClock())
    result = await treadle.run(agent, store=store, run_id="r", owner="b", approval_policy=only_add)
    assert result.stop_reason is StopReason.FINAL_ANSWER
    assert len(tools.executed) == 1


async def test_drain_of_a_parked_run_ends_its_wait(autojump_clock):
    agent, _tools = make([call("add", a=1, b=2, call_id="c1"), say("3")])
    store = MemoryStore(clock=store_now)
    async with open_run(
        agent, "x", store=store, run_id="r", owner="a", approval_policy=only_add, park_after_s=5
    ) as handle:
        await parked(handle)
        handle.drain()
        with trio.fail_after(1), pytest.raises(treadle.RunInterrupted):
            await handle.wait()
    assert handle.left == "parked"
    assert (await store.read_summary("r")).liveness is Liveness.PARKED


@pytest.mark.parametrize("where", ["driven", "parked"])
@pytest.mark.parametrize("order", ["drain first", "decision first"])
@pytest.mark.parametrize("decision", ["approve", "cancel"])
async def test_a_decision_or_cancel_sent_with_a_drain_is_kept(
    where, order, decision, autojump_clock
):
    """A drain and a decision (or cancel) in the same turn: the drain lets the run go, and
    the decision is not lost with it: it is applied before the run stops, or made durable in
    the control stream for whoever drives the run next."""
    from tests.fixtures.approval_waits import wait_for_state

    agent, tools = make([call("add", a=1, b=2, call_id="c1"), say("3")])
    store = MemoryStore(clock=store_now)
    park_after_s = 5.0 if where == "parked" else None
    async with open_run(
        agent,
        "x",
        store=store,
        run_id="r",
        owner="a",
        approval_policy=only_add,
        park_after_s=park_after_s,
    ) as handle:
        if where == "parked":
            await parked(handle)
        else:
            await wait_for_state(handle, RunState.AWAITING_APPROVAL)
        decide_here = handle.approve if decision == "approve" else handle.cancel
        if order == "drain first":
            handle.drain()
            decide_here()
        else:
            decide_here()
            handle.drain()
        with trio.fail_after(60):
            try:
                first = await handle.wait()
            except treadle.RunInterrupted:
                first = None
    if first is None:  # let go unfinished: the next driver applies what was decided
        result = await treadle.run(
            agent, store=store, run_id="r", owner="b", approval_policy=only_add
        )
    else:
        result = first
    expected = StopReason.FINAL_ANSWER if decision == "approve" else StopReason.CANCELLED
    assert result.stop_reason is expected
    assert len(tools.executed) == (1 if decision == "approve" else 0)
    assert check_invariants(await store.read_log("r")) == []


# --------------------------------------------------------------------------- parking


@pytest.mark.parametrize("kind", ["memory", "sqlite", "jsonl"])
@pytest.mark.parametrize("via", ["handle", "control stream"])
async def test_a_parked_run_releases_its_lease_and_takes_it_again(
    kind, via, tmp_path, autojump_clock
):
    agent, tools = make([call("add", a=1, b=2, call_id="c1"), say("3")])
    async with opened_store(kind, tmp_path) as store:
        async with open_run(
            agent,
            "x",
            store=store,
            run_id="r",
            owner="a",
            approval_policy=only_add,
            # Not at a renewal instant (every 5 s): a JSONL release racing a renewal fails,
            # see test_a_jsonl_lease_renewed_and_released_at_once_raises_nothing.
            park_after_s=6,
            control_poll_s=0.5,
            clock=VirtualClock(),
        ) as handle:
            await parked(handle)
            await until_released(store, "r")
            lease = await store.read_lease("r")
            assert lease is not None and lease.owner == "" and lease.generation == 1
            summary = await store.read_summary("r")
            assert summary.liveness is Liveness.PARKED
            records_parked = len((await store.read_log("r")).records)
            await trio.sleep(10)
            if via == "handle":
                handle.approve("c1")
            else:
                await decide(store, "r", call_id="c1", clock=VirtualClock())
            with trio.fail_after(5):
                result = await handle.wait()
        lease = await store.read_lease("r")
        gens = await generations(kind, store, tmp_path, "r")
        log = await store.read_log("r")
    assert result.stop_reason is StopReason.FINAL_ANSWER
    assert [a.call_id for a in tools.executed] == ["c1"]
    assert lease.generation == 2 and lease.owner == ""
    if gens is not None:
        assert gens == [1] * records_parked + [2] * (len(log.records) - records_parked)
    decided = [r for r in log.records if isinstance(r, ApprovalDecided)]
    assert len(decided) == 1 and decided[0].decision == "approve"
    assert check_approvals(log) == []


async def test_an_in_process_decision_is_durable_before_the_run_is_driven_again(autojump_clock):
    agent, tools = make([call("add", a=1, b=2, call_id="c1"), say("3")])
    store = Recording(MemoryStore(clock=store_now))
    async with open_run(
        agent, "x", store=store, run_id="r", owner="a", approval_policy=only_add, park_after_s=5
    ) as handle:
        await parked(handle)
        decided = handle.approve("c1")
        await handle.wait()
    kinds = [op for op, _ in store.ops]
    assert kinds == ["acquire", "release", "control", "acquire", "release"]
    (control,) = [value for op, value in store.ops if op == "control"]
    assert control == decided
    entries = await store.read_control("r")
    assert [e.record for e in entries] == [decided]
    assert len(tools.executed) == 1


async def test_a_decision_made_here_survives_a_crash_before_the_run_is_driven_again(
    autojump_clock,
):
    """The decision is in the control stream; a later driver applies it after a crash."""
    agent, tools = make([call("add", a=1, b=2, call_id="c1"), say("3")])
    inner = MemoryStore(clock=store_now)
    store = DiesAtReacquire(inner)
    async with open_run(
        agent, "x", store=store, run_id="r", owner="a", approval_policy=only_add, park_after_s=5
    ) as handle:
        await parked(handle)
        handle.approve("c1", edit={"a": 5, "b": 5})
        with pytest.raises((SimulatedCrash, treadle.RunInterrupted)):
            await handle.wait()
    assert tools.executed == []
    result = await treadle.run(
        agent, store=inner, run_id="r", owner="b", approval_policy=only_add, park_after_s=5
    )
    assert result.stop_reason is StopReason.FINAL_ANSWER
    assert [a.arguments for a in tools.executed] == [{"a": 5, "b": 5}]


async def test_a_jsonl_lease_renewed_and_released_at_once_raises_nothing(
    tmp_path, monkeypatch, autojump_clock
):
    import os
    import time

    from treadle.testing.contracts import seed_log

    real_replace = os.replace

    def slow_replace(source, target):  # widens the window between write and rename
        time.sleep(0.05)
        real_replace(source, target)

    async with opened_store("jsonl", tmp_path) as store:
        await seed_log(
            store,
            [RunStarted(run_id="r", ts="2026-01-01T00:00:00+00:00", input=(), snapshot={})],
        )
        lease = await store.acquire_lease("r", owner="a", ttl_s=15)
        monkeypatch.setattr(os, "replace", slow_replace)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(functools.partial(store.renew_leases, [lease], ttl_s=15))
            nursery.start_soon(store.release_lease, lease)
        monkeypatch.undo()
        assert (await store.read_lease("r")).owner == ""


async def test_a_cancel_made_here_survives_a_crash_before_the_run_is_driven_again(
    autojump_clock,
):
    agent, tools = make([call("add", a=1, b=2, call_id="c1"), say("3")])
    inner = MemoryStore(clock=store_now)
    async with open_run(
        agent,
        "x",
        store=DiesAtReacquire(inner),
        run_id="r",
        owner="a",
        approval_policy=only_add,
        park_after_s=5,
    ) as handle:
        await parked(handle)
        handle.cancel("changed my mind")
        with pytest.raises((SimulatedCrash, treadle.RunInterrupted)):
            await handle.wait()
    # The next driver finds the cancel and finishes the run cancelled, without the call.
    with trio.fail_after(60):
        result = await treadle.run(
            agent, store=inner, run_id="r", owner="b", approval_policy=only_add, park_after_s=5
        )
    assert result.state is RunState.CANCELLED
    assert tools.executed == []


# --------------------------------------------------------------------------- run ids


BAD_IDS = ["", "#", "a b", "run\ud800", "x" * 201]


@pytest.mark.parametrize("run_id", BAD_IDS, ids=["empty", "hash", "space", "surrogate", "long"])
async def test_invalid_run_ids_are_refused_before_anything_is_written(run_id, autojump_clock):
    agent, _tools = make([say("hi")])
    store = MemoryStore(clock=store_now)
    with pytest.raises(InvalidRunId) as refused:
        async with open_run(agent, "x", store=store, run_id=run_id):
            pytest.fail("the run was opened")
    assert refused.value.run_id == run_id
    with pytest.raises(InvalidRunId):
        await treadle.run(agent, "x", store=store, run_id=run_id)
    assert await store.list_runs() == ()
    assert await store.list_summaries() == ()
    assert agent.model.requests == []


async def test_the_longest_allowed_run_id_is_accepted(autojump_clock):
    agent, _ = make([say("hi")])
    store = MemoryStore(clock=store_now)
    run_id = "x" * 200
    result = await treadle.run(agent, "x", store=store, run_id=run_id)
    assert result.final_answer == "hi"
    assert await store.list_runs() == (run_id,)


# --------------------------------------------------------------------------- finish_cancelled


def check_every_intent_has_one_unknown_result(log) -> None:
    intents = [r for r in log.records if isinstance(r, ActionIntent)]
    results = [r for r in log.records if isinstance(r, ActionResult)]
    assert intents
    for intent in intents:
        mine = [r for r in results if r.intent_id == intent.intent_id]
        assert len(mine) == 1, intent.intent_id
    assert {r.outcome.status for r in results} <= {ActionStatus.UNKNOWN, ActionStatus.EXECUTED}


@pytest.mark.parametrize("when", ["before", "after"])
async def test_a_run_crashed_in_a_never_policy_action_is_finished_cancelled(when, autojump_clock):
    inner = MemoryStore(clock=store_now)
    crashing = CrashingStore(inner=inner, crash_at=10**6)
    tools = LedgerTools()
    executor = CrashingExecutor(inner=tools, crash_at=1, when=when, store=crashing)
    agent, _ = make([call("add", a=1, b=2, call_id="c1"), say("3")], tools=executor)
    with pytest.raises((SimulatedCrash, treadle.RunInterrupted)):
        await treadle.run(agent, "x", store=crashing, run_id="r", owner="dead")
    assert (await inner.read_log("r")).finished is None
    result = await finish_cancelled(inner, "r", owner="canceller", reason="nobody drives it")
    assert result.state is RunState.CANCELLED and result.stop_reason is StopReason.CANCELLED
    log = await inner.read_log("r")
    (intent,) = [r for r in log.records if isinstance(r, ActionIntent)]
    (outcome,) = [r for r in log.records if isinstance(r, ActionResult)]
    assert outcome.intent_id == intent.intent_id
    assert outcome.outcome.status is ActionStatus.UNKNOWN
    assert outcome.outcome.observation_is_synthetic
    assert check_invariants(log) == []
    assert isinstance(log.records[-1], RunFinished) and isinstance(log.records[-2], CancelRequested)
    assert log.records[-2].reason == "nobody drives it"
    lease = await inner.read_lease("r")
    assert lease.owner == ""
    summary = await inner.read_summary("r")
    assert summary.liveness is Liveness.FINISHED and summary.state is RunState.CANCELLED


async def test_a_run_crashed_in_a_parallel_batch_gets_a_result_for_every_intent(autojump_clock):
    inner = MemoryStore(clock=store_now)
    crashing = CrashingStore(inner=inner, crash_at=10**6)
    tools = LedgerTools()
    executor = CrashingExecutor(inner=tools, crash_at=2, when="after", store=crashing)
    batch = calls(
        ToolCall(id="c1", name="add", arguments={"a": 1, "b": 1}),
        ToolCall(id="c2", name="sleep", arguments={"s": 5}),
        ToolCall(id="c3", name="add", arguments={"a": 3, "b": 3}),
    )
    agent, _ = make([batch, say("ok")], tools=executor)
    with pytest.raises((SimulatedCrash, treadle.RunInterrupted)):
        await treadle.run(agent, "x", store=crashing, run_id="r", owner="dead")
    result = await finish_cancelled(inner, "r", owner="canceller")
    assert result.state is RunState.CANCELLED
    log = await inner.read_log("r")
    assert len([r for r in log.records if isinstance(r, ActionIntent)]) == 3
    check_every_intent_has_one_unknown_result(log)
    assert check_invariants(log) == []


async def test_a_run_crashed_during_its_model_call_is_finished_cancelled(autojump_clock):
    inner = MemoryStore(clock=store_now)
    # Writes: run-started, model intent (a barrier), then the crash before the result.
    crashing = CrashingStore(inner=inner, crash_at=3, when="before")
    agent, _ = make([say("hello")])
    with pytest.raises((SimulatedCrash, treadle.RunInterrupted)):
        await treadle.run(agent, "x", store=crashing, run_id="r", owner="dead")
    await request_cancel(inner, "r", reason="from the console", canceller="ops")
    result = await finish_cancelled(inner, "r", owner="canceller", reason="ignored")
    assert result.state is RunState.CANCELLED
    log = await inner.read_log("r")
    (abandoned,) = [r for r in log.records if isinstance(r, ModelResult)]
    assert abandoned.abandoned
    (cancel,) = [r for r in log.records if isinstance(r, CancelRequested)]
    assert (cancel.reason, cancel.canceller) == ("from the console", "ops")
    assert check_invariants(log) == []


async def test_a_queued_run_that_never_started_is_finished_cancelled(autojump_clock):
    store = MemoryStore(clock=store_now)
    task = (Message(role="user", content="do it"),)
    await store.submit("q", agent="calc", input=task)
    result = await finish_cancelled(store, "q", owner="canceller", canceller="ops")
    assert result.state is RunState.CANCELLED and result.stop_reason is StopReason.CANCELLED
    log = await store.read_log("q")
    assert isinstance(log.records[0], RunStarted) and log.records[0].input == task
    assert isinstance(log.records[-1], RunFinished)
    assert check_invariants(log) == []
    summary = await store.read_summary("q")
    assert summary.liveness is Liveness.FINISHED and summary.state is RunState.CANCELLED
    # Nobody claims it any more.
    claims = await store.claim(
        owner="w", agents={"calc": ("v1",)}, limit=5, ttl_s=10, max_takeovers=5, backoff_s=0
    )
    assert claims == ()


async def test_a_parked_run_nobody_drives_is_finished_cancelled(autojump_clock):
    store = MemoryStore(clock=store_now)
    agent, tools = make([call("add", a=1, b=2, call_id="c1"), say("3")])
    with trio.CancelScope() as gone:
        async with open_run(
            agent, "x", store=store, run_id="r", approval_policy=only_add, park_after_s=5
        ) as handle:
            await parked(handle)
            gone.cancel()  # the process goes away while the run is parked
    assert (await store.read_summary("r")).liveness is Liveness.PARKED
    result = await finish_cancelled(store, "r", owner="canceller")
    assert result.state is RunState.CANCELLED
    log = await store.read_log("r")
    assert not any(isinstance(r, ActionIntent) for r in log.records)
    assert check_invariants(log) == []
    assert tools.executed == []
    # A decision that arrives now changes nothing: the run is finished.
    with pytest.raises(treadle.UsageError, match="already finished"):
        await decide(store, "r", clock=VirtualClock())


async def test_finish_cancelled_refuses_a_driven_run(autojump_clock):
    store = MemoryStore(clock=store_now)
    agent, _tools = make([call("sleep", s=30, call_id="c1"), say("done")])
    async with open_run(agent, "x", store=store, run_id="r", owner="driver") as handle:
        await trio.sleep(2)
        with pytest.raises(RunLeased, match="driver"):
            await finish_cancelled(store, "r", owner="canceller")
        handle.cancel("stop")
        result = await handle.wait()
    assert result.state is RunState.CANCELLED


async def test_finish_cancelled_on_a_finished_run_returns_its_result(autojump_clock):
    store = MemoryStore(clock=store_now)
    agent, _ = make([say("hi")])
    await treadle.run(agent, "x", store=store, run_id="r")
    before = (await store.read_log("r")).records
    result = await finish_cancelled(store, "r", owner="canceller")
    assert result.state is RunState.SUCCEEDED and result.final_answer == "hi"
    assert (await store.read_log("r")).records == before


async def test_a_run_finished_cancelled_is_not_resumed(autojump_clock):
    inner = MemoryStore(clock=store_now)
    crashing = CrashingStore(inner=inner, crash_at=10**6)
    tools = LedgerTools()
    executor = CrashingExecutor(inner=tools, crash_at=1, when="before", store=crashing)
    agent, _ = make([call("add", a=1, b=2, call_id="c1"), say("3")], tools=executor)
    with pytest.raises((SimulatedCrash, treadle.RunInterrupted)):
        await treadle.run(agent, "x", store=crashing, run_id="r")
    await finish_cancelled(inner, "r", owner="canceller")
    agent2, tools2 = make([call("add", a=1, b=2, call_id="c1"), say("3")])
    result = await treadle.run(agent2, store=inner, run_id="r")
    assert result.state is RunState.CANCELLED
    assert tools2.executed == []


# --------------------------------------------------------------------------- PostgreSQL (real time)


def postgres_generations(dsn: str, schema: str, run_id: str) -> list[int]:
    import psycopg

    with psycopg.connect(dsn) as conn:
        rows = conn.execute(
            f"SELECT seq, gen FROM {schema}.records WHERE run_id = %s ORDER BY seq", (run_id,)
        ).fetchall()
    assert [seq for seq, _ in rows] == list(range(1, len(rows) + 1))
    return [gen for _, gen in rows]


async def test_postgres_one_driver_at_a_time_and_a_fenced_takeover(postgres_dsn, postgres_schema):
    """The same story on PostgreSQL, whose own clock judges the leases (so: real seconds)."""
    from treadle.stores.postgres import open_postgres_store

    agent, tools = make([call("sleep", s=3, call_id="c1"), say("done")])
    with trio.fail_after(60):
        async with open_postgres_store(postgres_dsn, schema=postgres_schema) as raw:
            store = FrozenRenewals(raw)
            async with open_run(
                agent, "x", store=store, run_id="r", owner="a", lease_ttl_s=1
            ) as handle:
                while not tools.executed:  # noqa: ASYNC110 (a plain attribute)
                    await trio.sleep(0.05)
                with pytest.raises(RunLeased, match="is driven by a "):
                    await treadle.run(agent, "x", store=raw, run_id="r", owner="b")
                store.frozen = True
                while True:  # until the lease lapsed by the server's clock
                    try:
                        taken = await raw.acquire_lease("r", owner="b", ttl_s=600)
                        break
                    except RunLeased:
                        await trio.sleep(0.1)
                at_takeover = len((await raw.read_log("r")).records)
                with pytest.raises(LeaseLost):
                    await handle.wait()
            assert taken.generation == 2
            assert len((await raw.read_log("r")).records) == at_takeover
            assert await raw.read_lease("r") == taken
        async with open_postgres_store(postgres_dsn, schema=postgres_schema) as other:
            result = await treadle.run(agent, store=other, run_id="r", owner="b")
            assert (await other.read_lease("r")).owner == ""
    assert result.stop_reason is StopReason.FINAL_ANSWER
    gens = postgres_generations(postgres_dsn, postgres_schema, "r")
    assert gens[:at_takeover] == [1] * at_takeover and set(gens[at_takeover:]) == {2}


async def test_postgres_the_same_store_object_drives_a_run_again_after_a_fenced_driver(
    postgres_dsn, postgres_schema
):
    from treadle.stores.postgres import open_postgres_store

    agent, tools = make([call("sleep", s=3, call_id="c1"), say("done")])
    with trio.fail_after(60):
        async with open_postgres_store(postgres_dsn, schema=postgres_schema) as raw:
            store = FrozenRenewals(raw)
            async with open_run(
                agent, "x", store=store, run_id="r", owner="a", lease_ttl_s=1
            ) as handle:
                while not tools.executed:  # noqa: ASYNC110 (a plain attribute)
                    await trio.sleep(0.05)
                store.frozen = True
                while True:
                    try:
                        await raw.acquire_lease("r", owner="b", ttl_s=600)
                        break
                    except RunLeased:
                        await trio.sleep(0.1)
                with pytest.raises(LeaseLost):
                    await handle.wait()
            result = await treadle.run(agent, store=raw, run_id="r", owner="b")
    assert result.stop_reason is StopReason.FINAL_ANSWER


async def test_postgres_a_paused_drivers_call_is_refused_by_its_fencing_generation(
    postgres_dsn, postgres_schema
):
    from treadle.stores.postgres import open_postgres_store

    pay = FencedPay()
    with trio.fail_after(120):
        async with open_postgres_store(postgres_dsn, schema=postgres_schema) as raw:
            log = await a_paused_call_after_a_takeover(
                raw,
                functools.partial(open_postgres_store, postgres_dsn, schema=postgres_schema),
                pay,
            )
    check_the_stale_call_was_refused(log, pay)
    gens = postgres_generations(postgres_dsn, postgres_schema, "r")
    assert gens[-1] == 2


@pytest.mark.parametrize(
    ("current", "said"),
    [
        # a lease that lapsed while a lock held the driver's renewals was said "released"
        (
            1,
            "nobody took the run over (the store holds generation 1), but the lease is no "
            "longer this driver's: it expired before this driver could renew it, or it was "
            "released or given another owner",
        ),
        (2, "the store holds generation 2; another driver took the run over"),
        (None, "the store holds no lease; another driver took the run over"),
    ],
)
def test_a_lost_lease_says_why_without_contradicting_itself(current, said):
    # Lost at the same generation (released, or taken again by the same owner id), the
    # message said "generation 1 was lost, the store holds generation 1; another driver
    # took the run over".
    message = str(LeaseLost("r", generation=1, current=current))
    assert said in message and message.startswith("run 'r': this driver's lease (generation 1)")


class _ReleaseFails(MemoryStore):
    """A store whose lease releases fail (a row kept locked past the store's wait)."""

    releases: list[str] = []

    async def release_lease(self, lease, **more):  # type: ignore[no-untyped-def]
        self.releases.append(lease.run_id)
        raise treadle.StoreError("another transaction kept a lock this needs")


async def test_a_release_that_failed_is_not_tried_again_on_the_way_out(monkeypatch, caplog):
    """Both the drive and the fleet's cleanup released the lease of a failed run: under a
    row lock each waited out the store's lock wait, and the failure was logged twice."""
    from treadle.supervisors._leasing import LeaseHold

    monkeypatch.setattr(_ReleaseFails, "releases", [])
    store = _ReleaseFails()
    hold = LeaseHold(run_id="r", owner="w", ttl_s=60, store=store)
    await hold.acquire()
    await hold.release_quietly()
    await hold.release_quietly()  # on the way out again: nothing left to release
    assert store.releases == ["r"]
    assert caplog.text.count("the lease was not released") == 1
    assert hold.lease is None


def test_only_a_cancels_owner_form_is_taken_for_a_cancel():
    """`finishes_cancel` matched any owner whose last part started with ``cancel-``."""
    from treadle.stores import finishes_cancel, lease_owner

    assert finishes_cancel(lease_owner(cancelling=True))
    assert not finishes_cancel(lease_owner())
    assert finishes_cancel("host:12:cancel-0123abcd")
    for driver in ("cancel-x", "host:12:cancel-batch", "ops:cancel-0123abcde", "cancel-0123ABCD"):
        assert not finishes_cancel(driver), driver


async def test_a_driver_owner_of_a_cancels_form_is_refused_where_it_is_given():
    """A driver given ``owner="...:cancel-0123abcd"`` was said by ``treadle runs``, ``approve``
    and the console to be a cancel finishing the run ("the decision is not applied"), though
    it drove the run and applied the decision."""
    owner = "ops:1:cancel-0123abcd"
    agent, _ = make([say("done")])
    store = MemoryStore()
    with pytest.raises(treadle.UsageError, match="form of a cancel's lease owner"):
        async with open_run(agent, "x", store=store, run_id="r", owner=owner):
            pass
    with pytest.raises(treadle.UsageError, match="form of a cancel's lease owner"):
        treadle.agent_tool(agent, store=store, name="ask", description="Asks.", owner=owner)
    with pytest.raises(treadle.UsageError, match="form of a cancel's lease owner"):
        async with treadle.open_fleet(store, {"a": agent}, owner=owner):
            pass
    assert (await store.read_log("r")).records == ()  # nothing was written
