"""The fleet: many runs, driven by many worker processes over one store (docs/fleet.md).

`open_fleet` is a worker inside the caller's trio program: it claims runs of the agents it
serves from the store's queue, up to ``max_running`` at a time, drives each under its lease,
and keeps every lease renewed in one call per interval. Runs are submitted durably
(`Fleet.submit`) and wait in state ``queued`` until a worker with room claims them; a worker
also claims orphaned runs (their driver's lease expired or was released unfinished) and parked
ones (waiting on a human) once a decision or their deadline arrives, oldest first. A run whose
drivers keep dying is quarantined by the store after ``max_takeovers`` takeovers.

Leaving the ``async with`` block drains the worker: it stops claiming, asks every run it drives
to stop at a safe point (between two steps, or at once while it waits on a human), releases
their leases, and returns once they stopped, or after ``drain_s`` seconds cancels what is left
(those runs stay resumable; their leases are released too). A worker killed outright leaves
its leases to expire: the others take its runs over after the TTL.
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Any, Final

import attrs
import trio

from treadle._clock import Clock, SystemClock, check_seconds
from treadle._exceptions import (
    ChildPending,
    LeaseError,
    StoreRefused,
    StoreStopped,
    UsageError,
    refusal_in,
    unavailable_in,
)
from treadle._ids import check_run_id, new_run_id
from treadle._text import valid_unicode
from treadle._trio_only import require_trio
from treadle.agent import Agent, RunInput, input_messages, snapshot_diff
from treadle.metrics import MetricsRecorder
from treadle.ports import EventSink, RunCounts, RunIndex, RunQueue, RunStore
from treadle.stores import LEASE_TTL_S, check_ttl, driver_owner
from treadle.supervisors._children import parent_of
from treadle.supervisors._driver import CONTROL_POLL_S, PARK_AFTER_S, DriveOptions, drive_run
from treadle.supervisors._factories import DEFAULT_ACTORS, Actors
from treadle.supervisors._fleet_drive import FleetDrive, current_drive
from treadle.supervisors._handle import RunHandle
from treadle.supervisors._leasing import LeaseHold, LeaseKeeper, leases_of
from treadle.types import BudgetCaps, Claim, JSONValue, Liveness, RunResult

AgentFactory = Callable[[], Agent]
"""Builds the agent definition a worker serves under a name (called once per drive).

