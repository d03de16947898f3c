"""Contract suites for the store capabilities: leases, control streams, run index, queue.

Each capability protocol of `treadle.ports` has its own suite, run by our tests against every
store that implements it, and usable for your own store::

    await check_lease_store(open_store, clock=FakeClock(...))
    await check_control_stream(open_store, persistent=True)
    await check_run_index(open_store)
    await check_run_queue(open_store, clock=FakeClock(...))

``open_store`` opens the store under test (`treadle.testing.contracts.StoreOpener`). Checks
that need time to pass take a `ContractClock`: its ``advance`` moves the store's clock (a fake
clock the store was opened with) or, for a store with a clock of its own (PostgreSQL), sleeps.
A store whose leases are OS locks (JSONL) has no expiry to check: pass ``clock=None``.
Every check raises `treadle.testing.contracts.StoreContractError` naming itself.
"""

from __future__ import annotations

import secrets
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Final, Protocol

import attrs
import trio

from treadle._exceptions import InvalidRunId, LeaseLost, RunLeased, TreadleError, UsageError
from treadle.ports import ControlStream, LeaseStore, RunCounts, RunIndex, RunQueue, RunStore
from treadle.testing.contracts import (
    CHECK_TIMEOUT_S,
    StoreContractError,
    StoreOpener,
    every_write,
    seed_log,
)
from treadle.types import (
    ApprovalDecided,
    ApprovalRequested,
    CancelRequested,
    ChildrenAwaited,
    Claim,
    ControlRecord,
    Liveness,
    Message,
    ModelIntent,
    Record,
    RunFinished,
    RunStarted,
    RunState,
    StepRecord,
    StopReason,
    StoreOp,
    Totals,
)

__all__ = [
    "ContractClock",
    "FakeClock",
    "SleepingClock",
    "check_control_stream",
    "check_lease_store",
    "check_run_index",
    "check_run_queue",
]

_TS: Final = "2025-01-01T00:00:00+00:00"
_LONG: Final = 600.0


class ContractClock(Protocol):
    """Moves the store's clock forward for the checks that need a lease to expire."""

    async def advance(self, seconds: float) -> None:
        """Let ``seconds`` pass on the store's clock."""
        ...


@attrs.define(eq=False)
class FakeClock:
    """A store clock the checks move by hand; pass ``clock.now`` to the store as its clock.

    Attributes:
        at: the current instant (epoch seconds).
    """

    at: float = 1_800_000_000.0

    def now(self) -> float:
        """The current instant."""
        return self.at

    async def advance(self, seconds: float) -> None:
        """Move forward ``seconds``."""
        self.at += seconds
        await trio.lowlevel.checkpoint()


@attrs.define(eq=False)
class SleepingClock:
    """For a store with a clock of its own (PostgreSQL): let real time pass."""

    async def advance(self, seconds: float) -> None:
        """Sleep ``seconds`` (plus a little, for the server's clock to be past the instant)."""
        await trio.sleep(seconds + 0.05)


def _expect(condition: bool, check: str, message: str) -> None:
    if not condition:
        raise StoreContractError(f"[{check}] {message}")


def _run_id(label: str) -> str:
    return f"{label}-{secrets.token_hex(6)}"


def _started(run_id: str, *, agent: str | None = None, version: str | None = None) -> RunStarted:
    return RunStarted(
        run_id=run_id,
        ts=_TS,
        input=(Message(role="user", content="hello"),),
        snapshot={},
        agent=agent,
        agent_version=version,
    )


async def _raises(kind: type[BaseException], attempt: Awaitable[object]) -> BaseException | None:
    try:
        await attempt
    except kind as exc:
        return exc
    return None


Check = Callable[[StoreOpener, ContractClock | None], Awaitable[None]]


async def _run_checks(
    checks: tuple[tuple[str, Check, bool], ...],
    open_store: StoreOpener,
    clock: ContractClock | None,
) -> None:
    for _name, check, needs_clock in checks:
        if needs_clock and clock is None:
            continue
        with trio.fail_after(CHECK_TIMEOUT_S):
            await check(open_store, clock)


# --------------------------------------------------------------------------- leases


