"""Actor inboxes: bounded queues between the tasks of one run (docs/performance.md).

A trio memory channel checkpoints on every send and every receive, also when it does not
wait: each is a full turn of the scheduler. A step of a run sends about a dozen messages
between its actors, and those turns were a fifth of its CPU time. A mailbox checkpoints only
where it waits: `MailboxSender.send` returns at once when there is room, and
`MailboxReceiver.receive` returns at once when a message is there. Everything else is the
memory channel's behaviour, so an actor serves a mailbox as it served a channel (``async
for message in inbox``, ``with inbox``):

* a send or receive in a cancelled scope raises `trio.Cancelled` and moves nothing (as a
  channel's would), without a turn of the scheduler when the scope is not cancelled;

* a bounded buffer (at least one message), first in first out, one receiver at a time;
* the receiver's end closed: a send raises `trio.BrokenResourceError`; the sender's end
  closed: a send raises `trio.ClosedResourceError`, and the receiver gets the messages still
  buffered, then `trio.EndOfChannel`;
* a wait (a full buffer, an empty one) is cancellable, and a cancelled wait loses nothing;
* as trio's channels, every operation is protected from Ctrl-C (`KeyboardInterrupt` is
  delivered once it is done): raised between noting a waiting task and waiting, it would leave
  a task that a later message wakes while it waits elsewhere, a `trio.TrioInternalError`.

An actor still checkpoints wherever it waits for something (a reply, a store write, a model
call), so a run never holds the scheduler.
"""

from __future__ import annotations

from types import TracebackType
from typing import Generic, Self, TypeVar

import trio

T = TypeVar("T")
T_co = TypeVar("T_co", covariant=True)
T_contra = TypeVar("T_contra", contravariant=True)


class Closing:
    """``with`` and ``async with`` for a resource closed by its synchronous ``close()``.

    The mailbox's two ends and `treadle.actors.ReplySlot` close without waiting, so both
    forms of the block just call ``close()`` on the way out, whatever ended it.
    """

    def close(self) -> None:
        """Close the resource (never blocks)."""
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc_value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc_value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()


class _State(Generic[T]):
    __slots__ = ("buffer", "capacity", "receiver", "receiver_closed", "sender_closed", "senders")

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        # Lists, not deques: a run has several mailboxes, most holding one message at most,
        # and an empty deque takes ten times the memory of an empty list.
        self.buffer: list[T] = []
        self.receiver: trio.lowlevel.Task | None = None
        self.senders: list[trio.lowlevel.Task] = []
        self.sender_closed = False
        self.receiver_closed = False

    def wake_receiver(self) -> None:
        task = self.receiver
        if task is not None:
            self.receiver = None
            trio.lowlevel.reschedule(task)

    def wake_sender(self) -> None:
        if self.senders:
            trio.lowlevel.reschedule(self.senders.pop(0))


class open_mailbox(tuple["MailboxSender[T]", "MailboxReceiver[T]"]):
    """``open_mailbox[Message](capacity)``: a mailbox's sending and receiving ends.

    Written like `trio.open_memory_channel` (a class only so that the message type can be
    given in brackets); it holds up to ``capacity`` messages.

    Raises:
        ValueError: ``capacity`` is below 1.
    """

    def __new__(  # type: ignore[misc]
        cls, capacity: int
    ) -> tuple[MailboxSender[T], MailboxReceiver[T]]:
        if capacity < 1:
            raise ValueError(f"a mailbox holds at least one message, not {capacity}")
        state: _State[T] = _State(capacity)
        return MailboxSender(state), MailboxReceiver(state)

    def __init__(self, capacity: int) -> None:  # pragma: no cover - __new__ returns a tuple
        """Not called: `__new__` returns a plain tuple."""


