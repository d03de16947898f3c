"""Request/reply between actors.

The requester makes a one-shot `ReplySlot`, puts it into the request, and awaits one reply.
The replier answers with `reply` (or ``with reply_to: reply_to.send_nowait(value)``, as on a
one-slot memory channel) and never blocks on a requester that went away. A slot is a few
fields instead of a memory channel pair: a step makes several round trips, and this is each
one's fixed cost (docs/performance.md, "Where the time goes").
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

import trio

from treadle.actors._mailbox import Closing, MailboxSender

R = TypeVar("R")
Q = TypeVar("Q")

CANCEL_GRACE_S = 2.0
"""Seconds a cancelled tool call may take to finish writing its own state (it got a trio
cancellation at once; a tool that shields its cleanup gets this long before the run stops
waiting for it, abandons it in the tool host and finishes ``cancelled``). A child run gets
less (docs/child-runs.md, "Cancellation")."""


class ReplySlot(Closing, Generic[R]):
    """The one reply to one request: both sides of what was a one-slot memory channel.

    The replier calls `send_nowait` once, then `close` (or uses the slot as a context
    manager); closing without a value makes the requester's `receive` raise
    `trio.EndOfChannel`. Like a memory channel: sending on a closed slot raises
    `trio.ClosedResourceError`, sending a second value `trio.WouldBlock`, and sending to a
    requester that went away (it received, or was cancelled while waiting)
    `trio.BrokenResourceError`.
    """

    __slots__ = ("_closed", "_gone", "_has_value", "_value", "_waiter")

    def __init__(self) -> None:
        self._value: R | None = None
        self._has_value = False
        self._closed = False
        self._gone = False
        self._waiter: trio.lowlevel.Task | None = None

    @trio.lowlevel.enable_ki_protection
    def send_nowait(self, value: R) -> None:
        """Hand the reply over (never blocks; see the class for what it raises)."""
        if self._closed:
            raise trio.ClosedResourceError("the reply was already sent and closed")
        if self._gone:
            raise trio.BrokenResourceError("the requester went away")
        if self._has_value:
            raise trio.WouldBlock
        self._value = value
        self._has_value = True
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            trio.lowlevel.reschedule(waiter)

    @trio.lowlevel.enable_ki_protection
    def close(self) -> None:
        """No (more) reply: a requester still waiting gets `trio.EndOfChannel`."""
        if self._closed:
            return
        self._closed = True
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            trio.lowlevel.reschedule(waiter)

    @trio.lowlevel.enable_ki_protection
    async def receive(self) -> R:
        """The reply; at once when it is already there (no checkpoint then).

        Raises:
            trio.EndOfChannel: the replier closed the slot without answering.
        """
        if not self._has_value and not self._closed:
            self._waiter = trio.lowlevel.current_task()

            def abort(_: object) -> trio.lowlevel.Abort:
                self._waiter = None
                self._gone = True
                return trio.lowlevel.Abort.SUCCEEDED

            await trio.lowlevel.wait_task_rescheduled(abort)
        if not self._has_value:
            raise trio.EndOfChannel
        self._has_value = False
        self._gone = True
        value = self._value
        self._value = None
        return value  # type: ignore[return-value]

    def abandon(self) -> None:
        """The requester stops waiting: a later reply is refused (`trio.BrokenResourceError`)."""
        self._gone = True


async def request(inbox: MailboxSender[Q], make: Callable[[ReplySlot[R]], Q]) -> R:
    """Send ``make(reply_to)`` to ``inbox`` and return the one reply.

    Raises:
        trio.EndOfChannel: the replier closed the reply slot without answering (it failed;
            its own error reaches the run supervisor through the nursery).
    """
    slot: ReplySlot[R] = ReplySlot()  # not ReplySlot[R](): calling an alias is slow
    try:
        await inbox.send(make(slot))
        return await slot.receive()
    finally:
        slot.abandon()


def reply(reply_to: ReplySlot[R], value: R) -> None:
    """Answer a request; a requester that went away (cancelled) is ignored."""
    with reply_to:
        try:
            reply_to.send_nowait(value)
        except trio.BrokenResourceError:
            pass


class StepScope:
    """Cancellation and deadline of one step's work, shared by the actors serving it.

    The coordinator creates one per step with the active-time deadline (trio clock, seconds)
    and cancels it when the run is cancelled. Each actor opens its own cancel scopes from it
    (`open`), so cancelling the step reaches the model stream or tool call in flight in
    another task. A scope opened after `cancel` starts cancelled.
    """

    def __init__(self, deadline: float = float("inf")) -> None:
        self.deadline = deadline
        self.cancel_called = False
        self.reason = ""
        self._open: set[trio.CancelScope] = set()

    def open(self, limit_s: float | None = None) -> _BoundScope:
        """A fresh cancel scope bound to this step's deadline and cancellation.

        Use as ``with step_scope.open() as scope:``; ``scope`` is the `trio.CancelScope`.

        Args:
            limit_s: also end the scope this many seconds from now (trio clock) when that
                comes before the step's deadline: one scope for an actor's own limit and
                the step's (each scope is a measurable part of a step's cost,
                docs/performance.md). `_BoundScope.limit_expired` tells afterwards which
                ended it.
        """
        return _BoundScope(self, limit_s)

    def cancel(self, reason: str) -> None:
        """Cancel everything open now or opened later, with ``reason``."""
        self.cancel_called = True
        self.reason = reason
        for scope in self._open:
            scope.cancel(reason=reason)

    @property
    def expired(self) -> bool:
        """Whether the deadline has passed (trio clock)."""
        return trio.current_time() >= self.deadline


class _BoundScope:
    """Context manager behind `StepScope.open` (a class: this is on every step's hot path)."""

    __slots__ = ("_limit", "_owner", "_scope")

    def __init__(self, owner: StepScope, limit_s: float | None = None) -> None:
        self._owner = owner
        deadline = owner.deadline
        self._limit = float("inf")
        if limit_s is not None:
            self._limit = trio.current_time() + limit_s
            deadline = min(deadline, self._limit)
        self._scope = trio.CancelScope(deadline=deadline)
        if owner.cancel_called:
            self._scope.cancel(reason=owner.reason)

    @property
    def limit_expired(self) -> bool:
        """The scope caught a cancellation that its own limit caused (not the step's)."""
        owner = self._owner
        return (
            self._scope.cancelled_caught
            and not owner.cancel_called
            and self._limit < owner.deadline
            and trio.current_time() >= self._limit
        )

    # Protected from Ctrl-C: an interrupt between the bookkeeping and the trio scope under it
    # would leave the trio scope entered (or exited) alone, a corrupted cancel scope stack.
    @trio.lowlevel.enable_ki_protection
    def __enter__(self) -> trio.CancelScope:
        self._owner._open.add(self._scope)
        return self._scope.__enter__()

    @trio.lowlevel.enable_ki_protection
    def __exit__(self, *exc_info: object) -> bool | None:
        self._owner._open.discard(self._scope)
        return self._scope.__exit__(*exc_info)  # type: ignore[arg-type]