def _leases(store: RunStore, check: str) -> LeaseStore:
    _expect(isinstance(store, LeaseStore), check, f"{type(store).__name__} is no LeaseStore")
    assert isinstance(store, LeaseStore)
    return store


async def _lease_first_and_renewal(open_store: StoreOpener, clock: ContractClock | None) -> None:
    check = "lease_first_and_renewal"
    async with open_store() as store:
        leases = _leases(store, check)
        run_id = _run_id("lease")
        _expect(await leases.read_lease(run_id) is None, check, "a new run has a lease")
        first = await leases.acquire_lease(run_id, owner="a", ttl_s=_LONG)
        _expect(first.generation == 1 and first.owner == "a", check, f"first lease is {first}")
        _expect(first.expires_at > first.heartbeat_at, check, "the lease expires before it began")
        again = await leases.acquire_lease(run_id, owner="a", ttl_s=_LONG)
        _expect(again.generation == 1, check, "the holder acquiring again changed the generation")
        (renewed,) = await leases.renew_leases([again], ttl_s=_LONG)
        _expect(renewed.generation == 1, check, "renewal changed the generation")
        _expect(renewed.expires_at >= again.expires_at, check, "renewal shortened the lease")
        stored = await leases.read_lease(run_id)
        _expect(stored is not None and stored.owner == "a", check, f"read_lease gave {stored}")
        with trio.fail_after(CHECK_TIMEOUT_S):
            refused = await _raises(
                InvalidRunId, leases.acquire_lease("bad id", owner="a", ttl_s=1)
            )
        _expect(refused is not None, check, "a lease on an invalid run id was granted")


async def _lease_other_owner_refused(open_store: StoreOpener, clock: ContractClock | None) -> None:
    check = "lease_other_owner_refused"
    async with open_store() as store:
        leases = _leases(store, check)
        run_id = _run_id("held")
        await leases.acquire_lease(run_id, owner="a", ttl_s=_LONG)
        error = await _raises(RunLeased, leases.acquire_lease(run_id, owner="b", ttl_s=_LONG))
        _expect(error is not None, check, "a second owner got a live lease")
        assert isinstance(error, RunLeased)
        _expect(error.holder.owner == "a", check, f"RunLeased names {error.holder.owner!r}")
        _expect("a" in str(error), check, "the message does not name the holder")


async def _refused(write: Awaitable[None], check: str, what: str) -> bool:
    """Whether ``write`` raised `LeaseLost` (``False``: it returned).

    Raises:
        StoreContractError: it raised anything else.
    """
    try:
        return await _raises(LeaseLost, write) is not None
    except Exception as exc:  # any other failure breaks the contract
        raise StoreContractError(
            f"[{check}] {what} raised {type(exc).__name__}: {exc}, not LeaseLost"
        ) from exc


async def _every_write_refused(
    store: RunStore, run_id: str, *, generation: int, check: str, why: str
) -> None:
    """Each of the six writes with ``generation`` is refused with `LeaseLost`, the log unchanged.

    docs/seams.md, "Run store": a write whose generation is not the current one raises
    `LeaseLost` and changes nothing. A write that is no barrier may return before the store
    checked it; its refusal then surfaces from the writer's next write, a barrier here.

    Raises:
        StoreContractError: a write was accepted, failed otherwise, or changed the log.
    """
    before = (await store.read_log(run_id)).records
    seq = len(before) + 1
    for name, write in every_write(store, run_id, seq=seq, generation=generation):
        what = f"{name} {why}"
        refused = await _refused(write(), check, what)
        if not refused and not StoreOp(name.removeprefix("write_")).barrier:
            then = dict(every_write(store, run_id, seq=seq + 1, generation=generation))
            refused = await _refused(then["write_intent"](), check, f"the intent after {what}")
        _expect(refused, check, f"{what} was accepted")
        after = (await store.read_log(run_id)).records
        _expect(after == before, check, f"{what} changed the log")


