"""An in-process store: the whole log in memory, for tests and simulations.

It has every capability of the durable stores (leases with fencing, the control stream, the run
index and a fleet's queue), with the same rules, so a test or a simulation on it exercises the
code paths a service runs on PostgreSQL. Every operation checkpoints, so the store behaves like
a real one under cancellation. Nothing survives the process.

Lease instants come from ``clock`` (epoch seconds; the system clock by default); a simulation
passes a function of trio's virtual clock so that leases expire in virtual time.
"""

from __future__ import annotations

import datetime as dt
import time
from collections.abc import Callable, Collection, Mapping, Sequence

import attrs
import trio

from treadle._exceptions import ConflictError, StoreError, UsageError
from treadle._ids import check_run_id
from treadle.stores import _leases, _queue
from treadle.stores._index import IndexDelta, checked_last, index_delta
from treadle.stores._ops import AppendStore
from treadle.types import (
    ApprovalDecided,
    BudgetCaps,
    CancelRequested,
    Claim,
    ControlEntry,
    Lease,
    Message,
    Record,
    RunLog,
    RunState,
    RunSummary,
    StopReason,
    StoreOp,
    Submission,
)


@attrs.define(eq=False)
class _Row:
    """One run's index row (the same columns the SQL stores keep)."""

    order: int
    state: RunState | None = None
    agent: str | None = None
    agent_version: str | None = None
    started_at: str | None = None
    steps: int = 0
    stop_reason: StopReason | None = None
    awaiting_until: str | None = None
    lease: Lease | None = None
    control_seen: int = 0
    submission: Submission | None = None
    claims: int = 0
    takeovers: int = 0
    not_before: float = 0.0
    quarantined: str | None = None

    def apply(self, delta: IndexDelta) -> None:
        """Set the columns ``delta`` changes."""
        if delta.unpark and self.state is RunState.AWAITING_CHILD:
            self.state, self.awaiting_until = RunState.RUNNING, None
        for name in ("state", "agent", "agent_version", "started_at", "steps", "stop_reason"):
            value = getattr(delta, name)
            if value is not None:
                setattr(self, name, value)
        if delta.awaiting_until is not None:
            self.awaiting_until = delta.awaiting_until or None