It must build the same definition (the same parameter snapshot) on every call: a worker
refuses to drive a run with a definition other than the one it serves (`open_fleet`)."""

CLAIM_POLL_S: Final = 1.0
"""Seconds between two claim attempts of an idle worker (a local submit or a freed slot
claims at once)."""

DRAIN_S: Final = 30.0
"""Seconds a draining worker gives its runs to reach a safe point before cancelling them."""

MAX_TAKEOVERS: Final = 5
"""Takeovers (deaths of a run's driver) after which the store quarantines a run."""

BACKOFF_S: Final = 1.0
"""Base delay before a run whose driver died is claimed again (doubled per takeover)."""

CHILD_RECHECK_S: Final = 300.0
"""Seconds after which a run parked on child runs is claimable again even if none of its
children woke it (a child's driver that died between the child's end and the wake-up)."""

METRICS_REFRESH_S: Final = 5.0
"""Seconds between two readings of the store's run index for the metrics' run gauges."""

_LOG = logging.getLogger("treadle.fleet")


@attrs.frozen(kw_only=True)
class FleetStatistics:
    """Counters of one worker since it opened.

    Attributes:
        running: runs it drives now (those waiting on a child run included).
        claimed: claims it made (takeovers included).
        takeovers: claims of runs whose previous driver died.
        finished: runs it drove to their run-finished record.
        left: drives that ended without finishing the run (parked, drained, lease lost, an
            error; the run stays resumable).
        waiting: runs it drives that wait on a child run queued in the fleet, their slots
            freed (docs/child-runs.md, "In a fleet").
        unreleased: leases this worker let go of without releasing them and still left so
            (the release failed or was cut at the drain's deadline, or the run failed and
            its lease is left to expire), one per run: each expires after the lease TTL, and
            an unfinished run is then claimed as a takeover, unless it is quarantined. A
            later drive of the run by this worker takes it off (that drive's end counts it
            again only if it too lets go unreleased), and a lease lost to another driver is
            not counted (it is not this worker's). docs/fleet.md, "Shutting a worker down".
    """

    running: int
    claimed: int
    takeovers: int
    finished: int
    left: int
    waiting: int = 0
    unreleased: int = 0


@attrs.define(eq=False)
class Fleet:
    """A worker of a fleet; made by `open_fleet`.

    Attributes:
        owner: the worker's lease owner id.
    """

    owner: str
    _store: RunStore
    _queue: RunQueue
    _agents: Mapping[str, AgentFactory]
    _served: Mapping[str, _Served]  # agent name -> the definition built when the worker started
    _versions: Mapping[str, tuple[str, ...]]
    _options: DriveOptions
    _sinks: Sequence[EventSink]
    _max_running: int
    _ttl_s: float
    _poll_s: float
    _max_takeovers: int
    _backoff_s: float
    _nursery: trio.Nursery
    _child_recheck_s: float
    _metrics: MetricsRecorder | None
    # Each run's entries belong to the drive that made them (its claim): a drive ending
    # removes only its own, never those of a later drive of the same run.
    _handles: dict[str, RunHandle] = attrs.field(init=False, factory=dict)
    # claimed, not yet done: run id -> claim
    _driving: dict[str, Claim] = attrs.field(init=False, factory=dict)
    # driven, waiting on children: no slot
    _waiting: Counter[str] = attrs.field(init=False, factory=Counter)
    # child run id -> the parent waiting here
    _awaited: dict[str, str] = attrs.field(init=False, factory=dict)
    # awaited children whose drive here finished them
    _ended: set[str] = attrs.field(init=False, factory=set)
    # waiting parents due a slot before new claims
    _returning: set[str] = attrs.field(init=False, factory=set)
    _room: trio.lowlevel.ParkingLot = attrs.field(init=False, factory=trio.lowlevel.ParkingLot)
    _wake: trio.Event = attrs.field(init=False, factory=trio.Event)
    _draining: bool = attrs.field(init=False, default=False)
    _claimed: int = attrs.field(init=False, default=0)
    _takeovers: int = attrs.field(init=False, default=0)
    _finished: int = attrs.field(init=False, default=0)
    _left: int = attrs.field(init=False, default=0)
    # runs whose lease was let go unreleased
    _unreleased: set[str] = attrs.field(init=False, factory=set)

    def statistics(self) -> FleetStatistics:
        """Counters since the worker opened."""
        return FleetStatistics(
            running=len(self._driving),
            claimed=self._claimed,
            takeovers=self._takeovers,
            finished=self._finished,
            left=self._left,
            waiting=len(self._waiting),
            unreleased=len(self._unreleased),
        )

    async def submit(self, agent: str, input: RunInput, *, run_id: str | None = None) -> str:
        """Submit a run durably; it waits ``queued`` until a worker serving ``agent`` claims it.

        Submitting an existing run id again with the same agent and input returns it again.

        Args:
            agent: the agent name (a worker serving it must exist somewhere; this one need not
                serve it).
            input: the run input.
            run_id: the run's id (docs/concepts.md, "Run ids"); a fresh one when omitted.

        Returns:
            The run id.

        Raises:
            UsageError: the run id exists with another agent or input, or was started without
                the queue.
            InvalidRunId: ``run_id`` is not an allowed run id.
        """
        run_id = check_run_id(run_id) if run_id is not None else new_run_id()
        await self._queue.submit(run_id, agent=agent, input=valid_unicode(input_messages(input))[0])
        self._wake.set()
        return run_id

    async def result(
        self, run_id: str, *, poll_s: float = CLAIM_POLL_S, output_type: Any = None
    ) -> RunResult:
        """Wait until the run finished (whichever worker drove it) and return its result.

        It waits for as long as the run takes, through takeovers and approval waits; bound it
        with a cancel scope. ``output_type`` as for `wait_result`: without it a structured
        output is its JSON data.

        Raises:
            UsageError: the store knows no such run, or its output does not fit
                ``output_type``.
        """
        return await wait_result(self._store, run_id, poll_s=poll_s, output_type=output_type)

    def drain(self) -> None:
        """Stop claiming and ask every driven run to stop at its next safe point."""
        self._draining = True
        self._wake.set()
        for handle in list(self._handles.values()):
            handle.drain()

    @trio.lowlevel.enable_ki_protection  # Ctrl-C reaches the main task: decision 0097
    async def _claim_loop(self) -> None:
        while not self._draining:
            free = self._max_running - self._busy() - len(self._returning)
            if free > 0:
                for made in await self._claim(free):
                    self._driving[made.lease.run_id] = made
                    self._nursery.start_soon(
                        self._drive, made, name=f"treadle run {made.lease.run_id}"
                    )
            self._gauge_running()
            self._wake = trio.Event()
            with trio.move_on_after(self._poll_s):
                await self._wake.wait()

    def _busy(self) -> int:
        """Slots taken: runs driven here, less those waiting on a child."""
        return len(self._driving) - len(self._waiting)

    def _gauge_running(self) -> None:
        """Report the runs driven here, and how many of them wait on a child, to the metrics.

        Called when a claim, the end of a drive or a wait on a child changes either count, so
        the slots taken (the first less the second) never read above ``max_running``
        (docs/metrics.md, "A dashboard").
        """
        if self._metrics is not None:
            self._metrics.running(len(self._driving), len(self._waiting))

    @asynccontextmanager
    async def _waiting_on_child(self, run_id: str, child_id: str) -> AsyncIterator[None]:
        """Free ``run_id``'s slot while it waits on ``child_id``; then take one before new claims.

        A parent that waits on its child holds no slot, so parents can never hold every slot
        while their children wait (docs/child-runs.md, "In a fleet"). Its slot is reserved
        again (`_returning`) as soon as the last child it waits on ends: at the end of the
        child's drive, when a drive of this worker finished it (before the claim loop runs,
        so the slot the child frees is the parent's), else when the call saw it finished. A
        call that leaves the block parking its run (`ChildPending`) takes no slot again: its
        drive is ending.
        """
        self._waiting[run_id] += 1  # one count per call waiting (parallel calls of a step)
        self._awaited[child_id] = run_id
        self._gauge_running()
        self._room.unpark_all()
        self._wake.set()  # the claim loop may claim into the freed slot (the child, say)
        parking = False
        try:
            yield
        except ChildPending:
            parking = True
            raise
        finally:
            self._awaited.pop(child_id, None)
            self._ended.discard(child_id)
            if self._waiting[run_id] == 1 and not parking:  # the last waiting call: a slot
                self._returning.add(run_id)
                try:
                    while self._busy() >= self._max_running:
                        await self._room.park()
                finally:
                    self._returning.discard(run_id)
            elif parking:
                self._returning.discard(run_id)
            else:  # the calls left may all wait on children that ended here
                self._reserve_if_done(run_id)
            self._waiting[run_id] -= 1
            if self._waiting[run_id] <= 0:
                del self._waiting[run_id]
                self._gauge_running()

    def _child_ended(self, child_id: str) -> None:
        """A drive here finished ``child_id``: reserve the slot of the parent waiting on it.

        Only when the parent waits on nothing else (docs/child-runs.md, "In a fleet").
        Called before the freed slot wakes the claim loop, which then leaves the slot to the
        parent instead of claiming a new run into it.
        """
        parent = self._awaited.get(child_id)
        if parent is not None:
            self._ended.add(child_id)
            self._reserve_if_done(parent)

    def _reserve_if_done(self, parent: str) -> None:
        """Reserve ``parent``'s slot when each child it still waits on was finished here."""
        if all(child in self._ended for child, p in self._awaited.items() if p == parent):
            self._returning.add(parent)

    def _drive_of(self, run_id: str) -> FleetDrive:
        async def submit(
            agent: str, task: str, child_id: str, caps: BudgetCaps, parent: tuple[str, str]
        ) -> object:
            messages = valid_unicode(input_messages(task))[0]
            await self._queue.submit(
                check_run_id(child_id), agent=agent, input=messages, caps=caps, parent=parent
            )
            self._wake.set()
            return child_id

        return FleetDrive(
            run_id=run_id,
            store=self._store,
            submit=submit,
            result=lambda child_id, poll_s, output_type, patience_s: result_within(
                self._store, child_id, poll_s, output_type, patience_s
            ),
            waiting=lambda child_id: self._waiting_on_child(run_id, child_id),
            park_after_s=self._options.park_after_s,
            recheck_s=self._child_recheck_s,
        )

    async def _claim(self, free: int) -> tuple[Claim, ...]:
        try:
            claims = await self._queue.claim(
                owner=self.owner,
                agents=self._versions,
                limit=free,
                ttl_s=self._ttl_s,
                max_takeovers=self._max_takeovers,
                backoff_s=self._backoff_s,
                driving=frozenset(self._driving),  # a paused worker's own: docs/fleet.md
            )
        except (StoreStopped, StoreRefused) as exc:  # trying again changes nothing
            _LOG.error("claiming runs failed for good, the worker ends: %s", exc)
            raise
        except Exception as exc:  # the store is unreachable: try again at the next interval
            _LOG.warning("claiming runs failed (%s); trying again in %.1f s", exc, self._poll_s)
            return ()
        self._claimed += len(claims)
        self._takeovers += sum(1 for made in claims if made.takeover)
        return claims

    @trio.lowlevel.enable_ki_protection  # Ctrl-C reaches the main task: decision 0097
    async def _drive(self, made: Claim) -> None:
        run_id = made.lease.run_id
        hold = LeaseHold(
            run_id=run_id,
            owner=self.owner,
            ttl_s=self._ttl_s,
            store=leases_of(self._store),
            expire_on_failure=True,
        )
        hold.adopt(made.lease)
        entry = made.submission
        parent = parent_of(run_id)
        if entry is not None and entry.parent_run_id and entry.parent_intent_id:
            parent = (entry.parent_run_id, entry.parent_intent_id)
        options = attrs.evolve(
            self._options,
            agent_name=made.agent,
            parent=parent,
            caps=entry.caps if entry is not None else None,
        )
        handle: RunHandle | None = None
        finished = False
        short_of_connections = False
        self._unreleased.discard(run_id)  # this drive holds the run's lease again
        current_drive.set(self._drive_of(run_id))  # this task's context: the run's tools see it
        try:
            agent = self._agent_for(made)
            run_input = made.submission.input if made.submission is not None else None
            async with drive_run(
                agent, run_input, store=self._store, hold=hold, sinks=self._sinks, options=options
            ) as handle:
                self._handles[run_id] = handle
                if self._draining:
                    handle.drain()
            await handle.wait()
            finished = True
        except _UnservedDefinition as exc:  # the worker's fault, not the run's: decision 0115
            _LOG.error("%s", exc)
            await hold.release_quietly()
            raise
        except Exception as exc:  # the run's own error: it is left resumable, others go on
            self._report(run_id, handle, exc)
            if handle is not None and handle.left is not None:
                await hold.release_quietly()
            else:
                await hold.release_failed(exc)  # released when the database refuses the worker
            short_of_connections = unavailable_in(exc) is not None
            refused = refusal_in(exc)
            if refused is not None:  # not the run's: the database refuses this worker
                _LOG.error("the store refuses this worker's writes, the worker ends: %s", refused)
                raise refused from exc
        finally:  # also when cut at the drain deadline (trio.Cancelled): left, not finished
            # unless its run-finished record was durable (cut while its lease was released)
            if finished or (handle is not None and handle.result is not None):
                self._finished += 1
                self._child_ended(run_id)
            else:
                self._left += 1
            if hold.unreleased:
                self._unreleased.add(run_id)
            else:  # released, or lost: no lease of this worker's is left behind
                self._unreleased.discard(run_id)
            self._forget_drive(made, handle)
            self._room.unpark_all()
            self._gauge_running()
            if not short_of_connections:  # else the next claim waits its interval: no hot loop
                self._wake.set()

    def _agent_for(self, made: Claim) -> Agent:
        """The definition to drive ``made``'s run with: its factory's, the one this worker serves.

        The factory is called for each drive; what it builds must be the definition it
        built when the worker started, whose version is the one the worker claims runs of
        (docs/fleet.md, "Deploys"; docs/decisions/0115-a-worker-drives-only-the-definition-
        it-serves.md).

        Raises:
            _UnservedDefinition: the factory built another definition (a `UsageError`).
            Exception: whatever the factory raised (a failed drive, counted as a death).
        """
        agent = self._agents[made.agent]()
        served = self._served[made.agent]
        changed = snapshot_diff(served.snapshot, agent.snapshot())
        # a version label is the version, or the snapshot's hash: these two cover it
        if changed or agent.version != served.agent.version:
            raise _UnservedDefinition(made, served.agent, agent, changed)
        return agent

    def _forget_drive(self, made: Claim, handle: RunHandle | None) -> None:
        """Drop the entries of the drive of ``made`` (its handle, slot and waiting count).

        Only this drive's: a run claimed again while an older drive of it was ending (a
        queue that does not honour ``driving``) keeps the newer drive's entries, so that a
        drain still reaches it and its slot still counts.
        """
        run_id = made.lease.run_id
        if handle is not None and self._handles.get(run_id) is handle:
            del self._handles[run_id]
        if self._driving.get(run_id) is made:
            del self._driving[run_id]
            self._waiting.pop(run_id, None)

    @trio.lowlevel.enable_ki_protection  # Ctrl-C reaches the main task: decision 0097
    async def _gauge_store(self, metrics: MetricsRecorder, every_s: float) -> None:
        """Report the store's runs by liveness, from its run index, every ``every_s`` seconds."""
        if not isinstance(self._store, RunIndex):
            return
        while True:
            try:
                counts = await _count_runs(self._store)
            except Exception as exc:  # a gauge goes stale; the runs are not affected
                _LOG.warning("reading the run index for metrics failed (%s)", exc)
            else:
                metrics.store_runs(counts)
            await trio.sleep(every_s)

    def _report(self, run_id: str, handle: RunHandle | None, exc: Exception) -> None:
        if handle is not None and handle.left is not None:
            _LOG.info("run %r left %s: it resumes from its log", run_id, handle.left)
        elif isinstance(exc, LeaseError):  # another worker took it over: the operator sees it
            _LOG.warning("%s", exc)  # its message names the run
        else:
            _LOG.warning("run %r stopped unfinished: %s", run_id, exc)


async def wait_result(
    store: RunStore, run_id: str, *, poll_s: float = CLAIM_POLL_S, output_type: Any = None
) -> RunResult:
    """Wait until ``run_id`` has its run-finished record and return its result.

    Args:
        store: the store holding the run.
        run_id: the run.
        poll_s: seconds between looks at the store.
        output_type: the agent's output type: an attrs class structures
            `treadle.RunResult.output` into an instance; otherwise it is the stored JSON data
            (docs/structured-output.md, "Where the type is known").

    Raises:
        UsageError: the store knows no such run, or its output does not fit ``output_type``.
    """
    require_trio("treadle.wait_result")
    found = await result_within(store, run_id, poll_s, output_type, math.inf)
    assert found is not None
    return found


async def result_within(
    store: RunStore, run_id: str, poll_s: float, output_type: Any, patience_s: float
) -> RunResult | None:
    """`wait_result` for at most ``patience_s`` seconds (``None`` then); it looks once at least.

    Raises:
        UsageError: as `wait_result`.
    """
    deadline = trio.current_time() + patience_s
    while True:
        summary = await store.read_summary(run_id) if isinstance(store, RunIndex) else None
        if summary is None:
            log = await store.read_log(run_id)
            if log.finished is not None:
                return RunResult.from_finished(log.finished, output_type=output_type)
            if not log.records:
                raise UsageError(f"there is no run {run_id!r} in this store")
        elif summary.liveness is Liveness.FINISHED:
            log = await store.read_log(run_id)
            assert log.finished is not None
            return RunResult.from_finished(log.finished, output_type=output_type)
        left = deadline - trio.current_time()
        if left <= 0:
            return None
        await trio.sleep(min(poll_s, left))


@asynccontextmanager
@trio.lowlevel.enable_ki_protection  # Ctrl-C reaches the main task: decision 0097
async def open_fleet(
    store: RunStore,
    agents: Mapping[str, AgentFactory | Agent],
    *,
    max_running: int = 16,
    lease_ttl_s: float = LEASE_TTL_S,
    claim_poll_s: float = CLAIM_POLL_S,
    max_takeovers: int = MAX_TAKEOVERS,
    backoff_s: float = BACKOFF_S,
    drain_s: float = DRAIN_S,
    owner: str | None = None,
    sinks: Sequence[EventSink] = (),
    clock: Clock | None = None,
    control_poll_s: float | None = CONTROL_POLL_S,
    park_after_s: float | None = PARK_AFTER_S,
    actors: Actors = DEFAULT_ACTORS,
    metrics: MetricsRecorder | None = None,
    metrics_refresh_s: float = METRICS_REFRESH_S,
    child_recheck_s: float = CHILD_RECHECK_S,
) -> AsyncIterator[Fleet]:
    """Run a worker of a fleet for the duration of an ``async with`` block.

    Args:
        store: a store with a queue and leases (`treadle.open_sqlite_store` for processes
            on one machine, `treadle.open_postgres_store` for many machines).
        agents: agent name -> a factory of the `treadle.Agent` served under it (or the agent
            itself). Each agent's `treadle.Agent.version_label` is the version served: runs
            started under another version are left to workers that serve it. A factory is
            called once when the worker starts and once per drive, and must build the same
            definition (parameter snapshot) each time: a drive whose factory built another
            is refused, its run left as it was and its lease released, and the worker ends
            (``UsageError``; docs/fleet.md, "Deploys").
        max_running: runs driven at the same time.
        lease_ttl_s: lease duration (seconds); renewed every third of it. A worker that dies
            loses its runs to the others this long after its last renewal.
        claim_poll_s: seconds between claim attempts while idle.
        max_takeovers: drivers' deaths after which a run is quarantined.
        backoff_s: base delay before a run whose driver died is claimed again.
        drain_s: seconds the drain at the end of the block waits for safe points.
        owner: the worker's owner id (default ``host:pid:random``; one of a cancel's form is
            refused: `treadle.stores.driver_owner`).
        sinks: event sinks given to every run driven here.
        clock: wall clock for record timestamps.
        control_poll_s: seconds between reads of driven runs' control streams.
        park_after_s: seconds a run waits for a human, or on a child run it queued, with
            its actors running before it is parked: then its lease is released and its slot
            freed, and whichever worker is free claims it when the decision (or the
            deadline) arrives, or when a child ends (docs/child-runs.md, "In a fleet").
        actors: actor factories of every run (default: the real ones).
        metrics: counts the records of every run driven here, the store's commits, the
            runs this worker drives and, every ``metrics_refresh_s`` seconds, the store's
            runs by liveness (docs/metrics.md); ``None`` (the default) counts nothing.
        metrics_refresh_s: seconds between two readings of the run index for the gauges
            (never a log; the SQL stores count finished runs without reading their rows,
            and read the index rows of unfinished runs).
        child_recheck_s: seconds after which a run parked on child runs is claimable again
            even if no child woke it (`CHILD_RECHECK_S`).

    Yields:
        The worker (`Fleet`): submit runs, wait for results, read its statistics.

    Raises:
        UsageError: the store has no queue or leases, ``agents`` is empty, an argument is
            out of range, or an agent's factory raised or gave no `treadle.Agent` when called
            for the agent's version (the error it raised is the cause), or built for a run's
            drive a definition other than the one it built when the worker started (the
            run is released untouched; raised out of the block as `StoreRefused` is).
        StoreStopped: the store's committer stopped (its database stayed out of reach): the
            worker claims nothing more and the block ends, its runs cancelled and left to
            other workers (docs/fleet.md, "What each crash does"). Raised out of the block
            wrapped in an exception group, as trio's nurseries raise.
        StoreRefused: the database refuses the worker's claim for a reason trying again
            does not change (a privilege its role lacks); the block ends the same way.

    Cancellation:
        Cancelling the block cancels every run driven here (they stay resumable; their leases
        are released, within a bounded grace period, or else expire).
    """
    require_trio("treadle.open_fleet")
    if not isinstance(store, RunQueue) or leases_of(store) is None:
        raise UsageError(f"{type(store).__name__} has no queue: use SQLite or PostgreSQL")
    if not agents:
        raise UsageError("a worker serves at least one agent")
    if max_running < 1 or max_takeovers < 1:
        raise UsageError(
            f"max_running and max_takeovers must be at least 1, not {max_running} and "
            f"{max_takeovers}"
        )
    check_seconds(drain_s=drain_s, backoff_s=backoff_s, park_after_s=park_after_s)
    check_seconds(
        above_zero=True,
        metrics_refresh_s=metrics_refresh_s,
        child_recheck_s=child_recheck_s,
        claim_poll_s=claim_poll_s,
        control_poll_s=control_poll_s,
    )
    check_ttl(lease_ttl_s)
    owner = driver_owner(owner)
    factories = {name: _factory(value) for name, value in agents.items()}
    served = {name: _Served.of(_made(name, factory)) for name, factory in factories.items()}
    versions = {name: (each.agent.version_label,) for name, each in served.items()}
    leases = leases_of(store)
    assert leases is not None
    keeper = LeaseKeeper(store=leases, ttl_s=lease_ttl_s)
    options = DriveOptions(
        clock=clock or SystemClock(),
        rng=None,
        control_poll_s=control_poll_s,
        actors=actors,
        park_after_s=park_after_s,
        keeper=keeper,
        leave_parked=True,
        metrics=metrics,
    )
    if metrics is not None:
        metrics.watch(store)
    async with trio.open_nursery() as outer:
        await outer.start(keeper.run)
        async with trio.open_nursery() as runs:
            fleet = Fleet(
                owner=owner,
                store=store,
                queue=store,
                agents=factories,
                served=served,
                versions=versions,
                options=options,
                sinks=sinks,
                max_running=max_running,
                ttl_s=lease_ttl_s,
                poll_s=claim_poll_s,
                max_takeovers=max_takeovers,
                backoff_s=backoff_s,
                nursery=runs,
                child_recheck_s=child_recheck_s,
                metrics=metrics,
            )
            runs.start_soon(fleet._claim_loop, name="treadle fleet claims")
            if metrics is not None:
                outer.start_soon(fleet._gauge_store, metrics, metrics_refresh_s)
            try:
                yield fleet
            finally:
                fleet.drain()
                runs.cancel_scope.deadline = trio.current_time() + drain_s
        outer.cancel_scope.cancel()


async def _count_runs(index: RunIndex) -> Mapping[Liveness, int]:
    """How many runs of ``index`` have each liveness (absent: none).

    Counted by the store (`treadle.ports.RunCounts`: the SQL stores count finished runs in
    SQL, without reading them) where it can; else from every run's summary.

    Raises:
        StoreError: the index cannot be read.
    """
    if isinstance(index, RunCounts):
        return await index.count_runs()
    return Counter(summary.liveness for summary in await index.list_summaries())


def _made(name: str, factory: AgentFactory) -> Agent:
    """The agent ``factory`` makes, called when the worker starts (for its version).

    Raises:
        UsageError: the factory raised (the cause), or made no `treadle.Agent`.
    """
    try:
        agent = factory()
    except Exception as exc:
        raise UsageError(f"agent {name!r}: its factory raised {type(exc).__name__}: {exc}") from exc
    if not isinstance(agent, Agent):
        raise UsageError(f"agent {name!r}: its factory gave {type(agent).__name__}, not an Agent")
    return agent


@attrs.frozen
class _Served:
    """The definition a worker serves under a name, with its snapshot.

    The snapshot is made once, when the worker starts; `Fleet._agent_for` compares each
    drive's definition with it.
    """

    agent: Agent
    snapshot: Mapping[str, JSONValue]

    @classmethod
    def of(cls, agent: Agent) -> _Served:
        return cls(agent=agent, snapshot=agent.snapshot())


class _UnservedDefinition(UsageError):
    """A factory built, for a run's drive, a definition other than the one its worker serves.

    The worker ends on it (`open_fleet` raises it): its factory builds another definition
    on each call (a date or a time in the system prompt, a prompt file read again), so the
    versions it claims runs of do not say what it would drive them with
    (docs/decisions/0115-a-worker-drives-only-the-definition-it-serves.md).
    """

    def __init__(self, made: Claim, served: Agent, built: Agent, changed: Sequence[str]) -> None:
        differs = f"differs in {', '.join(changed)}" if changed else "differs"
        if built.version_label == served.version_label:
            what = f"a definition of version {served.version_label!r} that {differs}"
        else:
            what = f"version {built.version_label!r}, a definition that {differs}"
        super().__init__(
            f"agent {made.agent!r}: its factory built, for run {made.lease.run_id!r}, {what} "
            f"from the one it built when the worker started (version "
            f"{served.version_label!r}, the one this worker serves). A fleet agent's factory "
            'must build the same definition on every call (docs/fleet.md, "Deploys"): the run '
            "is left as it was, its lease released, and the worker ends"
        )


def _factory(value: AgentFactory | Agent) -> AgentFactory:
    if isinstance(value, Agent):
        return lambda: value
    if not callable(value):
        raise UsageError(f"{value!r} is neither a treadle.Agent nor a factory of one")
    return value


__all__ = ["AgentFactory", "Fleet", "FleetStatistics", "open_fleet", "wait_result"]