async def _lease_fencing(open_store: StoreOpener, clock: ContractClock | None) -> None:
    check = "lease_fencing"
    async with open_store() as store:
        leases = _leases(store, check)
        run_id, other = _run_id("fenced"), _run_id("bystander")
        old = await leases.acquire_lease(run_id, owner="a", ttl_s=_LONG)
        await store.write_run_started(_started(run_id), seq=1, generation=old.generation)
        await leases.release_lease(old)
        new = await leases.acquire_lease(run_id, owner="b", ttl_s=_LONG)
        _expect(new.generation == old.generation + 1, check, f"takeover gave {new.generation}")
        ok = await leases.acquire_lease(other, owner="c", ttl_s=_LONG)
        intent = ModelIntent(run_id=run_id, step=1, intent_id="m", attempt=1, ts=_TS)
        stale: list[BaseException | None] = []

        async def write_stale() -> None:
            stale.append(
                await _raises(
                    LeaseLost, store.write_intent(intent, seq=2, generation=old.generation)
                )
            )

        async with trio.open_nursery() as nursery:  # the stale write shares a batch with others
            nursery.start_soon(write_stale)
            nursery.start_soon(
                lambda: store.write_run_started(_started(other), seq=1, generation=ok.generation)
            )
        _expect(stale[0] is not None, check, "a write of the old generation was accepted")
        log = await store.read_log(run_id)
        _expect(len(log.records) == 1, check, "a refused write is in the log")
        bystander = await store.read_log(other)
        _expect(len(bystander.records) == 1, check, "another run's write failed beside a stale one")
        await _every_write_refused(
            store, run_id, generation=old.generation, check=check, why="of the old generation"
        )


async def _lease_required(open_store: StoreOpener, clock: ContractClock | None) -> None:
    check = "lease_required"
    async with open_store() as store:
        run_id = _run_id("unleased")
        await _every_write_refused(
            store, run_id, generation=1, check=check, why="of a run without a lease"
        )


async def _lease_lost_renewal(open_store: StoreOpener, clock: ContractClock | None) -> None:
    check = "lease_lost_renewal"
    async with open_store() as store:
        leases = _leases(store, check)
        run_id, kept = _run_id("lost"), _run_id("kept")
        old = await leases.acquire_lease(run_id, owner="a", ttl_s=_LONG)
        mine = await leases.acquire_lease(kept, owner="a", ttl_s=_LONG)
        await leases.release_lease(old)
        await leases.acquire_lease(run_id, owner="b", ttl_s=_LONG)
        renewed = await leases.renew_leases([old, mine], ttl_s=_LONG)
        _expect([r.run_id for r in renewed] == [kept], check, f"renewal kept {renewed}")
        await leases.release_lease(old)  # not held: leaves b's lease alone
        current = await leases.read_lease(run_id)
        _expect(current is not None and current.owner == "b", check, "a lost lease was released")


async def _lease_expiry(open_store: StoreOpener, clock: ContractClock | None) -> None:
    check = "lease_expiry"
    assert clock is not None
    async with open_store() as store:
        leases = _leases(store, check)
        run_id = _run_id("expiring")
        first = await leases.acquire_lease(run_id, owner="a", ttl_s=1.0)
        await clock.advance(1.5)
        taken = await leases.acquire_lease(run_id, owner="b", ttl_s=_LONG)
        _expect(taken.generation == first.generation + 1, check, f"takeover gave {taken}")
        renewed = await leases.renew_leases([first], ttl_s=_LONG)
        _expect(renewed == (), check, "the expired holder renewed after a takeover")
        await _every_write_refused(
            store,
            run_id,
            generation=first.generation,
            check=check,
            why="of the expired holder after the takeover",
        )


LEASE_CHECKS: Final[tuple[tuple[str, Check, bool], ...]] = (
    ("lease_first_and_renewal", _lease_first_and_renewal, False),
    ("lease_other_owner_refused", _lease_other_owner_refused, False),
    ("lease_fencing", _lease_fencing, False),
    ("lease_required", _lease_required, False),
    ("lease_lost_renewal", _lease_lost_renewal, False),
    ("lease_expiry", _lease_expiry, True),
)
"""The lease contract: ``(name, check, needs a clock)``."""


async def check_lease_store(open_store: StoreOpener, *, clock: ContractClock | None) -> None:
    """Hold a `LeaseStore` to its contract (docs/fleet.md, "Leases").

    Args:
        open_store: opens the store under test.
        clock: moves the store's clock; ``None`` skips the expiry check (OS-lock leases).

    Raises:
        StoreContractError: the first check the store fails, naming it.
    """
    await _run_checks(LEASE_CHECKS, open_store, clock)


