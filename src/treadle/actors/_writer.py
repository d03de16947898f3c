"""The event writer: the single writer of one run's log and the source of its events.

It assigns each record its seq (1, 2, 3 ... gapless), hands the write to the store (whose
committer groups the barriers of all runs into one transaction), and fans each durable event
out to subscribers and sinks through bounded buffers. A slow or failing sink never stalls the
run: its events are dropped and counted (docs/seams.md, "Event sink"; docs/concepts.md, "Actors").
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Iterable, Iterator, Sequence

import attrs
import trio

from treadle._bursts import and_buffered
from treadle._exceptions import StoreError, UsageError, message_of, only_cancelled
from treadle.actors._mailbox import MailboxReceiver, MailboxSender
from treadle.actors._messages import (
    Append,
    Delta,
    Forward,
    Subscribe,
    Subscription,
    Warn,
    WriterRequest,
)
from treadle.actors._rpc import ReplySlot
from treadle.metrics import MetricsRecorder
from treadle.ports import EventSink, RunStore
from treadle.redaction import NO_REDACTION, Redaction
from treadle.types import (
    ActionIntent,
    ActionResult,
    ApprovalDecided,
    ApprovalRequested,
    CancelRequested,
    ChildrenAwaited,
    ControlRecord,
    DefinitionAccepted,
    Event,
    EventKind,
    ModelIntent,
    ModelResult,
    Record,
    RunFinished,
    RunLog,
    RunStarted,
    StepRecord,
    StoreOp,
)

_LOG = logging.getLogger("treadle.metrics")

EVENT_KIND: dict[type[object], EventKind] = {
    RunStarted: EventKind.RUN_STARTED,
    ModelIntent: EventKind.MODEL_CALL_STARTED,
    ModelResult: EventKind.MODEL_CALL_FINISHED,
    ActionIntent: EventKind.ACTION_REQUESTED,
    ActionResult: EventKind.ACTION_FINISHED,
    StepRecord: EventKind.STEP_COMPLETED,
    ApprovalRequested: EventKind.APPROVAL_REQUESTED,
    ApprovalDecided: EventKind.APPROVAL_DECIDED,
    CancelRequested: EventKind.CANCEL_REQUESTED,
    DefinitionAccepted: EventKind.DEFINITION_ACCEPTED,
    ChildrenAwaited: EventKind.CHILDREN_AWAITED,
    RunFinished: EventKind.RUN_FINISHED,
}
"""The durable event kind of each log record."""

SUBSCRIBER_BUFFER = 256
"""Events a subscriber may fall behind before it is cut off (it can re-subscribe from its
last seq and read the rest from the store)."""

SINK_BUFFER = 256
"""Events a sink may fall behind before new events for it are dropped and counted."""

SINK_GRACE_S = 2.0
"""Seconds sinks may take to drain their buffers after the run ended before being cancelled."""

SINK_CUT_GRACE_S = 1.0
"""Seconds a sink cut off before the end of its buffer may take (shielded) to receive its
``cut_off`` run-left event: a drive cancelled from outside waits that long at most for it."""

CUT_OFF = "cut_off"
"""The text of the run-left event of a sink cut off before the end of its buffer."""

END_READ_GRACE_S = 2.0
"""Seconds a drive cut from outside, or failed, may wait (shielded) at its end to read back
the records it wrote without a barrier, so that the ones the store holds are counted
(docs/metrics.md, "What is counted"); a read that takes longer leaves them uncounted."""

TAIL_KEEP = 16
"""Recent records kept in memory so a subscriber can join without a store read (16 to 32 are
kept; one joining further behind reads the store: docs/performance.md, "Memory")."""


@attrs.frozen(kw_only=True)
class WriterStatistics:
    """Counters of one run's event writer.

    Attributes:
        last_seq: seq of the last durable event.
        sink_drops: events not delivered to a sink because its buffer was full.
        sink_failures: sink deliveries that raised.
        subscriber_drops: subscribers cut off for falling behind.
    """

    last_seq: int
    sink_drops: int
    sink_failures: int
    subscriber_drops: int


@attrs.define(eq=False)
class SinkFeed:
    """A run's sinks, each fed through its own bounded buffer by its own task.

    It belongs to the run, not to one event writer: it lives across the writers of a run
    that is parked and resumed, so a sink sees every event without a hole and the delivery
    counters cover the whole run in this process (docs/decisions/0010).

    Attributes:
        sinks: the event sinks.
        sink_drops: events not delivered to a sink because its buffer was full.
        sink_failures: sink deliveries that raised.
        subscriber_drops: live subscribers cut off for falling behind (counted here so the
            count, too, spans the run's writers).
        on_warning: where warnings go (the current writer's subscribers), or ``None``.
        reflected: awaited before each event goes to a sink: returns once what the run's
            handle reports reflects the event (docs/events.md, "Reading events").

    When it is closed with the run unfinished, each sink gets one last ``run_left`` event
    after the events in its buffer, so that it can close what it keeps open for the run
    (docs/events.md, "Sinks and subscribers never stall a run"). The run's ``run_finished``
    event is not dropped for a full buffer either: a sink whose buffer is full when it is
    offered gets it after the events in its buffer. A sink cut off before the
    end of its buffer without having received the run's ``run_finished`` (the drive
    cancelled from outside, or its `SINK_GRACE_S` over) gets a ``run_left`` event reading
    ``cut_off`` at once instead, the rest of its buffer undelivered (`SINK_CUT_GRACE_S`).
    """

    sinks: Sequence[EventSink] = ()
    sink_drops: int = 0
    sink_failures: int = 0
    subscriber_drops: int = 0
    on_warning: Callable[[str], None] | None = None
    reflected: Callable[[Event], Awaitable[None]] | None = None
    _inboxes: list[trio.MemorySendChannel[Event]] = attrs.field(init=False, factory=list)
    _closed: trio.Event = attrs.field(init=False, factory=trio.Event)
    _ended: trio.Event = attrs.field(init=False, factory=trio.Event)
    _warned: set[tuple[int, str]] = attrs.field(init=False, factory=set)
    _last: tuple[str, int, int, EventKind] | None = attrs.field(init=False, default=None)
    """Run id, seq, ordinal and kind of the last event offered (no record kept alive)."""
    _left: Event | None = attrs.field(init=False, default=None)
    """The run-left event each sink gets after its buffer, once closed unfinished."""
    _finishes: dict[int, Event] = attrs.field(init=False, factory=dict)
    """The run-finished event, by the index of each sink whose buffer was full when it was
    offered: that sink gets it after its buffer."""

    @trio.lowlevel.enable_ki_protection  # Ctrl-C reaches the main task: decision 0097
    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Pump events to the sinks until `close`; then give them `SINK_GRACE_S` to drain."""
        try:
            async with trio.open_nursery() as nursery:
                for index, sink in enumerate(self.sinks):
                    send, recv = trio.open_memory_channel[Event](SINK_BUFFER)
                    self._inboxes.append(send)
                    nursery.start_soon(self._pump, index, sink, recv)
                task_status.started()
                try:
                    await self._closed.wait()
                finally:
                    for channel in self._inboxes:
                        channel.close()
                    # Sinks get a grace period to drain what they were handed, then are cut off.
                    nursery.cancel_scope.deadline = trio.current_time() + SINK_GRACE_S
        finally:
            self._ended.set()

    async def aclose(self, *, left: str | None = None) -> None:
        """`close`, then wait until the sinks are done (`SINK_GRACE_S` at most).

        For a feed whose `run` was started. Cancellation: cancelling the wait leaves the
        sinks draining in `run`'s task.
        """
        self.close(left=left)
        await self._ended.wait()

    def close(self, *, left: str | None = None) -> None:
        """No more events: the sinks drain their buffers (for `SINK_GRACE_S` at most).

        Args:
            left: why the run's drive here stopped, when the run may be unfinished
                (``drained``, ``parked``, ``interrupted``, ``finished_elsewhere``). Unless
                the run's ``run_finished`` event was offered, each sink then gets a
                ``run_left`` event with this text after the events in its buffer: it
                carries the ``(seq, ordinal)`` of the last event offered, and is never
                dropped for a full buffer (docs/events.md, "Sinks and subscribers never
                stall a run"). ``None`` (or no event offered at all): none is sent.

        Closing a closed feed does nothing.
        """
        if self._closed.is_set():
            return
        if left is not None and self._last is not None:
            run_id, seq, ordinal, kind = self._last
            if kind is not EventKind.RUN_FINISHED:
                self._left = Event(
                    run_id=run_id, seq=seq, kind=EventKind.RUN_LEFT, text=left, ordinal=ordinal
                )
        self._closed.set()

    def offer(self, event: Event) -> None:
        """Hand ``event`` to every sink's buffer; a full buffer drops it and counts it.

        But for the run's ``run_finished`` event: a full buffer keeps it aside, and the sink
        gets it after the events in its buffer (so a sink that fell behind still closes what
        it keeps open for the run: docs/events.md, "Sinks and subscribers never stall a
        run").
        """
        self._last = (event.run_id, event.seq, event.ordinal, event.kind)
        for index, channel in enumerate(self._inboxes):
            try:
                channel.send_nowait(event)
            except trio.WouldBlock:
                if event.kind is EventKind.RUN_FINISHED:
                    self._finishes[index] = event
                    continue
                self.sink_drops += 1
                self._warn_once(
                    index,
                    "drop",
                    f"sink {_name(self.sinks[index])} fell behind: events for it are dropped "
                    "and counted (sink_drops); the run goes on",
                )
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                self.sink_drops += 1  # the sink's task is gone (cut off after the run)

    @property
    def active(self) -> bool:
        """Whether any sink is fed."""
        return bool(self._inboxes)

    def _warn_once(self, sink_index: int, what: str, text: str) -> None:
        if (sink_index, what) in self._warned:
            return
        self._warned.add((sink_index, what))
        if self.on_warning is not None:
            self.on_warning(text)

    @trio.lowlevel.enable_ki_protection  # Ctrl-C reaches the main task: decision 0097
    async def _pump(
        self, index: int, sink: EventSink, events: trio.MemoryReceiveChannel[Event]
    ) -> None:
        last: EventKind | None = None  # the kind of the last event handed to the sink
        through = False
        async with events:
            try:
                async for first in events:
                    for event in and_buffered(first, events):
                        await self._ready(event)
                        last = event.kind
                        await self._deliver(index, sink, event)
                finish = self._finishes.pop(index, None)  # kept aside by a full buffer
                if finish is not None:
                    await self._ready(finish)
                    last = finish.kind
                    await self._deliver(index, sink, finish)
                through = True
            finally:
                if not through and last is not EventKind.RUN_FINISHED:
                    await self._cut_off(index, sink)
        if self._left is not None:  # after everything in its buffer, whatever its room
            await self._deliver(index, sink, self._left)

    async def _ready(self, event: Event) -> None:
        """Return once ``event`` may go to a sink: the grace not over, the handle reflecting it.

        Past the grace, nothing more goes out, even to a sink whose sends shield themselves
        (docs/events.md, "Sinks and subscribers never stall a run"): taking a burst from a
        buffer yields nowhere, so this looks for the cancellation (`trio.Cancelled`).
        """
        await trio.lowlevel.checkpoint_if_cancelled()
        if self.reflected is not None:
            await self.reflected(event)

    async def _cut_off(self, index: int, sink: EventSink) -> None:
        """Tell ``sink``, cut off before the end of its buffer, that the drive left it.

        A ``run_left`` event reading `CUT_OFF`, with the ``(seq, ordinal)`` of the last event
        offered (so the sink can tell what it missed), delivered shielded for
        `SINK_CUT_GRACE_S` at most: a sink that keeps spans or files open for the run closes
        them, whether the drive was cancelled from outside or the sink's grace ran out
        (docs/events.md, "Sinks and subscribers never stall a run"). Nothing when no event
        was offered.
        """
        if self._last is None:
            return
        run_id, seq, ordinal, _ = self._last
        left = Event(run_id=run_id, seq=seq, kind=EventKind.RUN_LEFT, text=CUT_OFF, ordinal=ordinal)
        with trio.move_on_after(SINK_CUT_GRACE_S, shield=True):
            await self._deliver(index, sink, left)

    async def _deliver(self, index: int, sink: EventSink, event: Event) -> None:
        """Send ``event`` to ``sink``; what it raises is counted, never raised."""
        try:
            await sink.send(event)
        except BaseException as exc:  # a sink's failure never stops the run: counted
            # Not trio's cancellation of this task, nor Ctrl-C or an exit; anything
            # else is (a bridged asyncio exporter's CancelledError included).
            if only_cancelled(exc) or isinstance(exc, KeyboardInterrupt | SystemExit):
                raise
            self.sink_failures += 1
            self._warn_once(
                index,
                "fail",
                f"sink {_name(sink)} failed: {type(exc).__name__}: {message_of(exc)}; its failures "
                "are counted (sink_failures), the run goes on",
            )


@attrs.define(eq=False)
class EventWriter:
    """The event writer actor of one run.

    Args:
        run_id: the run.
        store: the run store.
        next_seq: the seq of the next record (1 for a new run, log length + 1 on resume).
        generation: the run's lease generation, carried by every write (0 for a store
            without leases; docs/fleet.md, "Leases").
        sinks: event sinks, each fed through its own bounded buffer (used when no ``feed``
            is given: the writer then runs its own).
        feed: the run's `SinkFeed`, run by the run supervisor so it outlives this writer.
        redaction: the secret tool arguments, redacted in every event it hands out (the
            records it writes keep them; docs/events.md, "Secret arguments").
        metrics: counts every record the writer appended, once the store holds it
            (docs/metrics.md, "What is counted"); ``None`` counts nothing.
        tools: the names of the run's tools, for the metrics' ``tool`` label (a call to
            another name counts as `treadle.metrics.UNKNOWN_TOOL`; ``None``: as named).
    """

    run_id: str
    store: RunStore
    next_seq: int
    generation: int
    sinks: Sequence[EventSink] = ()
    feed: SinkFeed | None = None
    redaction: Redaction = NO_REDACTION
    metrics: MetricsRecorder | None = None
    tools: frozenset[str] | None = None
    _subscribers: list[trio.MemorySendChannel[Event]] = attrs.field(init=False, factory=list)
    _tail: list[tuple[int, Record]] = attrs.field(init=False, factory=list)
    """Recent durable records with their seqs; a subscriber's tail is made of them."""
    _held: list[tuple[int, Record]] = attrs.field(init=False, factory=list)
    """Records written without a barrier, not yet known durable: their events wait."""
    _shown: int = attrs.field(init=False, default=0)
    """The seq of the last record whose event was handed out (every one before it too)."""
    _delta_ordinal: int = attrs.field(init=False, default=0)
    _own_feed: bool = attrs.field(init=False, default=False)

    def __attrs_post_init__(self) -> None:
        self._shown = self.next_seq - 1  # a resumed run's log is durable
        self._own_feed = self.feed is None
        if self.feed is None:
            self.feed = SinkFeed(sinks=self.sinks)

    @property
    def _feed(self) -> SinkFeed:
        assert self.feed is not None
        return self.feed

    def statistics(self) -> WriterStatistics:
        """Counters of this writer and its sink feed (see `WriterStatistics`)."""
        feed = self._feed
        return WriterStatistics(
            last_seq=self._shown,
            sink_drops=feed.sink_drops,
            sink_failures=feed.sink_failures,
            subscriber_drops=feed.subscriber_drops,
        )

    @trio.lowlevel.enable_ki_protection  # Ctrl-C reaches the main task: decision 0097
    async def run(
        self,
        inbox: MailboxReceiver[WriterRequest],
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Serve requests until ``inbox`` ends; then close every subscriber (and own feed).

        Raises:
            treadle.StoreError: a write failed; the run supervisor ends the run with it.
        """
        feed = self._feed
        async with trio.open_nursery() as nursery:
            if self._own_feed and feed.sinks:  # no task for a feed with nothing to feed
                await nursery.start(feed.run)
            feed.on_warning = self._warn
            task_status.started()
            try:
                # `with`, not `async with`: closing must not checkpoint, or a cancellation
                # arriving there would replace a store error on its way out.
                with inbox:
                    try:
                        async for message in inbox:
                            await self._serve(message)
                        await self._show_held()
                    finally:
                        _refuse_pending(inbox)
            finally:
                await self._show_held_quietly()
                feed.on_warning = None
                for channel in self._subscribers:
                    channel.close()
                self._subscribers.clear()
                self._tail.clear()  # a late subscriber reads the store instead
                if self._own_feed:
                    feed.close()

    async def _serve(self, message: WriterRequest) -> None:
        if isinstance(message, Append):
            await self._append(message)
        elif isinstance(message, Delta):
            self._publish_delta(message)
        elif isinstance(message, Warn):
            self._warn(message.text)
        elif isinstance(message, Forward):
            self._forward(message.event)
        else:
            self._subscribe(message)

    async def _append(self, message: Append) -> None:
        seq = self.next_seq
        records = message.records
        if message.op is StoreOp.RUN_FINISHED:  # the delivery counters are the writer's
            records = tuple(self._stamped(r) for r in records)
        held = self._held
        # Held before the store is asked: a barrier cut while it waits for its batch still
        # commits, and the end of the drive then counts it (`_show_held_quietly`).
        held.extend((seq + offset, record) for offset, record in enumerate(records))
        await _STORE_OPS[message.op](self.store, records, seq, self.generation)
        self.next_seq = seq + len(records)
        if message.op.barrier:  # durable, and every write before it (docs/seams.md)
            self._show(held)
            held.clear()
        if message.reply_to is not None:
            with message.reply_to:
                try:
                    message.reply_to.send_nowait(self.next_seq - 1)
                except trio.BrokenResourceError:
                    pass

    async def _show_held(self) -> None:
        """At the end of the drive: hand out the events still held that the store holds.

        A run that stops without a barrier after its last records (drained between steps,
        parked) would otherwise never show them: the next driver starts after them, and the
        run's sinks would keep a gap. Reading the log waits until the store committed every
        write it acknowledged (docs/seams.md, "Run store"); it happens only when events wait.
        A held write that failed meanwhile (fenced after a takeover, refused, its batch
        failed) is not in the log read, or another driver's records are at its seqs: it and
        the records after it are neither shown nor counted (`stored_prefix`).
        """
        if self._held:
            log = await self.store.read_log(self.run_id)
            self._show(stored_prefix(self._held, log))
            self._held.clear()

    async def _show_held_quietly(self) -> None:
        """At the end of a drive cut from outside or failed: `_show_held`, shielded and bounded.

        A drive cut between two barriers (``move_on_after`` around `treadle.run`, a fleet's
        drain deadline) held records the store holds, or will once their batch commits (a
        barrier cut while it waited for its batch commits all the same): without this read
        they were never counted (docs/metrics.md, "What is counted"). It waits at most
        `END_READ_GRACE_S`; a read that fails or takes longer leaves them uncounted and is
        only logged, never raised over the drive's own cancellation or error. A drive that
        ended by itself has shown its held records already: nothing is read then.
        """
        if not self._held:
            return
        with trio.move_on_after(END_READ_GRACE_S, shield=True):
            try:
                await self._show_held()
            except Exception as exc:  # the drive's own error or cancellation goes on
                _LOG.info(
                    "run %r: the records written at the end of the drive could not be read "
                    "back (%s); they are not counted",
                    self.run_id,
                    message_of(exc),
                )
        self._held.clear()

    def _show(self, durable: list[tuple[int, Record]]) -> None:
        """Count ``durable`` records, hand out their events in order and keep them in the tail.

        An event is handed out only once its record is durable (docs/events.md,
        "Numbering"): a record written without a barrier waits for the run's next barrier,
        so a crash can never take back an event a subscriber or a sink was given. The
        metrics count a record at the same moment, so they count only what the store holds
        (docs/metrics.md, "What is counted"): a write queued and then fenced or failed is
        never counted. Events are built only for someone listening: the tail keeps the
        records, and a subscriber joining later gets their events then (the same events
        either way).
        """
        if self.metrics is not None and durable:
            self.metrics.records((record for _, record in durable), self.tools)
        tail = self._tail
        listening = bool(self._subscribers) or self._feed.active
        if durable:
            self._delta_ordinal = 0
        for seq, record in durable:
            tail.append((seq, record))
            self._shown = seq  # (a sink's warning raised while it is handed out follows it)
            if listening:
                event = durable_event(self.run_id, seq, record, self.redaction)
                for published in with_step_started((event,)):
                    self._fan_out(published)
        if len(tail) > 2 * TAIL_KEEP:
            del tail[:-TAIL_KEEP]

    def _stamped(self, record: Record) -> Record:
        """A run-finished record with this run's delivery counters in this process."""
        if not isinstance(record, RunFinished):
            return record
        feed = self._feed
        return attrs.evolve(
            record,
            sink_drops=feed.sink_drops,
            sink_failures=feed.sink_failures,
            subscriber_drops=feed.subscriber_drops,
        )

    def _publish_delta(self, message: Delta) -> None:
        """Number ``message`` after the last durable event and fan it out (never blocks).

        Nobody listening (no subscriber, no sink): dropped. So is a text delta of a run whose
        tools declare secret arguments (`Redaction.streams`; docs/events.md, "Secret
        arguments").
        """
        if not self._subscribers and not self._feed.active:
            return
        if not self.redaction.streams(message.channel):
            return
        self._delta_ordinal += 1
        kind = EventKind.TEXT_DELTA if message.channel == "text" else EventKind.REASONING_DELTA
        self._fan_out(
            Event(
                run_id=self.run_id,
                seq=self._shown,
                kind=kind,
                text=message.text,
                ordinal=self._delta_ordinal,
            )
        )

    def _fan_out(self, event: Event) -> None:
        self._to_subscribers(event)
        self._feed.offer(event)

    def _to_subscribers(self, event: Event) -> None:
        """Hand ``event`` to every live subscriber (never blocks).

        One whose buffer is full fell behind: it is cut off and counted
        (``subscriber_drops``). One that closed its end left on purpose (a reader that
        stopped iterating, a closed browser tab): it is dropped without being counted, as
        `_subscribe` drops it (docs/events.md, "Sinks and subscribers never stall a run").
        """
        for channel in self._subscribers[:]:
            try:
                channel.send_nowait(event)
            except trio.WouldBlock:
                self._subscribers.remove(channel)
                channel.close()
                self._feed.subscriber_drops += 1
            except trio.BrokenResourceError:  # its reader left: not cut off, not counted
                self._subscribers.remove(channel)
                channel.close()

    def _warn(self, text: str) -> None:
        """Tell the live subscribers that a sink is in trouble (never the sinks).

        A warning takes the ``(seq, ordinal)`` of the event before it, so it never pushes a
        later step-started event (whose ordinal is always 1) out of order.
        """
        self._to_subscribers(
            Event(
                run_id=self.run_id,
                seq=self._shown,
                kind=EventKind.WARNING,
                text=text,
                ordinal=self._delta_ordinal,
            )
        )

    def _forward(self, event: Event) -> None:
        """Hand another run's event (a child run's) to the live subscribers.

        It keeps its own run id and seq; nothing is stored in this run's log, and the sinks
        are not fed (the child run feeds its own). docs/child-runs.md, "Events".
        """
        if event.run_id != self.run_id:
            self._to_subscribers(event)

    def _subscribe(self, message: Subscribe) -> None:
        # Subscribers that left are dropped here too, not only at the next event: a client
        # reconnecting again and again to a run that is quiet for long (a long tool call, an
        # approval wait) must not pile up channels.
        self._subscribers[:] = [c for c in self._subscribers if _listened(c)]
        send, recv = trio.open_memory_channel[Event](SUBSCRIBER_BUFFER)
        self._subscribers.append(send)
        tail = tuple(
            durable_event(self.run_id, seq, record, self.redaction) for seq, record in self._tail
        )
        answer = Subscription(last_seq=self._shown, tail=tail, events=recv)
        with message.reply_to:
            try:
                message.reply_to.send_nowait(answer)
            except trio.BrokenResourceError:
                self._subscribers.remove(send)
                send.close()


def stored_prefix(held: list[tuple[int, Record]], log: RunLog) -> list[tuple[int, Record]]:
    """The records of ``held`` (``(seq, record)`` in seq order) that ``log`` holds, from the first.

    A run's writes become durable in seq order (prefix durability, docs/design.md), so once one of
    them is missing from ``log``, or another record is at its seq (a driver that took the run
    over wrote there), neither it nor any record after it was stored by this writer.
    """
    records = log.records
    for index, (seq, record) in enumerate(held):
        if seq > len(records) or records[seq - 1] != record:
            return held[:index]
    return held


def _listened(channel: trio.MemorySendChannel[Event]) -> bool:
    """Whether the subscriber behind ``channel`` is still there (else it is closed here)."""
    if channel.statistics().open_receive_channels:
        return True
    channel.close()
    return False


def _name(sink: EventSink) -> str:
    return type(sink).__name__


def check_from_seq(from_seq: object) -> None:
    """Refuse a ``from_seq`` that is no seq: events are numbered from 1, in whole numbers.

    Raises:
        UsageError: ``from_seq`` is not an ``int`` (a ``bool`` neither) or is below 1.
    """
    if not isinstance(from_seq, int) or isinstance(from_seq, bool):
        raise UsageError(f"from_seq must be a whole number, not {from_seq!r}")
    if from_seq < 1:
        raise UsageError(f"events are numbered from 1; from_seq={from_seq} was asked")


def resume_from(from_seq: int | None, after: tuple[int, int] | None) -> tuple[int, tuple[int, int]]:
    """The first seq to read and the ``(seq, ordinal)`` every yielded event must follow.

    ``after`` is the ``(seq, ordinal)`` of the last event a reader saw (docs/events.md,
    "Reading events"): the events after it are read from its seq on, so the step-started
    event that shares the seq of the durable event before it comes after that event
    (docs/decisions/0107-resume-after-seq-and-ordinal.md). Without it, the events from
    ``from_seq`` on: every one with a seq of ``from_seq`` or more (``None``: from 1).

    Raises:
        UsageError: ``from_seq`` is no seq (`check_from_seq`); ``after`` is not two whole
            numbers of 0 or more; both are given (``from_seq=1`` too).
    """
    if from_seq is not None:
        check_from_seq(from_seq)
    if after is None:
        first = 1 if from_seq is None else from_seq
        return first, (first - 1, 0)
    if not (
        isinstance(after, tuple)
        and len(after) == 2
        and all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in after)
    ):
        raise UsageError(f"after must be a (seq, ordinal) of whole numbers >= 0, not {after!r}")
    if from_seq is not None:
        raise UsageError("give from_seq or after, not both")
    seq, ordinal = after
    return max(seq, 1), (seq, ordinal)


def stored_events(log: RunLog, from_seq: int, to_seq: int) -> list[Event]:
    """The durable events of ``log`` with seqs ``from_seq`` to ``to_seq`` (both included).

    Secret arguments are redacted as the log's snapshots declare (`Redaction.of_log`).

    Raises:
        StoreError: fewer than ``to_seq`` records are readable.
    """
    if to_seq > len(log.records):
        raise StoreError(
            f"run {log.run_id!r}: events up to seq {to_seq} requested but only "
            f"{len(log.records)} are readable"
        )
    redaction = Redaction.of_log(log)
    durable = [
        durable_event(log.run_id, seq, record, redaction)
        for seq, record in enumerate(log.records[from_seq - 1 : to_seq], start=from_seq)
    ]
    return [e for e in with_step_started(durable) if e.seq >= from_seq]


def durable_event(
    run_id: str, seq: int, record: Record, redaction: Redaction = NO_REDACTION
) -> Event:
    """The durable event of ``record`` at ``seq``, its secret arguments redacted."""
    shown = redaction.record(record)
    return Event(run_id=run_id, seq=seq, kind=EVENT_KIND[type(record)], record=shown)


def with_step_started(events: Iterable[Event]) -> Iterator[Event]:
    """``events`` with a step-started event before the first model intent of each step.

    The step-started event is derived from the log, the same way live and when read back
    (docs/decisions/0008): it precedes each `ModelIntent` with ``attempt == 1`` and carries
    the seq of the durable event before that intent, with ordinal 1. Callers filter by seq:
    the step-started event of an intent at ``from_seq`` has seq ``from_seq - 1``.
    """
    for event in events:
        record = event.record
        if isinstance(record, ModelIntent) and record.attempt == 1:
            yield Event(
                run_id=event.run_id,
                seq=event.seq - 1,
                kind=EventKind.STEP_STARTED,
                ordinal=1,
                step=record.step,
            )
        yield event


def _refuse_pending(inbox: MailboxReceiver[WriterRequest]) -> None:
    """Close the reply channels of requests still queued when the writer stops.

    Their requesters then see `trio.EndOfChannel` instead of waiting forever.
    """
    while True:
        try:
            message = inbox.receive_nowait()
        except (trio.WouldBlock, trio.EndOfChannel, trio.ClosedResourceError):
            return
        reply_to = getattr(message, "reply_to", None)
        if reply_to is not None:
            reply_to.close()


async def _write_started(store: RunStore, records: tuple[Record, ...], seq: int, gen: int) -> None:
    (record,) = records
    assert isinstance(record, RunStarted)
    await store.write_run_started(record, seq=seq, generation=gen)


async def _write_intent(store: RunStore, records: tuple[Record, ...], seq: int, gen: int) -> None:
    (record,) = records
    assert isinstance(record, ModelIntent | ActionIntent)
    await store.write_intent(record, seq=seq, generation=gen)


async def _write_model_result(
    store: RunStore, records: tuple[Record, ...], seq: int, gen: int
) -> None:
    (record,) = records
    assert isinstance(record, ModelResult)
    await store.write_model_result(record, seq=seq, generation=gen)


async def _write_step(store: RunStore, records: tuple[Record, ...], seq: int, gen: int) -> None:
    *results, step = records
    assert isinstance(step, StepRecord)
    actions = [r for r in results if isinstance(r, ActionResult)]
    assert len(actions) == len(results)
    await store.write_step(actions or None, step, seq=seq, generation=gen)


async def _write_control(store: RunStore, records: tuple[Record, ...], seq: int, gen: int) -> None:
    (record,) = records
    assert isinstance(record, ControlRecord)
    await store.write_control(record, seq=seq, generation=gen)


async def _write_finished(store: RunStore, records: tuple[Record, ...], seq: int, gen: int) -> None:
    (record,) = records
    assert isinstance(record, RunFinished)
    await store.write_run_finished(record, seq=seq, generation=gen)


_STORE_OPS = {
    StoreOp.RUN_STARTED: _write_started,
    StoreOp.INTENT: _write_intent,
    StoreOp.MODEL_RESULT: _write_model_result,
    StoreOp.STEP: _write_step,
    StoreOp.CONTROL: _write_control,
    StoreOp.RUN_FINISHED: _write_finished,
}


@attrs.frozen
class WriterClient:
    """How the other actors reach a run's event writer: messages into its inbox, nothing else.

    Args:
        inbox: the writer's inbox.
    """

    inbox: MailboxSender[WriterRequest]

    async def write(self, op: StoreOp, *records: Record) -> None:
        """Queue a non-barrier write; returns once the writer's inbox took it.

        Room in the inbox takes the write at once, without a checkpoint (nothing waits for a
        non-barrier write, and the next barrier of the run follows it); a full inbox waits
        for room.
        """
        await self.inbox.send(Append(op=op, records=records))

    async def barrier(self, op: StoreOp, *records: Record) -> int:
        """Write and wait until durable (with everything written before it).

        Returns:
            The seq of the last record written.

        Raises:
            trio.EndOfChannel: the writer failed before answering (its error ends the run).
        """
        pending = await self.send_barrier(op, *records)
        return await pending.receive()

    async def send_barrier(self, op: StoreOp, *records: Record) -> ReplySlot[int]:
        """Hand a barrier write to the writer; await the returned slot's ``receive()``.

        Once this returns, the write is queued and will happen even if the caller is then
        cancelled (so a cancelled caller knows whether its intent may be in the log). The
        slot's ``receive()`` returns the seq of the last record once the write is durable,
        or raises `trio.EndOfChannel` when the writer failed before answering.
        """
        slot: ReplySlot[int] = ReplySlot()
        await self.inbox.send(Append(op=op, records=records, reply_to=slot))
        return slot

    def delta(self, channel: str, text: str) -> None:
        """Offer an ephemeral delta (never blocks): dropped when the inbox is full or closed.

        The writer numbers it after the durable events written before it and drops it when
        nobody listens (docs/events.md, "Reading events").
        """
        self._offer(Delta(channel=channel, text=text))

    def warn(self, text: str) -> None:
        """Offer a live warning event to the run's subscribers (never stored, never blocks).

        Dropped when the inbox is full or the writer is gone (a call abandoned by a run that
        has ended: the tool host logs it anyway, docs/decisions/0025-tool-host.md).
        """
        self._offer(Warn(text=text))

    def forward(self, event: Event) -> None:
        """Offer a child run's event to this run's live subscribers (never blocks).

        It keeps its own run id and seq and is never stored here (docs/child-runs.md,
        "Events"); dropped when the inbox is full or the writer is gone.
        """
        self._offer(Forward(event=event))

    async def subscribe(self) -> Subscription:
        """Join the live event stream (see `Subscription`).

        Raises:
            trio.EndOfChannel: the writer stopped before answering.
        """
        slot: ReplySlot[Subscription] = ReplySlot()
        await self.inbox.send(Subscribe(reply_to=slot))
        return await slot.receive()

    def _offer(self, message: WriterRequest) -> None:
        try:
            self.inbox.send_nowait(message)
        except (trio.WouldBlock, trio.BrokenResourceError, trio.ClosedResourceError):
            pass  # best effort by definition: live-only, never stored