@attrs.define(eq=False)
class MemoryStore(AppendStore):
    """A store that keeps every log in a dict; implements every store capability.

    Every write is immediately "durable" (visible to `read_log`). A write whose ``seq`` is not
    the next of the run raises `ConflictError`; one whose ``generation`` is not the run's
    current lease generation raises `LeaseLost`; writes after `aclose` raise `StoreError`.

    Args:
        clock: the store's clock for leases and the queue (epoch seconds).
    """

    clock: Callable[[], float] = time.time
    _logs: dict[str, list[Record]] = attrs.field(init=False, factory=dict)
    _rows: dict[str, _Row] = attrs.field(init=False, factory=dict)
    _control: dict[str, list[ControlEntry]] = attrs.field(init=False, factory=dict)
    _closed: bool = attrs.field(init=False, default=False)

    # ------------------------------------------------------------------ the run store seam

    async def read_log(self, run_id: str) -> RunLog:
        """Return the run's log; an empty log for a run that does not exist.

        Raises:
            InvalidRunId: not an allowed run id (docs/concepts.md, "Run ids"); nothing is
                read, as in the durable stores.
        """
        check_run_id(run_id)
        await trio.lowlevel.checkpoint()
        return RunLog(run_id=run_id, records=tuple(self._logs.get(run_id, ())))

    async def list_runs(self) -> tuple[str, ...]:
        """Every run id with at least one record, in the order the runs entered the store."""
        await trio.lowlevel.checkpoint()
        return tuple(run_id for run_id in self._rows if self._logs.get(run_id))

    async def aclose(self) -> None:
        """Refuse further writes."""
        await trio.lowlevel.checkpoint()
        self._closed = True

    async def _append(
        self,
        run_id: str,
        seq: int,
        records: tuple[Record, ...],
        *,
        op: StoreOp,
        generation: int,
    ) -> None:
        # A cancelled writer writes nothing. A barrier is a schedule point, as it is in a
        # durable store; a non-barrier write takes no turn of the scheduler (docs/seams.md,
        # "Run store").
        if op.barrier:
            await trio.lowlevel.checkpoint()
        else:
            await trio.lowlevel.checkpoint_if_cancelled()
        self._check_open()
        for record in records:
            if record.run_id != run_id:
                raise UsageError(
                    f"a write of run {run_id!r} holds a record of run {record.run_id!r}"
                )
        row = self._rows.get(run_id)
        _leases.fence(run_id, generation, row.lease if row is not None else None)
        assert row is not None
        log = self._logs.setdefault(run_id, [])
        if seq != len(log) + 1:
            raise ConflictError(run_id, expected=len(log) + 1, got=seq)
        log.extend(records)
        delta = index_delta(records)
        if delta is not None:
            row.apply(delta)

    # ------------------------------------------------------------------ leases

    async def acquire_lease(self, run_id: str, *, owner: str, ttl_s: float) -> Lease:
        """Take (or renew, for its holder) the lease on ``run_id`` (see `LeaseStore`)."""
        await trio.lowlevel.checkpoint()
        self._check_open()
        row = self._row(check_run_id(run_id))
        row.lease = _leases.acquire(
            row.lease, run_id=run_id, owner=owner, ttl_s=ttl_s, now=self.clock()
        )
        return row.lease

    async def renew_leases(self, leases: Sequence[Lease], *, ttl_s: float) -> tuple[Lease, ...]:
        """Extend the leases still held; a lease missing from the result was lost."""
        await trio.lowlevel.checkpoint()
        self._check_open()
        _leases.check_ttl(ttl_s)
        now = self.clock()
        renewed = []
        for held in leases:
            row = self._rows.get(held.run_id)
            fresh = _leases.renew(row.lease if row else None, held, ttl_s=ttl_s, now=now)
            if row is not None and fresh is not None:
                row.lease = fresh
                renewed.append(fresh)
        return tuple(renewed)

    async def release_lease(self, lease: Lease, *, control_seen: int = 0) -> None:
        """Give the lease up if still held; record the control position handled."""
        await trio.lowlevel.checkpoint()
        self._check_open()
        row = self._rows.get(lease.run_id)
        if row is None or row.lease is None:
            return
        after = _leases.released(row.lease, lease)
        if after is not None:
            row.lease = after
            row.control_seen = max(row.control_seen, control_seen)

    async def read_lease(self, run_id: str) -> Lease | None:
        """The run's lease as stored, or ``None`` if it never had one."""
        await trio.lowlevel.checkpoint()
        row = self._rows.get(run_id)
        return row.lease if row is not None else None

    # ------------------------------------------------------------------ control stream

    async def append_control(self, record: CancelRequested | ApprovalDecided) -> ControlEntry:
        """Append to the run's control stream (see `ControlStream`)."""
        await trio.lowlevel.checkpoint()
        self._check_open()
        run_id = check_run_id(record.run_id)
        if run_id not in self._rows:
            raise UsageError(f"there is no run {run_id!r} in this store")
        entries = self._control.setdefault(run_id, [])
        entry = ControlEntry(run_id=run_id, position=len(entries) + 1, record=record)
        entries.append(entry)
        return entry

    async def read_control(self, run_id: str, *, after: int = 0) -> tuple[ControlEntry, ...]:
        """The run's control entries after position ``after``."""
        await trio.lowlevel.checkpoint()
        return tuple(self._control.get(run_id, ())[after:])

    async def control_heads(self, run_ids: Sequence[str]) -> Mapping[str, int]:
        """The last control position of each run that has entries."""
        await trio.lowlevel.checkpoint()
        return {r: len(self._control[r]) for r in run_ids if self._control.get(r)}

    # ------------------------------------------------------------------ run index

    async def list_summaries(self, *, last: int | None = None) -> tuple[RunSummary, ...]:
        """Every run, queued ones included, in the order they entered the store.

        ``last``: only the last ``last`` of them (`treadle.ports.RunIndex.list_summaries`).
        """
        last = checked_last(last)
        await trio.lowlevel.checkpoint()
        now = self.clock()
        listed = [
            run_id
            for run_id, row in self._rows.items()
            if row.state is not None or self._logs.get(run_id)
        ]
        chosen = listed if last is None else listed[-last:]
        return tuple(self._summary(run_id, self._rows[run_id], now) for run_id in chosen)

    async def read_summary(self, run_id: str) -> RunSummary | None:
        """One run's summary, or ``None``."""
        await trio.lowlevel.checkpoint()
        row = self._rows.get(run_id)
        if row is None or (row.state is None and not self._logs.get(run_id)):
            return None
        return self._summary(run_id, row, self.clock())

    def _summary(self, run_id: str, row: _Row, now: float) -> RunSummary:
        return RunSummary(
            run_id=run_id,
            state=row.state,
            liveness=_leases.liveness(
                state=row.state, lease=row.lease, quarantined=row.quarantined, now=now
            ),
            observed_at=now,
            lease=row.lease,
            agent=row.agent,
            agent_version=row.agent_version,
            steps=row.steps,
            stop_reason=row.stop_reason,
            started_at=row.started_at,
            submitted_at=row.submission.submitted_at if row.submission else None,
            claims=row.claims,
            takeovers=row.takeovers,
            quarantined=_queue.still_quarantined(row.state, row.quarantined),
            awaiting_until=row.awaiting_until,
            records=len(self._logs.get(run_id, ())),
        )

    # ------------------------------------------------------------------ the queue

    async def submit(
        self,
        run_id: str,
        *,
        agent: str,
        input: tuple[Message, ...],
        caps: BudgetCaps | None = None,
        parent: tuple[str, str] | None = None,
    ) -> Submission:
        """Queue a new run (idempotent for the same run id, agent and input)."""
        await trio.lowlevel.checkpoint()
        self._check_open()
        row = self._rows.get(check_run_id(run_id))
        if row is not None:
            return _queue.same_submission(run_id, row.submission, agent, input)
        row = self._row(run_id)
        row.state = RunState.QUEUED
        row.agent = agent
        row.submission = Submission(
            run_id=run_id,
            agent=agent,
            input=input,
            submitted_at=self.clock(),
            caps=caps,
            parent_run_id=parent[0] if parent else None,
            parent_intent_id=parent[1] if parent else None,
        )
        return row.submission

    async def claim(
        self,
        *,
        owner: str,
        agents: Mapping[str, Sequence[str]],
        limit: int,
        ttl_s: float,
        max_takeovers: int,
        backoff_s: float,
        driving: Collection[str] = (),
    ) -> tuple[Claim, ...]:
        """Claim up to ``limit`` claimable runs, oldest first (see `RunQueue.claim`)."""
        await trio.lowlevel.checkpoint()
        self._check_open()
        now = self.clock()
        claims: list[Claim] = []
        for run_id, row in self._rows.items():
            if len(claims) >= limit:
                break
            if run_id in driving:
                continue
            kind = _queue.claim_kind(self._queue_row(run_id, row), agents, now)
            if kind is None:
                continue
            takeover = kind == "takeover"
            if takeover and row.takeovers + 1 >= max_takeovers:
                row.quarantined = _queue.quarantine_reason(row.takeovers + 1, row.lease)
                continue
            row.takeovers += 1 if takeover else 0
            row.claims += 1
            row.not_before = _queue.next_not_before(now, row.takeovers, backoff_s)
            row.lease = _leases.acquire(row.lease, run_id=run_id, owner=owner, ttl_s=ttl_s, now=now)
            queued = row.state is RunState.QUEUED
            submission = row.submission if queued else None
            assert row.agent is not None  # claim_kind claims only runs of served agents
            claims.append(
                Claim(lease=row.lease, agent=row.agent, submission=submission, takeover=takeover)
            )
        return tuple(claims)

    async def read_submission(self, run_id: str) -> Submission | None:
        """The run's queue entry, or ``None``."""
        await trio.lowlevel.checkpoint()
        row = self._rows.get(run_id)
        return row.submission if row is not None else None

    async def release_quarantine(self, run_id: str) -> bool:
        """Make a quarantined run claimable again (its takeover count starts afresh)."""
        await trio.lowlevel.checkpoint()
        self._check_open()
        row = self._rows.get(run_id)
        if row is None or row.quarantined is None:
            return False
        row.quarantined, row.takeovers, row.not_before = None, 0, 0.0
        return True

    async def wake(self, run_id: str) -> bool:
        """Make a run parked on child runs claimable now (`treadle.ports.RunQueue.wake`)."""
        await trio.lowlevel.checkpoint()
        self._check_open()
        row = self._rows.get(run_id)
        if row is None or row.state is not RunState.AWAITING_CHILD:
            return False
        now = self.clock()
        if row.awaiting_until is not None and _queue.epoch_of(row.awaiting_until) <= now:
            return False
        row.awaiting_until = dt.datetime.fromtimestamp(now, dt.UTC).isoformat()
        return True

    # ------------------------------------------------------------------ internals

    def _queue_row(self, run_id: str, row: _Row) -> _queue.QueueRow:
        return _queue.QueueRow(
            state=row.state,
            agent=row.agent,
            agent_version=row.agent_version,
            lease=row.lease,
            control_head=len(self._control.get(run_id, ())),
            control_seen=row.control_seen,
            awaiting_until=row.awaiting_until,
            not_before=row.not_before,
            quarantined=row.quarantined,
            takeovers=row.takeovers,
        )

    def _row(self, run_id: str) -> _Row:
        row = self._rows.get(run_id)
        if row is None:
            row = self._rows[run_id] = _Row(order=len(self._rows))
        return row

    def _check_open(self) -> None:
        if self._closed:
            raise StoreError("the memory store is closed")