# --------------------------------------------------------------------------- control streams


def _controls(store: RunStore, check: str) -> ControlStream:
    _expect(isinstance(store, ControlStream), check, f"{type(store).__name__} is no ControlStream")
    assert isinstance(store, ControlStream)
    return store


def _cancel(run_id: str, reason: str) -> CancelRequested:
    return CancelRequested(run_id=run_id, ts=_TS, reason=reason, canceller="check")


async def _control_order(open_store: StoreOpener, clock: ContractClock | None) -> None:
    check = "control_order"
    async with open_store() as store:
        controls = _controls(store, check)
        run_id = _run_id("control")
        missing = await _raises(UsageError, controls.append_control(_cancel(run_id, "x")))
        _expect(missing is not None, check, "a control entry for an unknown run was accepted")
        await seed_log(store, [_started(run_id)])
        entries = [await controls.append_control(_cancel(run_id, f"r{n}")) for n in range(3)]
        _expect([e.position for e in entries] == [1, 2, 3], check, f"positions {entries}")
        read = await controls.read_control(run_id)
        _expect(
            [e.record.reason for e in read if isinstance(e.record, CancelRequested)]
            == ["r0", "r1", "r2"],
            check,
            "entries out of order",
        )
        later = await controls.read_control(run_id, after=2)
        _expect([e.position for e in later] == [3], check, f"after=2 gave {later}")
        heads = await controls.control_heads([run_id, _run_id("none")])
        _expect(dict(heads) == {run_id: 3}, check, f"control_heads gave {heads}")
        _expect(
            sum(1 for r in await store.list_runs() if r.startswith(run_id)) == 1,
            check,
            "a control stream is listed as a run",
        )


async def _control_concurrent(open_store: StoreOpener, clock: ContractClock | None) -> None:
    check = "control_concurrent"
    async with open_store() as store:
        controls = _controls(store, check)
        run_id = _run_id("racing")
        await seed_log(store, [_started(run_id)])
        async with trio.open_nursery() as nursery:
            for n in range(20):
                nursery.start_soon(controls.append_control, _cancel(run_id, f"r{n}"))
        read = await controls.read_control(run_id)
        _expect([e.position for e in read] == list(range(1, 21)), check, "positions collide")


async def _control_durable(open_store: StoreOpener, clock: ContractClock | None) -> None:
    check = "control_durable"
    run_id = _run_id("kept")
    async with open_store() as store:
        await seed_log(store, [_started(run_id)])
        await _controls(store, check).append_control(_cancel(run_id, "kept"))
    async with open_store() as store:
        read = await _controls(store, check).read_control(run_id)
        _expect(len(read) == 1, check, "a reopened store lost a control entry")


async def check_control_stream(open_store: StoreOpener, *, persistent: bool) -> None:
    """Hold a `ControlStream` to its contract: ordered, durable, never listed as a run.

    Raises:
        StoreContractError: the first check the store fails, naming it.
    """
    with trio.fail_after(CHECK_TIMEOUT_S):
        await _control_order(open_store, None)
        await _control_concurrent(open_store, None)
        if persistent:
            await _control_durable(open_store, None)


# --------------------------------------------------------------------------- run index


def _index(store: RunStore, check: str) -> RunIndex:
    _expect(isinstance(store, RunIndex), check, f"{type(store).__name__} is no RunIndex")
    assert isinstance(store, RunIndex)
    return store