class MailboxSender(Closing, Generic[T_contra]):
    """The sending end of a mailbox (several tasks may send)."""

    __slots__ = ("_state",)

    def __init__(self, state: _State[T_contra]) -> None:
        self._state = state

    @trio.lowlevel.enable_ki_protection
    def send_nowait(self, message: T_contra) -> None:
        """Put ``message`` in the mailbox without waiting.

        Raises:
            trio.WouldBlock: the buffer is full.
            trio.ClosedResourceError: this end was closed.
            trio.BrokenResourceError: the receiving end was closed.
        """
        state = self._state
        if state.sender_closed:
            raise trio.ClosedResourceError("the mailbox was closed for sending")
        if state.receiver_closed:
            raise trio.BrokenResourceError("the mailbox's receiver is gone")
        if len(state.buffer) >= state.capacity:
            raise trio.WouldBlock
        state.buffer.append(message)
        state.wake_receiver()

    @trio.lowlevel.enable_ki_protection
    async def send(self, message: T_contra) -> None:
        """Put ``message`` in the mailbox; wait (cancellably) while the buffer is full.

        It yields to the scheduler only when it waits.

        Raises:
            trio.Cancelled: the caller's scope is cancelled (nothing was sent).
            trio.ClosedResourceError: this end was closed.
            trio.BrokenResourceError: the receiving end was closed.
        """
        await trio.lowlevel.checkpoint_if_cancelled()  # a cancelled sender sends nothing
        state = self._state
        while True:
            try:
                self.send_nowait(message)
            except trio.WouldBlock:
                pass
            else:
                return
            task = trio.lowlevel.current_task()
            state.senders.append(task)

            def abort(_: object, task: trio.lowlevel.Task = task) -> trio.lowlevel.Abort:
                state.senders.remove(task)
                return trio.lowlevel.Abort.SUCCEEDED

            await trio.lowlevel.wait_task_rescheduled(abort)

    @trio.lowlevel.enable_ki_protection
    def close(self) -> None:
        """No more messages: the receiver gets those buffered, then `trio.EndOfChannel`."""
        state = self._state
        if state.sender_closed:
            return
        state.sender_closed = True
        state.wake_receiver()
        while state.senders:
            state.wake_sender()


class MailboxReceiver(Closing, Generic[T_co]):
    """The receiving end of a mailbox (one task receives at a time)."""

    __slots__ = ("_state",)

    def __init__(self, state: _State[T_co]) -> None:
        self._state = state

    @property
    def sender_closed(self) -> bool:
        """Whether the sending end was closed: no message will come after those queued."""
        return self._state.sender_closed

    @trio.lowlevel.enable_ki_protection
    def receive_nowait(self) -> T_co:
        """The oldest message, without waiting.

        Raises:
            trio.WouldBlock: the mailbox is empty.
            trio.EndOfChannel: empty, and the sending end was closed.
            trio.ClosedResourceError: this end was closed.
        """
        state = self._state
        if state.receiver_closed:
            raise trio.ClosedResourceError("the mailbox was closed for receiving")
        if state.buffer:
            message = state.buffer.pop(0)
            state.wake_sender()
            return message
        if state.sender_closed:
            raise trio.EndOfChannel
        raise trio.WouldBlock

    @trio.lowlevel.enable_ki_protection
    async def receive(self) -> T_co:
        """The oldest message; wait (cancellably) while the mailbox is empty.

        It yields to the scheduler only when it waits.

        Raises:
            trio.Cancelled: the caller's scope is cancelled (nothing was taken).
            trio.EndOfChannel: empty, and the sending end was closed.
            trio.ClosedResourceError: this end was closed.
            trio.BusyResourceError: another task is receiving.
        """
        await trio.lowlevel.checkpoint_if_cancelled()  # a cancelled receiver takes nothing
        state = self._state
        while True:
            try:
                return self.receive_nowait()
            except trio.WouldBlock:
                pass
            if state.receiver is not None:
                raise trio.BusyResourceError("another task is receiving from this mailbox")
            state.receiver = trio.lowlevel.current_task()

            def abort(_: object) -> trio.lowlevel.Abort:
                state.receiver = None
                return trio.lowlevel.Abort.SUCCEEDED

            await trio.lowlevel.wait_task_rescheduled(abort)

    @trio.lowlevel.enable_ki_protection
    def close(self) -> None:
        """Stop receiving: buffered messages are dropped, senders get `BrokenResourceError`."""
        state = self._state
        if state.receiver_closed:
            return
        state.receiver_closed = True
        state.buffer.clear()
        while state.senders:
            state.wake_sender()

    def __aiter__(self) -> MailboxReceiver[T_co]:
        return self

    async def __anext__(self) -> T_co:
        try:
            return await self.receive()
        except trio.EndOfChannel:
            raise StopAsyncIteration from None
