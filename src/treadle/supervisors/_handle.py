"""The handle a caller holds on one run (docs/concepts.md, "Actors"; docs/events.md).

The handle owns what it reports: the run's state and the approval it waits on are told to it
by the run coordinator as they change, and it wakes whoever waits for a state
(`RunHandle.wait_state`). It reaches the run only with messages: a cancel, a decision or a
drain goes to the coordinator's inbox while the run is driven here, or to the parking state
while it is parked (docs/decisions/0010-parking-waiting-runs.md).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Mapping
from typing import Any

import attrs
import trio

from treadle._bursts import and_buffered
from treadle._clock import Clock
from treadle._exceptions import RunInterrupted, UsageError
from treadle._trio_only import in_run_of
from treadle.actors import (
    Cancel,
    Control,
    Drain,
    MailboxSender,
    Offer,
    WriterClient,
    WriterStatistics,
    resume_from,
    stored_events,
    with_step_started,
)
from treadle.approvals import check_cancel_text, decision_for
from treadle.ports import RunStore
from treadle.redaction import NO_REDACTION, Redaction
from treadle.supervisors._factories import WriterActor
from treadle.supervisors._parking import Parking
from treadle.types import (
    ApprovalDecided,
    ApprovalRequested,
    Event,
    EventKind,
    JSONValue,
    RunResult,
    RunState,
)


@attrs.define(eq=False)
class RunHandle:
    """A caller's handle on one run (new, resumed or already finished).

    Attributes:
        run_id: the run.
    """

    run_id: str
    _store: RunStore
    _clock: Clock
    _control: MailboxSender[Control] | None = attrs.field(init=False, default=None)
    _status: RunState | None = attrs.field(init=False, default=None)
    _awaiting: ApprovalRequested | None = attrs.field(init=False, default=None)
    _offered_for: ApprovalRequested | None = attrs.field(init=False, default=None)
    _cancel_sent: bool = attrs.field(init=False, default=False)
    _writer: WriterActor | None = attrs.field(init=False, default=None)
    _writer_client: WriterClient | None = attrs.field(init=False, default=None)
    _parking: Parking | None = attrs.field(init=False, default=None)
    _result: RunResult | None = attrs.field(init=False, default=None)
    _error: BaseException | None = attrs.field(init=False, default=None)
    _done: trio.Event = attrs.field(init=False, factory=trio.Event)
    _changed: trio.Event = attrs.field(init=False, factory=trio.Event)
    _draining: bool = attrs.field(init=False, default=False)
    _left: str | None = attrs.field(init=False, default=None)
    _snapshot: Mapping[str, JSONValue] | None = attrs.field(init=False, default=None)
    _redaction: Redaction = attrs.field(init=False, default=NO_REDACTION)
    _token: trio.lowlevel.TrioToken = attrs.field(
        init=False, factory=trio.lowlevel.current_trio_token
    )
    """The trio run the handle was made in, whose thread alone may ask it anything."""

    # ------------------------------------------------------------------ what it reports

    @property
    def state(self) -> RunState:
        """The run state now (``interrupted`` when an actor failed)."""
        if self._result is not None:
            return self._result.state
        if self._error is not None:
            return RunState.INTERRUPTED
        if self._parking is not None:
            state = self._parking.state
        else:
            state = self._status if self._status is not None else RunState.QUEUED
        if state is RunState.AWAITING_APPROVAL and self._awaited() is None:
            return RunState.RUNNING  # decided here; the run has not taken it in yet
        return state

    @property
    def result(self) -> RunResult | None:
        """The result once the run finished, else ``None``."""
        return self._result

    @property
    def left(self) -> str | None:
        """Why this process stopped driving the unfinished run (``drained``, ``parked``)."""
        return self._left

    @property
    def parked(self) -> bool:
        """Whether the run waits for a decision here with its actors stopped (parked).

        docs/decisions/0010-parking-waiting-runs.md; `wait_parked` waits for it.
        """
        return self._parking is not None

    @property
    def pending_approval(self) -> ApprovalRequested | None:
        """The approval request the run waits on now (state ``awaiting_approval``), or ``None``.

        ``None`` as soon as a decision on it was handed over (`approve` returned), before the
        run recorded it. Its ``arguments`` are those the call would run with, secret ones redacted
        (docs/events.md, "Secret arguments").
        """
        request = self._awaited()
        return None if request is None else self._redaction.request(request)

    async def wait_state(self, *states: RunState) -> RunState:
        """Wait until the run's state is one of ``states``; return it.

        Returns the state it has when it stops being driven here first (finished in
        another state, interrupted, drained or parked away): check what came back.
        ``awaiting_approval`` is reported from just before the request is written, so that
        `approve` works at once; the request is durable (and `treadle.approvals.decide`
        finds it) once its ``approval_requested`` event is delivered (docs/events.md,
        "Reading events").

        Raises:
            UsageError: no state was given.
        """
        if not states:
            raise UsageError("wait_state needs at least one state to wait for")
        while True:
            changed = self._changed
            state = self.state
            if state in states or self._done.is_set():
                await trio.lowlevel.checkpoint()
                return state
            await changed.wait()

    async def wait_parked(self) -> bool:
        """Wait until the run is parked here (its actors stopped, waiting for a decision).

        Returns:
            ``True`` once parked; ``False`` when the run stopped being driven here first
            (it finished, failed or left).
        """
        while True:
            changed = self._changed
            if self._parking is not None or self._done.is_set():
                await trio.lowlevel.checkpoint()
                return self._parking is not None
            await changed.wait()

    def statistics(self) -> WriterStatistics | None:
        """Delivery counters of the run in this process (parked stretches included).

        ``None`` before the run was first driven here.
        """
        return self._writer.statistics() if self._writer is not None else None

    # ------------------------------------------------------------------ what it asks

    def cancel(self, reason: str = "", *, canceller: str = "") -> None:
        """Cancel the run (docs/concepts.md, "Stop reasons" rule A).

        The model call or action in flight is cancelled at once, a cancel record is written,
        and the run finishes ``cancelled``. A no-op once the run finished (or failed here).

        Raises:
            UsageError: ``reason`` or ``canceller`` is not a ``str``; or this process stopped
                driving the run unfinished (drained, or parked away on child runs; `left`
                says which): nothing here could apply the cancel. Cancel it through the
                store instead (`treadle.approvals.request_cancel`,
                ``treadle cancel``), which whoever drives it next applies. Also when called
                from another thread than the trio run's (`_require_its_thread`).
        """
        self._require_its_thread("cancel")
        check_cancel_text(reason, canceller)
        if self._parking is not None:
            self._parking.cancel(reason, canceller, here=True)
        elif self._control is None and self._left is not None and not self._ended_here:
            raise UsageError(
                f"run {self.run_id!r} is not driven here any more ({self._left}); cancel it "
                "through the store (treadle.approvals.request_cancel or `treadle cancel`)"
            )
        else:
            self._send(Cancel(reason=reason, canceller=canceller, here=True))
            self._cancel_sent = self._control is not None

    @property
    def _ended_here(self) -> bool:
        return self._result is not None or self._error is not None

    def approve(
        self,
        call_id: str | None = None,
        *,
        reject: str | None = None,
        edit: Mapping[str, Any] | None = None,
    ) -> ApprovalDecided:
        """Decide the pending approval: approve, reject with a message, or edit the arguments.

        The decision is recorded (a barrier) before the action's intent; the run continues.
        Once this returns, the handle no longer reports the request: `pending_approval` is
        ``None`` and `state` is ``running`` (unless cancelled), whether the run was parked or
        driven, so a loop of `wait_state` and `approve` waits for the next request.

        A cancel the run knows of when it takes the decision wins: the decision is never
        recorded, the call never runs, and the run ends ``cancelled`` (`wait` says so). Before
        taking it, parked or driven, the run appends it to its control stream and reads the
        stream once, so a cancel written there before (`treadle.approvals.request_cancel`,
        ``treadle cancel``) wins, and a decision written there before
        (`treadle.approvals.decide`, ``treadle approve``) is the one recorded, the first
        made durable, even though this call, which does not read the store, already
        returned (docs/events.md, "Human approval").

        Args:
            call_id: the call meant; refused when it is not the pending one (``None``: the
                pending call, whichever it is).
            reject: reject with this message; the model sees it in a synthetic observation.
            edit: run the call with these arguments instead: they replace the model's whole
                argument object (no merge; a secret argument must be given again) and must
                fit the tool's argument schema in the run's parameter snapshot.

        Returns:
            The decision handed to the run.

        Raises:
            UsageError: the run is not waiting for an approval, is being cancelled (by this
                handle, or as the handle reports, ``cancelling``), waits on another call, both
                ``reject`` and ``edit`` were given, or the edit is not a JSON object or does
                not fit the tool's schema (nothing is handed over then); or it was called
                from another thread than the trio run's (`_require_its_thread`).
        """
        self._require_its_thread("approve")
        if self._result is not None:
            raise UsageError(
                f"run {self.run_id!r} finished {self._result.state.value}: nothing waits for a "
                "decision"
            )
        if self._parking is None and self._control is None:
            raise UsageError(f"run {self.run_id!r} is not being driven here")
        if (self._cancel_sent and self._parking is None) or self.state is RunState.CANCELLING:
            raise UsageError(f"run {self.run_id!r} is being cancelled")
        request = self._awaited()
        decided = decision_for(
            self.run_id,
            request,
            self._clock,
            call_id=call_id,
            reject=reject,
            edit=edit,
            snapshot=self._snapshot,
            redaction=self._redaction,
        )
        if self._parking is not None:
            self._parking.offer(decided, here=True)
        else:
            self._send(Offer(decided=decided, here=True))
        self._offered_for = request
        self._transition()
        return decided

    def drain(self) -> None:
        """Stop driving the run at its next safe point and let go of its lease.

        The run is not cancelled: it stops between two steps (or at once while it waits on a
        human), stays unfinished and resumable, and its lease is released so that another
        driver takes it over from its log (docs/fleet.md, "Shutting a worker down").
        `wait` then raises `RunInterrupted`; `left` says why.

        Raises:
            UsageError: called from another thread than the trio run's
                (`_require_its_thread`).
        """
        self._require_its_thread("drain")
        self._draining = True
        if self._parking is not None:
            self._parking.drain()
        else:
            self._send(Drain())

    def _require_its_thread(self, method: str) -> None:
        """Refuse a request made outside the trio run the handle was made in.

        The request reaches the run through that run's trio objects (its channels and
        events), which no other thread may touch (docs/events.md, "Cancellation"): another
        thread hands the call to the run (``trio.from_thread.run_sync``), another process
        goes through the store.

        Raises:
            UsageError: called from a thread of no trio run (a plain thread, an asyncio
                loop's) or from another trio run's thread.
        """
        if not in_run_of(self._token):
            raise UsageError(
                f"handle.{method}() of run {self.run_id!r} is called in the trio run that "
                "drives it, and this call came from another thread: hand it to that run "
                f"(trio.from_thread.run_sync(handle.{method}, ..., trio_token=...)), or "
                "cancel or decide through the store (treadle.approvals.request_cancel or "
                'decide, `treadle cancel`, `treadle approve`; docs/events.md, "Cancellation")'
            )

    def _send(self, message: Control) -> None:
        """Hand ``message`` to the coordinator driving the run here (none: nothing to do)."""
        if self._control is not None:
            with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                self._control.send_nowait(message)

    def _awaited(self) -> ApprovalRequested | None:
        """The request still open here: not decided, cancelled, nor decided through `approve`.

        The run applies the first message it gets and ignores the others, so a request a
        decision was handed over for is no longer reported (nor decided again), parked or
        driven, before the run's next report.
        """
        if self._parking is not None:
            parking = self._parking
            request = None if parking.decision or parking.cancel_request else parking.request
        else:
            request = self._awaiting
        return None if request is None or request == self._offered_for else request

    # ------------------------------------------------------------------ told by the driver
    # The run's driver (`treadle.supervisors._driver`) moves the handle through its states
    # with these methods only; nothing else writes the handle's fields.

    def _define(self, snapshot: Mapping[str, JSONValue], redaction: Redaction) -> None:
        """The definition of the drive starting: its snapshot and the arguments to redact."""
        self._snapshot, self._redaction = snapshot, redaction

    def _driving(
        self,
        control: MailboxSender[Control],
        writer: WriterActor,
        client: WriterClient,
        *,
        cancelling: bool = False,
    ) -> None:
        """Driven here now: requests go to ``control``, subscriptions through ``client``.

        ``cancelling``: a cancel handed over from the parking state goes with the drive.
        """
        self._control, self._writer, self._writer_client = control, writer, client
        self._parking, self._left = None, None
        self._status = RunState.CANCELLING if cancelling else RunState.RUNNING
        self._awaiting, self._offered_for, self._cancel_sent = None, None, cancelling
        self._transition()

    def _stopped_driving(self, *, left: str | None = None, parking: Parking | None = None) -> None:
        """The drive here ended unfinished: ``left`` says why, ``parking`` when parked here."""
        self._control, self._writer_client = None, None
        self._parking = parking
        if left is not None:
            self._left = left
        self._transition()

    def _finished(self, result: RunResult) -> None:
        """The run finished, here or before this drive: ``wait`` answers now.

        Sinks may still drain behind it.
        """
        self._result = result
        self._done.set()

    def _failed(self, error: BaseException) -> None:
        """The drive failed with ``error`` (raised by ``wait``); the run stays resumable."""
        self._error = error

    def _ended(self) -> None:
        """Nothing drives the run here any more: ``wait`` and ``events`` return."""
        self._parking = None
        self._done.set()
        self._transition()

    @property
    def _draining_requested(self) -> bool:
        return self._draining

    def _report(self, state: RunState, awaiting: ApprovalRequested | None) -> None:
        """The coordinator's report of a new state (or awaited request): wake the waiters."""
        self._status, self._awaiting = state, awaiting
        self._transition()

    def _transition(self) -> None:
        """Wake whoever waits for the run to be driven again (or to end)."""
        self._changed.set()
        self._changed = trio.Event()

    async def wait(self) -> RunResult:
        """Wait for the run to finish and return its result.

        Raises:
            RunInterrupted: an actor failed; the log is left resumable (``__cause__`` holds
                the error).
            StoreError: the store failed; the run stopped without continuing.
        """
        await self._done.wait()
        if self._error is not None:
            raise self._error
        if self._result is None:
            raise RunInterrupted(
                self.run_id,
                f"this process stopped driving it ({self._left}); it resumes from its log",
            )
        return self._result

    async def events(
        self, *, from_seq: int | None = None, after: tuple[int, int] | None = None
    ) -> AsyncIterator[Event]:
        """Yield the run's events from ``from_seq`` (default 1), or those after ``after``.

        Stored events come first, then live ones, with no gap and no duplicate where they
        meet (docs/concepts.md, "Events"). A reader that reconnects gives ``after``, the
        ``(seq, ordinal)`` of the last event it saw: a step-started event, which has the
        seq of the durable event before it, then comes after that event (docs/events.md,
        "Reading events").

        Durable events come with their seq; ephemeral deltas carry the seq of the durable
        event they follow and an ordinal. While a tool call of the run drives a child run
        in this process, the child's events come too, live, each with the child's run id
        and its own seq (keep one cursor per run id; they are never in this run's log,
        docs/child-runs.md, "Events"). Ends after the run-finished event, or when the run
        stops being driven here. The stream carries on, from the store, across a parked
        approval wait, and after the subscriber was cut off for falling behind (only
        deltas are then missing).

        Raises:
            UsageError: ``from_seq`` is not a whole number of 1 or more, ``after`` is not
                a ``(seq, ordinal)`` of whole numbers of 0 or more, or both are given
                (``from_seq=1`` too).
            StoreError: the stored prefix could not be read completely.
        """
        # The (seq, ordinal) of the last event yielded: a reconnect reads from its seq again
        # and skips what was yielded, so a derived step-started event (which shares the seq
        # of the durable event before it) is not lost at the seam.
        from_seq, last = resume_from(from_seq, after)
        while True:
            changed = self._changed
            client = self._writer_client
            start = max(from_seq, last[0])
            subscription = None
            if client is not None and not self._done.is_set():
                with contextlib.suppress(
                    trio.BrokenResourceError, trio.ClosedResourceError, trio.EndOfChannel
                ):
                    subscription = await client.subscribe()
            if subscription is None:
                log = await self._store.read_log(self.run_id)
                for event in stored_events(log, start, len(log.records)):
                    if (event.seq, event.ordinal) > last:
                        last = (event.seq, event.ordinal)
                        yield event
                if self._done.is_set() or (self._parking is None and client is None):
                    return
                await changed.wait()  # parked (or between two drivers): wait for the next
                continue
            async with subscription.events as live:
                caught_up = await self._catch_up(start, subscription.last_seq, subscription.tail)
                for event in caught_up:
                    if (event.seq, event.ordinal) > last:
                        last = (event.seq, event.ordinal)
                        yield event
                async for first in live:
                    for event in and_buffered(first, live):
                        if event.run_id != self.run_id:  # a child run's, live: own cursor
                            yield event
                        elif event.seq >= from_seq:
                            last = max(last, (event.seq, event.ordinal))
                            await self._reflected(event)
                            yield event

    async def _reflected(self, event: Event) -> None:
        """Wait until what the handle reports reflects ``event`` (docs/events.md, "Reading events").

        The writer hands an event to its subscribers as soon as its record is durable; the
        driver learns of it a scheduling step later. ``run_started`` waits until the run is
        driven here (``state`` is ``running``), ``run_finished`` until ``result`` is set.
        The approval request needs no wait: the handle reports it before its record is
        written.
        """
        if event.kind is EventKind.RUN_STARTED:
            while self._control is None and self._parking is None and not self._done.is_set():
                await self._changed.wait()
        elif event.kind is EventKind.RUN_FINISHED:
            await self._done.wait()

    async def _catch_up(self, from_seq: int, last_seq: int, tail: tuple[Event, ...]) -> list[Event]:
        if from_seq > last_seq:
            return []
        tail_start = tail[0].seq if tail else last_seq + 1
        events: list[Event] = []
        if from_seq < tail_start:
            log = await self._store.read_log(self.run_id)
            events.extend(stored_events(log, from_seq, tail_start - 1))
        events.extend(e for e in with_step_started(tail) if e.seq >= from_seq)
        return events