async def _summary_states(open_store: StoreOpener, clock: ContractClock | None) -> None:
    check = "summary_states"
    async with open_store() as store:
        index = _index(store, check)
        run_id = _run_id("index")
        _expect(await index.read_summary(run_id) is None, check, "an unknown run has a summary")
        request = _approval_asked(run_id, deadline_ts=_TS)
        decided = ApprovalDecided(
            run_id=run_id, step=1, call_id="c", arguments_digest="d", decision="approve", ts=_TS
        )
        step = StepRecord(run_id=run_id, step=1, ts=_TS, model_intent_id=None, decision=None)
        finished = RunFinished(
            run_id=run_id,
            ts=_TS,
            state=RunState.SUCCEEDED,
            stop_reason=StopReason.FINAL_ANSWER,
            totals=Totals(steps=1),
        )
        expected: list[tuple[Record, RunState]] = [
            (_started(run_id, agent="a", version="v1"), RunState.RUNNING),
            (request, RunState.AWAITING_APPROVAL),
            (decided, RunState.RUNNING),
            (step, RunState.RUNNING),
            (finished, RunState.SUCCEEDED),
        ]
        for record, state in expected:
            await seed_log(store, [record])
            summary = await index.read_summary(run_id)
            _expect(
                summary is not None and summary.state is state,
                check,
                f"after a {type(record).__name__}: {summary}",
            )
        assert summary is not None
        _expect(summary.liveness is Liveness.FINISHED, check, f"liveness {summary.liveness}")
        _expect(
            summary.stop_reason is StopReason.FINAL_ANSWER and summary.steps == 1,
            check,
            f"{summary}",
        )
        _expect((summary.agent, summary.agent_version) == ("a", "v1"), check, "agent not indexed")
        listed = [s.run_id for s in await index.list_summaries()]
        _expect(listed.count(run_id) == 1, check, "list_summaries does not list the run once")
        newest = [s.run_id for s in await index.list_summaries(last=1)]
        _expect(newest == listed[-1:], check, f"list_summaries(last=1) lists {newest}")
        try:  # beyond any SQL integer: every run, as any last at or above their number
            every = [s.run_id for s in await index.list_summaries(last=2**64)]
        except TreadleError as exc:
            every = [f"{type(exc).__name__}: {exc}"]
        _expect(every == listed, check, f"list_summaries(last=2**64) lists {every}")


async def _summary_liveness(open_store: StoreOpener, clock: ContractClock | None) -> None:
    check = "summary_liveness"
    async with open_store() as store:
        index, leases = _index(store, check), _leases(store, check)
        run_id = _run_id("alive")
        lease = await leases.acquire_lease(run_id, owner="driver", ttl_s=_LONG)
        await store.write_run_started(_started(run_id), seq=1, generation=lease.generation)
        summary = await index.read_summary(run_id)
        _expect(summary is not None and summary.liveness is Liveness.DRIVEN, check, f"{summary}")
        assert summary is not None and summary.lease is not None
        _expect(summary.lease.owner == "driver", check, "the summary names another driver")
        await leases.release_lease(lease)
        summary = await index.read_summary(run_id)
        _expect(summary is not None and summary.liveness is Liveness.ORPHANED, check, f"{summary}")


async def _seed_every_liveness(store: RunStore, check: str) -> None:
    """Runs finished, driven, orphaned, parked and (with a queue) queued, in ``store``."""
    leases = _leases(store, check)
    finished = _run_id("counted-finished")
    end = RunFinished(
        run_id=finished,
        ts=_TS,
        state=RunState.FAILED,
        stop_reason=StopReason.MODEL_ERROR,
        totals=Totals(),
    )
    await seed_log(store, [_started(finished), end])
    for label in ("counted-driven", "counted-orphaned"):
        run_id = _run_id(label)
        lease = await leases.acquire_lease(run_id, owner="driver", ttl_s=_LONG)
        await store.write_run_started(_started(run_id), seq=1, generation=lease.generation)
    await leases.release_lease(lease)  # the orphaned run's: its driver left it unfinished
    parked = _run_id("counted-parked")
    asked = ApprovalRequested(
        run_id=parked, step=1, call_id="c", tool="t", arguments_digest="d", ts=_TS, deadline_ts=_TS
    )
    await seed_log(store, [_started(parked), asked])
    if isinstance(store, RunQueue):
        await store.submit(_run_id("counted-queued"), agent="calc", input=_INPUT)


async def _run_counts(open_store: StoreOpener, clock: ContractClock | None) -> None:
    check = "run_counts"
    async with open_store() as store:
        if not isinstance(store, RunCounts):
            return
        await _seed_every_liveness(store, check)
        counted = {k: n for k, n in (await store.count_runs()).items() if n}
        index = _index(store, check)
        listed = Counter(summary.liveness for summary in await index.list_summaries())
        _expect(counted == dict(listed), check, f"counted {counted}, listed {dict(listed)}")
        seeded = {Liveness.FINISHED, Liveness.DRIVEN, Liveness.ORPHANED, Liveness.PARKED}
        _expect(seeded <= counted.keys(), check, f"counted {counted}")


