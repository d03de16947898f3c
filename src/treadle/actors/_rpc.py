"""Request/reply over memory channels.

The requester opens a one-slot reply channel, puts its send end into the request, and awaits
one reply. The replier answers with `reply` and never blocks on a requester that went away.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import trio

R = TypeVar("R")
Q = TypeVar("Q")


async def request(
    inbox: trio.MemorySendChannel[Q], make: Callable[[trio.MemorySendChannel[R]], Q]
) -> R:
    """Send ``make(reply_to)`` to ``inbox`` and return the one reply.

    Raises:
        trio.EndOfChannel: the replier closed the reply channel without answering (it failed;
            its own error reaches the run supervisor through the nursery).
    """
    # 1: the reply slot, so the replier never blocks on us.
    send, recv = trio.open_memory_channel[R](1)
    with recv:
        await inbox.send(make(send))
        return await recv.receive()


def reply(reply_to: trio.MemorySendChannel[R], value: R) -> None:
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

    def open(self) -> _BoundScope:
        """A fresh cancel scope bound to this step's deadline and cancellation.

        Use as ``with step_scope.open() as scope:``; ``scope`` is the `trio.CancelScope`.
        """
        return _BoundScope(self)

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

    __slots__ = ("_owner", "_scope")

    def __init__(self, owner: StepScope) -> None:
        self._owner = owner
        self._scope = trio.CancelScope(deadline=owner.deadline)
        if owner.cancel_called:
            self._scope.cancel(reason=owner.reason)

    def __enter__(self) -> trio.CancelScope:
        self._owner._open.add(self._scope)
        return self._scope.__enter__()

    def __exit__(self, *exc_info: object) -> bool | None:
        self._owner._open.discard(self._scope)
        return self._scope.__exit__(*exc_info)  # type: ignore[arg-type]
