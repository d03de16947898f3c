"""Request/reply over memory channels (STYLE rule 9).

The requester opens a one-slot reply channel, puts its send end into the request, and awaits
one reply. The replier answers with `reply` and never blocks on a requester that went away.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
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

    @contextlib.contextmanager
    def open(self) -> Iterator[trio.CancelScope]:
        """A fresh cancel scope bound to this step's deadline and cancellation."""
        scope = trio.CancelScope(deadline=self.deadline)
        if self.cancel_called:
            scope.cancel(reason=self.reason)
        self._open.add(scope)
        try:
            with scope:
                yield scope
        finally:
            self._open.discard(scope)

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