async def check_run_index(open_store: StoreOpener) -> None:
    """Hold a `RunIndex` to its contract: states and liveness follow the log and the lease.

    A store that also counts runs (`treadle.ports.RunCounts`) counts what its summaries list.

    Raises:
        StoreContractError: the first check the store fails, naming it.
    """
    with trio.fail_after(CHECK_TIMEOUT_S):
        await _summary_states(open_store, None)
        await _summary_liveness(open_store, None)
        await _run_counts(open_store, None)


# --------------------------------------------------------------------------- the queue


def _queue(store: RunStore, check: str) -> RunQueue:
    _expect(isinstance(store, RunQueue), check, f"{type(store).__name__} is no RunQueue")
    assert isinstance(store, RunQueue)
    return store


_INPUT: Final = (Message(role="user", content="q"),)


async def _queue_submit(open_store: StoreOpener, clock: ContractClock | None) -> None:
    check = "queue_submit"
    async with open_store() as store:
        queue = _queue(store, check)
        run_id = _run_id("queued")
        first = await queue.submit(run_id, agent="calc", input=_INPUT)
        again = await queue.submit(run_id, agent="calc", input=_INPUT)
        _expect(again == first, check, "submitting again changed the submission")
        other = await _raises(
            UsageError,
            queue.submit(run_id, agent="calc", input=(Message(role="user", content="other"),)),
        )
        _expect(other is not None, check, "the same run id was submitted with another input")
        summary = await _index(store, check).read_summary(run_id)
        _expect(summary is not None and summary.state is RunState.QUEUED, check, f"{summary}")
        assert summary is not None
        _expect(summary.liveness is Liveness.QUEUED, check, f"liveness {summary.liveness}")
        _expect(await queue.read_submission(run_id) == first, check, "read_submission differs")


async def _queue_claims(open_store: StoreOpener, clock: ContractClock | None) -> None:
    check = "queue_claims"
    async with open_store() as store:
        queue = _queue(store, check)
        agent = _run_id("agent")
        ids = [_run_id("job") for _ in range(3)]
        for run_id in ids:
            await queue.submit(run_id, agent=agent, input=_INPUT)
        await queue.submit(_run_id("elsewhere"), agent=agent + "-other", input=_INPUT)
        served = {agent: ("v1",)}
        first = await queue.claim(
            owner="w1", agents=served, limit=2, ttl_s=_LONG, max_takeovers=3, backoff_s=0
        )
        _expect([c.lease.run_id for c in first] == ids[:2], check, f"claimed {first}")
        _expect(
            all(c.lease.generation == 1 and c.submission is not None for c in first),
            check,
            "claims lack lease or submission",
        )
        rest = await queue.claim(
            owner="w2", agents=served, limit=5, ttl_s=_LONG, max_takeovers=3, backoff_s=0
        )
        _expect([c.lease.run_id for c in rest] == ids[2:], check, f"a second worker claimed {rest}")
        none = await queue.claim(
            owner="w3", agents=served, limit=5, ttl_s=_LONG, max_takeovers=3, backoff_s=0
        )
        _expect(none == (), check, f"live leases were claimed again: {none}")


async def _submitted_and_claimed(
    queue: RunQueue, name: str, *, ttl_s: float, max_takeovers: int
) -> tuple[str, dict[str, tuple[str, ...]], Claim]:
    """Submit a fresh run of a fresh agent and claim it as worker ``w1``.

    Returns:
        ``(run_id, served, claim)``: ``served`` is the agents argument that serves the run
        (its agent at version ``v1``).
    """
    agent = _run_id("agent")
    run_id = _run_id(name)
    await queue.submit(run_id, agent=agent, input=_INPUT)
    served: dict[str, tuple[str, ...]] = {agent: ("v1",)}
    (claimed,) = await queue.claim(
        owner="w1", agents=served, limit=1, ttl_s=ttl_s, max_takeovers=max_takeovers, backoff_s=0
    )
    return run_id, served, claimed


