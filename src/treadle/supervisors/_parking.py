"""Parked runs: a run that waits on a human keeps only its handle in memory.

When a run has waited `treadle.actors.RunCoordinator.park_after_s` for an approval
decision, its coordinator raises `Parked`; the run supervisor stops the run's five actors and
waits here for a decision, a cancel or the approval deadline, then resumes the run from its
log like a restarted process would (docs/decisions/0010-parking-waiting-runs.md). The
approval request is already durable, so nothing is lost whether the process stays up or not.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Awaitable, Callable, Sequence

import attrs
import trio

from treadle._clock import Clock
from treadle.actors import Cancel, Control, KeepDecision, Offer, take_offer
from treadle.approvals import counts, expired_decision
from treadle.types import ApprovalDecided, ApprovalRequested, RunState


@attrs.define(eq=False)
class Parking:
    """The state of one parked run: what it waits on and what arrived meanwhile.

    Attributes:
        request: the durable approval request the run waits on.
        deadline: trio time at which the wait ends with an ``expired`` decision.
        active_s: active seconds of the interrupted step, carried into the resumed one.
        clock: wall clock for the decision's timestamp.
        control_seen: the control-stream position handled before parking.
        decision: the decision handed over (by the handle, the control stream or the
            deadline); once `wait` returned, the one the run takes (``None`` when a cancel
            came first: `treadle.actors.take_offer`).
        decided_here: the decision came from the handle and is not durable yet (`wait`
            makes it so before the run takes it, `_keep_decision` when the run is left
            parked).
        cancel_request: ``(reason, canceller)`` once the run was cancelled while parked.
        cancelled_here: the cancel came through this process's handle (not yet durable).
    """

    request: ApprovalRequested
    deadline: float
    active_s: float
    clock: Clock
    control_seen: int = 0
    decision: ApprovalDecided | None = None
    decided_here: bool = False
    cancel_request: tuple[str, str] | None = None
    cancelled_here: bool = False
    _draining: bool = False
    _wake: trio.Event = attrs.Factory(trio.Event)

    def drain(self) -> None:
        """Stop waiting here (the run stays parked in the store, claimable by others)."""
        self._draining = True
        self._wake.set()

    @property
    def state(self) -> RunState:
        """``awaiting_approval``; ``cancelling`` once cancelled; ``running`` once decided."""
        if self.cancel_request:
            return RunState.CANCELLING
        return RunState.RUNNING if self.decision else RunState.AWAITING_APPROVAL

    def cancel(self, reason: str = "", canceller: str = "", *, here: bool = False) -> None:
        """Cancel the parked run: it resumes only to record the cancel and finish.

        ``here``: asked through this process's handle, not read from the control stream (the
        request is then made durable in the stream before the run is driven again).
        """
        if self.cancel_request is None:
            self.cancel_request = (reason, canceller)
            self.cancelled_here = here
            self._wake.set()

    def apply(self, message: Control) -> None:
        """Take a control message (`treadle.actors.Control`) read from the control stream.

        Or, with ``here`` set, one the handle sent to a coordinator that parked before it
        applied it: then it is made durable before the run is driven again.

        A drain asked through the stream is not a thing: only this process drains.
        """
        if isinstance(message, Cancel):
            self.cancel(message.reason, message.canceller, here=message.here)
        elif isinstance(message, Offer):
            self.offer(message.decided, here=message.here)

    def offer(self, decided: ApprovalDecided, *, here: bool = False) -> None:
        """Take the first decision that counts for the request (`treadle.approvals.counts`).

        Decisions read from the control stream come in its order, so the first one that
        counts is the stream's: a human's approve, reject or edit stamped by the deadline, or
        the expiry the driver wrote there at the deadline. One that matches another request,
        or a human's stamped after the deadline, is ignored (docs/events.md, "Human approval").

        ``here``: handed over through this process's handle, not read from the stream. It
        is taken for now; it is made durable in the control stream before the run is driven
        again, and the stream's first decision is the one the run takes then (`wait`): a
        decision another process wrote before it, not read yet, counts instead.
        """
        if self.decision is None and counts(decided, self.request):
            self.decision = attrs.evolve(decided, run_id=self.request.run_id)
            self.decided_here = here
            self._wake.set()

    async def wait(
        self,
        poll: Callable[[], Awaitable[None]],
        expire: Callable[[], Awaitable[None]],
        poll_s: float | None,
        grown: Callable[[trio.Event], Awaitable[None]] | None = None,
        read_control: Callable[[], Awaitable[Sequence[Control]]] | None = None,
        keep: KeepDecision | None = None,
    ) -> None:
        """Wait for a decision or a cancel; at the deadline, expire the call.

        At the deadline ``expire`` writes the expiry to the control stream and reads the
        stream once more: the first decision there that counts is taken (`offer`), a human's
        written before the expiry or the expiry itself. Without a control stream (``expire``
        reads nothing) the call expires here. The decision is then taken as a driven run
        takes it (`treadle.actors.take_offer`): a cancel known by then wins, and one handed
        over by the handle is first made durable in the stream (``keep``), which is read
        once more: a cancel written there before it wins too (`decision` is ``None`` then),
        and a decision written there before it is the one taken, as a run resumed from
        the stream would take it (docs/events.md, "Human approval").

        Args:
            poll: reads the control log once (decisions and cancels of other processes).
            expire: at the deadline, writes the expiry to the control stream
                (`treadle.approvals.append_expiry`), then reads the stream once more,
                trusting no shared listing.
            poll_s: seconds between two polls; ``None`` never polls.
            grown: ``await grown(wake)`` returns once ``wake`` is set, which the store's
                shared reading of control heads does when the run's stream grew beyond what
                was handed over (`ControlIndex.wait_grown`); then the run reads its control
                stream only when woken, not every ``poll_s``.
            read_control: reads the control stream itself once, now: the entries not
                handed over yet, as messages (``None``: no control stream).
            keep: makes the handle's decision durable in the control stream and reads the
                stream once (`treadle.actors.KeepDecision`; ``None``: no control stream).

        Raises:
            StoreError: a reading of the control stream (or of the shared heads) failed.
        """
        interval = math.inf if poll_s is None or grown is not None else poll_s
        with trio.move_on_at(self.deadline):
            while self.decision is None and self.cancel_request is None and not self._draining:
                self._wake = trio.Event()
                with trio.move_on_after(interval):
                    if grown is not None and poll_s is not None:
                        await grown(self._wake)
                    else:
                        await self._wake.wait()
                if poll_s is not None:
                    await poll()
        if self._draining:
            return
        if self.decision is None and self.cancel_request is None:
            await expire()  # a decision written before the expiry in the stream still counts
        if self.decision is None and self.cancel_request is None:  # no control stream
            self.decision = expired_decision(self.request, self.clock)
        if self.decision is not None:
            offer = Offer(decided=self.decision, here=self.decided_here)
            bound = None if keep is None else functools.partial(keep, self.request)
            self.decision = await take_offer(
                offer, read_control, self.apply, self._cancelled, keep=bound
            )
            self.decided_here = self.decided_here and bound is None  # else kept durable

    def _cancelled(self) -> bool:
        return self.cancel_request is not None