async def _queue_takeover(open_store: StoreOpener, clock: ContractClock | None) -> None:
    check = "queue_takeover"
    assert clock is not None
    async with open_store() as store:
        queue = _queue(store, check)
        run_id, served, claimed = await _submitted_and_claimed(
            queue, "poison", ttl_s=1.0, max_takeovers=2
        )
        agent = next(iter(served))
        await store.write_run_started(
            _started(run_id, agent=agent, version="v1"), seq=1, generation=claimed.lease.generation
        )
        await store.read_log(run_id)  # committed before the lease lapses
        await clock.advance(1.5)
        (taken,) = await queue.claim(
            owner="w2", agents=served, limit=1, ttl_s=1.0, max_takeovers=2, backoff_s=0
        )
        _expect(taken.takeover and taken.lease.generation == 2, check, f"takeover claim {taken}")
        other = await queue.claim(
            owner="w3", agents={agent: ("v2",)}, limit=1, ttl_s=1.0, max_takeovers=2, backoff_s=0
        )
        _expect(other == (), check, "a worker of another version claimed a started run")
        await clock.advance(1.5)
        quarantined = await queue.claim(
            owner="w3", agents=served, limit=1, ttl_s=1.0, max_takeovers=2, backoff_s=0
        )
        _expect(quarantined == (), check, "a run whose drivers died twice was claimed again")
        summary = await _index(store, check).read_summary(run_id)
        _expect(
            summary is not None and summary.liveness is Liveness.QUARANTINED, check, f"{summary}"
        )
        _expect(await queue.release_quarantine(run_id), check, "release_quarantine refused")
        (back,) = await queue.claim(
            owner="w3", agents=served, limit=1, ttl_s=_LONG, max_takeovers=2, backoff_s=0
        )
        _expect(back.lease.generation == 3, check, f"the released run was claimed as {back}")


async def _queue_unstarted_takeover(open_store: StoreOpener, clock: ContractClock | None) -> None:
    check = "queue_unstarted_takeover"
    assert clock is not None
    async with open_store() as store:
        queue = _queue(store, check)
        run_id, served, claimed = await _submitted_and_claimed(
            queue, "unstarted", ttl_s=1.0, max_takeovers=3
        )
        await clock.advance(1.5)  # w1 died before writing run-started
        (taken,) = await queue.claim(
            owner="w2", agents=served, limit=1, ttl_s=_LONG, max_takeovers=3, backoff_s=0
        )
        _expect(taken.lease.run_id == run_id, check, f"another run was claimed: {taken}")
        _expect(taken.takeover, check, f"the dead claimer was not counted: {taken}")
        _expect(
            taken.submission is not None and taken.submission.input == _INPUT,
            check,
            f"the takeover of a run never started lacks its submission: {taken}",
        )
        _expect(taken.lease.generation == claimed.lease.generation + 1, check, f"{taken}")


async def _queue_driving(open_store: StoreOpener, clock: ContractClock | None) -> None:
    check = "queue_driving"
    assert clock is not None
    async with open_store() as store:
        queue = _queue(store, check)
        run_id, served, claimed = await _submitted_and_claimed(
            queue, "paused", ttl_s=1.0, max_takeovers=3
        )
        await clock.advance(1.5)  # w1 was paused past its TTL, and drives the run still
        again = await queue.claim(
            owner="w1",
            agents=served,
            limit=1,
            ttl_s=1.0,
            max_takeovers=3,
            backoff_s=0,
            driving={run_id},
        )
        _expect(again == (), check, f"a worker claimed a run it drives: {again}")
        lease = await _leases(store, check).read_lease(run_id)
        _expect(lease == claimed.lease, check, f"a claim passing the run over changed {lease}")
        (taken,) = await queue.claim(
            owner="w2", agents=served, limit=1, ttl_s=_LONG, max_takeovers=3, backoff_s=0
        )
        _expect(taken.lease.run_id == run_id and taken.takeover, check, f"{taken}")


async def _queue_parked(open_store: StoreOpener, clock: ContractClock | None) -> None:
    check = "queue_parked"
    assert clock is not None
    async with open_store() as store:
        queue, served, run_id, gen = await _parked_run(
            store, check, lambda run_id: _approval_asked(run_id, deadline_ts=_FAR)
        )
        decided = ApprovalDecided(
            run_id=run_id, step=1, call_id="c", arguments_digest="d", decision="approve", ts=_TS
        )
        await _controls(store, check).append_control(decided)
        await _claimed_again(queue, served, gen, check)


async def _queue_woken(open_store: StoreOpener, clock: ContractClock | None) -> None:
    """A run parked on child runs is claimed only once `wake` (or its recheck) says so."""
    check = "queue_woken"
    async with open_store() as store:

        def awaited(run_id: str) -> ChildrenAwaited:
            return ChildrenAwaited(
                run_id=run_id,
                step=1,
                ts=_TS,
                intent_ids=("i",),
                children=(f"{run_id}/child",),
                active_s=0.0,
                recheck_ts=_FAR,
            )

        queue, served, run_id, gen = await _parked_run(store, check, awaited)
        _expect(
            await queue.wake(run_id), check, "wake said a run parked on child runs waits on none"
        )
        await _claimed_again(queue, served, gen, check)


_FAR: Final = "2999-01-01T00:00:00+00:00"


def _approval_asked(run_id: str, *, deadline_ts: str) -> ApprovalRequested:
    """The approval request of call ``c`` (tool ``t``, digest ``d``) at step 1."""
    return ApprovalRequested(
        run_id=run_id,
        step=1,
        call_id="c",
        tool="t",
        arguments_digest="d",
        ts=_TS,
        deadline_ts=deadline_ts,
    )


async def _parked_run(
    store: RunStore, check: str, parking: Callable[[str], ControlRecord]
) -> tuple[RunQueue, dict[str, tuple[str, ...]], str, int]:
    """A run claimed, started and parked by ``parking(run_id)``, its lease released.

    No claim takes it yet. Returns ``(queue, agents served, run id, its generation)``.
    """
    queue, leases = _queue(store, check), _leases(store, check)
    run_id, served, claimed = await _submitted_and_claimed(
        queue, check, ttl_s=_LONG, max_takeovers=3
    )
    gen = claimed.lease.generation
    await store.write_run_started(
        _started(run_id, agent=next(iter(served)), version="v1"), seq=1, generation=gen
    )
    _expect(not await queue.wake(run_id), check, "wake changed a running run")
    await store.write_control(parking(run_id), seq=2, generation=gen)
    await leases.release_lease(claimed.lease, control_seen=0)
    waiting = await queue.claim(
        owner="w2", agents=served, limit=1, ttl_s=_LONG, max_takeovers=3, backoff_s=0
    )
    _expect(waiting == (), check, "a parked run without news was claimed")
    return queue, served, run_id, gen


async def _claimed_again(
    queue: RunQueue, served: dict[str, tuple[str, ...]], gen: int, check: str
) -> None:
    """The parked run is claimed again, by its next generation, and not as a takeover."""
    (woken,) = await queue.claim(
        owner="w2", agents=served, limit=1, ttl_s=_LONG, max_takeovers=3, backoff_s=0
    )
    _expect(not woken.takeover and woken.lease.generation == gen + 1, check, f"{woken}")


QUEUE_CHECKS: Final[tuple[tuple[str, Check, bool], ...]] = (
    ("queue_submit", _queue_submit, False),
    ("queue_claims", _queue_claims, False),
    ("queue_takeover", _queue_takeover, True),
    ("queue_unstarted_takeover", _queue_unstarted_takeover, True),
    ("queue_driving", _queue_driving, True),
    ("queue_parked", _queue_parked, True),
    ("queue_woken", _queue_woken, False),
)
"""The queue contract: ``(name, check, needs a clock)``."""


async def check_run_queue(open_store: StoreOpener, *, clock: ContractClock | None) -> None:
    """Hold a `RunQueue` to its contract (docs/fleet.md, "Claiming").

    Args:
        open_store: opens the store under test (it must also keep leases, a control stream
            and a run index).
        clock: moves the store's clock; ``None`` skips the checks that need time to pass.

    Raises:
        StoreContractError: the first check the store fails, naming it.
    """
    await _run_checks(QUEUE_CHECKS, open_store, clock)
