"""The event writer alone: a real `EventWriter` on a memory store, driven through its inbox.

Nothing else of a run is started: the test plays the other actors through a `WriterClient`
(docs/design.md, "The five actors").
"""

from __future__ import annotations

import pytest
import trio
import trio.testing
from actor_fakes import TS, started

from treadle._exceptions import LeaseLost, StoreError
from treadle.actors import (
    SUBSCRIBER_BUFFER,
    Append,
    EventWriter,
    ReplySlot,
    WriterClient,
    WriterRequest,
    open_mailbox,
)
from treadle.metrics import MetricsRecorder
from treadle.ports import LeaseStore, RunStore
from treadle.stores.memory import MemoryStore
from treadle.stores.sqlite import open_sqlite_store
from treadle.testing import FailingStore
from treadle.types import (
    EventKind,
    ModelIntent,
    ModelReply,
    ModelResult,
    Record,
    RunFinished,
    RunState,
    StopReason,
    StoreOp,
    Totals,
)


def _intent(step: int, attempt: int = 1) -> ModelIntent:
    return ModelIntent(
        run_id="r", step=step, intent_id=f"r/s{step}/m{attempt}", attempt=attempt, ts=TS
    )


async def _start(nursery: trio.Nursery, store: RunStore) -> tuple[WriterClient, EventWriter]:
    """A writer of run ``r`` under a lease of ``store``, started in ``nursery``, and its client."""
    assert isinstance(store, LeaseStore)
    lease = await store.acquire_lease("r", owner="test", ttl_s=3600.0)
    writer = EventWriter(run_id="r", store=store, next_seq=1, generation=lease.generation)
    send, recv = open_mailbox[WriterRequest](64)
    await nursery.start(writer.run, recv)
    return WriterClient(inbox=send), writer


async def test_writes_get_gapless_seqs_and_a_barrier_answers_once_durable():
    store = MemoryStore()
    async with trio.open_nursery() as nursery:
        client, writer = await _start(nursery, store)
        assert await client.barrier(StoreOp.RUN_STARTED, started()) == 1
        await client.write(StoreOp.INTENT, _intent(1))
        await client.write(StoreOp.INTENT, _intent(1, 2))
        seq = await client.barrier(StoreOp.INTENT, _intent(1, 3))
        assert seq == 4
        # the barrier came back after the writes queued before it were stored
        log = await store.read_log("r")
        assert [r.intent_id for r in log.records[1:]] == ["r/s1/m1", "r/s1/m2", "r/s1/m3"]
        assert writer.statistics().last_seq == 4
        client.inbox.close()


async def test_a_subscriber_gets_the_tail_then_later_events_and_deltas_in_order():
    async with trio.open_nursery() as nursery:
        client, _ = await _start(nursery, MemoryStore())
        await client.barrier(StoreOp.RUN_STARTED, started())
        await client.barrier(StoreOp.INTENT, _intent(1))
        subscription = await client.subscribe()
        assert subscription.last_seq == 2
        assert [e.kind for e in subscription.tail] == [
            EventKind.RUN_STARTED,
            EventKind.MODEL_CALL_STARTED,
        ]
        await client.barrier(StoreOp.INTENT, _intent(1, 2))
        client.delta("text", "Hel")
        client.delta("text", "lo")
        await client.barrier(StoreOp.INTENT, _intent(1, 3))
        client.inbox.close()
        seen = [(e.seq, e.kind, e.ordinal, e.text) async for e in subscription.events]
    kinds = [(seq, kind) for seq, kind, _, _ in seen]
    assert (3, EventKind.MODEL_CALL_STARTED) in kinds and (4, EventKind.MODEL_CALL_STARTED) in kinds
    deltas = [
        (seq, ordinal, text) for seq, kind, ordinal, text in seen if kind is EventKind.TEXT_DELTA
    ]
    assert deltas == [(3, 1, "Hel"), (3, 2, "lo")]  # numbered after the last durable event
    assert kinds.index((4, EventKind.MODEL_CALL_STARTED)) > len(kinds) - 2  # the stream ended last


async def test_the_event_of_a_record_written_without_a_barrier_waits_for_the_next_barrier():
    """A subscriber was shown a model reply and a final-answer step that a crash then took
    back (the records were queued, not yet durable): after the resume, reading on from the
    last seq it saw skipped the abandonment and the new attempt. Now an event is handed out
    once its record is durable: with the run's next barrier."""
    async with trio.open_nursery() as nursery:
        client, writer = await _start(nursery, MemoryStore())
        subscription = await client.subscribe()
        await client.barrier(StoreOp.RUN_STARTED, started())  # queued, not durable
        assert writer.statistics().last_seq == 0
        await client.barrier(StoreOp.INTENT, _intent(1))  # a barrier: both are durable
        assert writer.statistics().last_seq == 2
        client.inbox.close()
        seen = [(e.seq, e.kind) async for e in subscription.events]
    assert seen == [
        (1, EventKind.RUN_STARTED),
        (1, EventKind.STEP_STARTED),
        (2, EventKind.MODEL_CALL_STARTED),
    ]


async def test_a_subscriber_that_falls_behind_is_cut_off_and_counted():
    async with trio.open_nursery() as nursery:
        client, writer = await _start(nursery, MemoryStore())
        await client.barrier(StoreOp.RUN_STARTED, started())
        subscription = await client.subscribe()
        for _ in range(SUBSCRIBER_BUFFER + 1):
            client.delta("text", "x")
            await trio.lowlevel.checkpoint()  # the writer takes it (its inbox is smaller)
        await client.barrier(StoreOp.INTENT, _intent(1))
        received = [event async for event in subscription.events]  # ends: it was cut off
        assert len(received) == SUBSCRIBER_BUFFER
        assert writer.statistics().subscriber_drops == 1
        client.inbox.close()


async def test_a_failed_store_write_fails_the_writer_and_refuses_what_is_queued():
    store = FailingStore(inner=MemoryStore(), fail_at=2)
    lease = await store.acquire_lease("r", owner="test", ttl_s=3600.0)
    writer = EventWriter(run_id="r", store=store, next_seq=1, generation=lease.generation)
    send, recv = open_mailbox[WriterRequest](64)
    client = WriterClient(inbox=send)
    failures: list[BaseException] = []

    async def serve() -> None:  # the writer's error, kept instead of cancelling the test
        try:
            await writer.run(recv)
        except BaseExceptionGroup as group:
            failures.append(group)

    answers: list[object] = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(serve)
        await client.barrier(StoreOp.RUN_STARTED, started())
        replies = []
        # all three queued before the writer runs; the first one's write fails
        for intent in (_intent(1), _intent(1, 2), _intent(1, 3)):
            slot = ReplySlot[int]()
            send.send_nowait(Append(op=StoreOp.INTENT, records=(intent,), reply_to=slot))
            replies.append(slot)
        # The request whose write failed is left unanswered: in a run, the writer's failure
        # cancels the nursery its requester runs in (docs/design.md, "The five actors").
        for reply in replies[1:]:
            try:
                answers.append(await reply.receive())
            except trio.EndOfChannel:
                answers.append("refused")
    assert answers == ["refused", "refused"]  # nobody waits forever on a failed writer
    (group,) = failures
    assert pytest.RaisesGroup(
        pytest.RaisesExc(StoreError, match="no space"), flatten_subgroups=True
    ).matches(group)
    assert len((await store.inner.read_log("r")).records) == 1


async def test_ending_the_inbox_ends_the_writer_and_closes_every_subscription():
    async with trio.open_nursery() as nursery:
        client, _ = await _start(nursery, MemoryStore())
        await client.barrier(StoreOp.RUN_STARTED, started())  # no barrier: its event waits
        first, second = await client.subscribe(), await client.subscribe()
        assert first.tail == second.tail == ()
        client.inbox.close()  # the drive's end: what waited is handed out, then they close
        assert [e.kind async for e in first.events] == [EventKind.RUN_STARTED]
        assert [e.kind async for e in second.events] == [EventKind.RUN_STARTED]


async def test_a_cancelled_barrier_requester_still_gets_its_write_done():
    """`send_barrier` hands the write over; a caller cancelled afterwards does not undo it."""
    store = MemoryStore()
    async with trio.open_nursery() as nursery:
        client, _ = await _start(nursery, store)
        await client.barrier(StoreOp.RUN_STARTED, started())
        with trio.CancelScope() as scope:
            pending = await client.send_barrier(StoreOp.INTENT, _intent(1))
            scope.cancel()
            await pending.receive()
        assert scope.cancelled_caught
        pending.abandon()  # the requester stops waiting (its receive was cancelled)
        assert await client.barrier(StoreOp.INTENT, _intent(1, 2)) == 3
        client.inbox.close()
    records: tuple[Record, ...] = (await store.read_log("r")).records
    assert [getattr(r, "intent_id", None) for r in records] == [None, "r/s1/m1", "r/s1/m2"]


async def test_a_bad_request_fails_the_writer_with_the_record_it_could_not_write():
    """An `Append` whose records do not fit its store operation is a bug, not a write."""
    with pytest.RaisesGroup(AssertionError, flatten_subgroups=True):
        async with trio.open_nursery() as nursery:
            client, _ = await _start(nursery, MemoryStore())
            await client.inbox.send(Append(op=StoreOp.RUN_STARTED, records=(_intent(1),)))
            await trio.sleep_forever()


async def test_a_writer_whose_lease_was_taken_over_cannot_write():
    """Fencing: the store refuses the old generation's write, and the writer fails with it."""
    store = MemoryStore()
    with pytest.RaisesGroup(LeaseLost, flatten_subgroups=True):
        async with trio.open_nursery() as nursery:
            client, _ = await _start(nursery, store)
            await client.barrier(StoreOp.RUN_STARTED, started())
            lease = await store.acquire_lease("r", owner="test", ttl_s=3600.0)
            await store.release_lease(lease)
            thief = await store.acquire_lease("r", owner="another", ttl_s=3600.0)
            assert thief.generation > lease.generation
            with pytest.raises(trio.EndOfChannel):
                await client.barrier(StoreOp.INTENT, _intent(1))
    assert len((await store.read_log("r")).records) == 1


async def test_a_writer_without_sinks_runs_in_one_task():
    # No task waits to feed sinks a run does not have (each task is memory and
    # scheduling every run pays: docs/performance.md, "Memory").
    async with trio.open_nursery() as nursery:
        await _start(nursery, MemoryStore())
        (writer_task,) = nursery.child_tasks
        assert [n.child_tasks for n in writer_task.child_nurseries] == [frozenset()]
        nursery.cancel_scope.cancel()


async def test_subscribers_that_left_do_not_pile_up_while_the_run_is_quiet():
    # A client reconnecting again and again while the run writes nothing (a long tool call,
    # an approval wait): each one that left is dropped when the next one joins.
    async with trio.open_nursery() as nursery:
        client, writer = await _start(nursery, MemoryStore())
        await client.barrier(StoreOp.RUN_STARTED, started())
        staying = await client.subscribe()
        for _ in range(50):
            leaving = await client.subscribe()
            await leaving.events.aclose()
        assert len(writer._subscribers) == 2  # the one staying, and the last to leave
        seq = await client.barrier(StoreOp.INTENT, _intent(1))
        # run-started became durable with this barrier: its event comes first
        events = [await staying.events.receive() for _ in range(3)]
        assert [(e.seq, e.kind) for e in events if e.durable] == [
            (1, EventKind.RUN_STARTED),
            (seq, EventKind.MODEL_CALL_STARTED),
        ]
        client.inbox.close()


async def test_a_sink_that_keeps_up_takes_a_burst_of_deltas_in_one_pass():
    """A no-op sink was reported as fallen behind and lost most deltas of a fast stream: its
    task took one event per scheduler pass while the writer handed it hundreds per pass.
    Here 6 bursts of 100 deltas, one pass apart (trio may run the writer twice before the
    sink's task: two bursts fit its 256-event buffer)."""
    from treadle.actors import SinkFeed
    from treadle.types import Event

    got: list[int] = []

    class Noop:
        async def send(self, event: Event) -> None:
            got.append(event.ordinal)

    feed = SinkFeed(sinks=[Noop()])
    async with trio.open_nursery() as nursery:
        await nursery.start(feed.run)
        await trio.testing.wait_all_tasks_blocked()  # the sink's task waits for events
        ordinal = 0
        for _ in range(6):
            for _ in range(100):
                ordinal += 1
                feed.offer(
                    Event(run_id="r", seq=2, kind=EventKind.TEXT_DELTA, text="x", ordinal=ordinal)
                )
            await trio.lowlevel.checkpoint()  # one scheduler pass
        await feed.aclose()
    assert feed.sink_drops == 0
    assert got == list(range(1, 601))


async def test_a_sink_whose_sends_shield_themselves_gets_nothing_more_after_the_grace(
    autojump_clock,
):
    """A sink whose every send waited 1 s in a shielded scope was fed every buffered event
    after the 2 s grace (a run ended some 23 s after it finished): its task took the events
    its buffer held without a checkpoint between them. Now the grace cuts it at its next
    delivery: it holds the end for the send in flight only."""
    from treadle.actors import SinkFeed
    from treadle.types import Event

    got: list[int] = []

    class Shielded:
        async def send(self, event: Event) -> None:
            with trio.CancelScope(shield=True):
                await trio.sleep(0.75)  # the grace (2 s) ends in the third send
            if event.kind is EventKind.TEXT_DELTA:  # (then it is told it was cut off)
                got.append(event.ordinal)

    feed = SinkFeed(sinks=[Shielded()])
    async with trio.open_nursery() as nursery:
        await nursery.start(feed.run)
        for ordinal in range(1, 11):
            feed.offer(
                Event(run_id="r", seq=2, kind=EventKind.TEXT_DELTA, text="x", ordinal=ordinal)
            )
        await feed.aclose()
    assert got == [1, 2, 3]


async def test_a_sink_cut_off_with_its_drive_is_told_so_at_once():
    """A drive cancelled from outside cut its sinks off without a word: a sink that keeps
    spans open for a run (the OpenTelemetry sink) kept them for good. It now gets a run-left
    event reading ``cut_off`` at once, after the event it was handed last, with the
    ``(seq, ordinal)`` of the last event offered; the rest of its buffer is not delivered."""
    from treadle.actors import SinkFeed
    from treadle.types import Event

    got: list[Event] = []
    taken = trio.Event()

    class Stuck:
        async def send(self, event: Event) -> None:
            got.append(event)
            if event.kind is EventKind.TEXT_DELTA:
                taken.set()
                await trio.sleep_forever()  # a slow exporter: cancellable

    feed = SinkFeed(sinks=[Stuck()])
    with trio.fail_after(10):
        with trio.CancelScope() as drive:
            async with trio.open_nursery() as nursery:
                await nursery.start(feed.run)
                for ordinal in range(1, 6):
                    feed.offer(
                        Event(
                            run_id="r", seq=2, kind=EventKind.TEXT_DELTA, text="x", ordinal=ordinal
                        )
                    )
                await taken.wait()
                drive.cancel()
    assert [(e.kind, e.seq, e.ordinal, e.text) for e in got] == [
        (EventKind.TEXT_DELTA, 2, 1, "x"),
        (EventKind.RUN_LEFT, 2, 5, "cut_off"),
    ]


async def test_a_sink_whose_full_buffer_dropped_the_runs_end_gets_it_after_its_buffer():
    """A sink that fell behind lost the run's ``run_finished`` with the rest of the events its
    full buffer dropped, and, the run being finished, got no ``run_left`` either: what it
    kept open for the run (the OpenTelemetry sink's spans) stayed open for good. The run's
    end is now kept aside and handed to it after its buffer, and not counted as dropped."""
    from treadle.actors import SINK_BUFFER, SinkFeed
    from treadle.types import Event

    got: list[Event] = []
    gate = trio.Event()

    class Late:
        async def send(self, event: Event) -> None:
            await gate.wait()  # an exporter's first connection, say
            got.append(event)

    feed = SinkFeed(sinks=[Late()])
    async with trio.open_nursery() as nursery:
        await nursery.start(feed.run)
        offered = SINK_BUFFER + 10  # one in the sink's hands, 256 buffered, 9 dropped
        for ordinal in range(1, offered + 1):
            feed.offer(
                Event(run_id="r", seq=2, kind=EventKind.TEXT_DELTA, text="x", ordinal=ordinal)
            )
            if ordinal == 1:
                await trio.testing.wait_all_tasks_blocked()  # the sink took the first
        feed.offer(Event(run_id="r", seq=3, kind=EventKind.RUN_FINISHED))
        gate.set()
        await feed.aclose(left="drained")  # finished: no run-left event follows
    assert feed.sink_drops == offered - 1 - SINK_BUFFER
    assert [e.ordinal for e in got[:-1]] == list(range(1, SINK_BUFFER + 2))
    assert (got[-1].kind, got[-1].seq) == (EventKind.RUN_FINISHED, 3)


# ------------------------------------------------------------- metrics count what is stored


class _Counts:
    """A metrics output that keeps each counter's total by metric name."""

    def __init__(self) -> None:
        self.added: dict[str, float] = {}

    def add(self, metric, value: float, labels: tuple[str, ...]) -> None:
        self.added[metric.prometheus] = self.added.get(metric.prometheus, 0) + value

    def set(self, metric, value: float, labels: tuple[str, ...]) -> None:
        pass

    observe = set


async def _fenced_writer(
    nursery: trio.Nursery, store: RunStore, counts: _Counts
) -> tuple[WriterClient, EventWriter]:
    """A writer whose run ``r`` was started, then taken over by another driver."""
    assert isinstance(store, LeaseStore)
    lease = await store.acquire_lease("r", owner="paused", ttl_s=3600.0)
    writer = EventWriter(
        run_id="r",
        store=store,
        next_seq=1,
        generation=lease.generation,
        metrics=MetricsRecorder(outputs=(counts,)),
    )
    send, recv = open_mailbox[WriterRequest](64)
    await nursery.start(writer.run, recv)
    client = WriterClient(inbox=send)
    await client.write(StoreOp.RUN_STARTED, started())
    await client.barrier(StoreOp.INTENT, _intent(1))
    await store.release_lease(lease)  # the paused driver's lease went to another one
    thief = await store.acquire_lease("r", owner="another", ttl_s=3600.0)
    assert thief.generation > lease.generation
    return client, writer


def _result() -> ModelResult:
    return ModelResult(run_id="r", step=1, intent_id="r/s1/m1", ts=TS, reply=ModelReply(text="hi"))


async def test_a_fenced_write_queued_without_a_barrier_is_not_counted(tmp_path):
    """A worker woken from a pause past its lease's TTL counted the model results and steps
    it queued (non-barrier writes return once queued) that fencing then kept out of the
    store. A record is now counted once the store holds it: with the run's next barrier."""
    counts = _Counts()
    async with open_sqlite_store(tmp_path / "runs.db") as store:
        with pytest.RaisesGroup(LeaseLost, flatten_subgroups=True):
            async with trio.open_nursery() as nursery:
                client, _ = await _fenced_writer(nursery, store, counts)
                await client.write(StoreOp.MODEL_RESULT, _result())  # queued: it returns
                await client.barrier(StoreOp.INTENT, _intent(2))  # fenced, with the result
        assert len((await store.read_log("r")).records) == 2
    assert counts.added == {"treadle_runs_started": 1}


async def test_a_fenced_write_left_at_the_end_of_a_drive_is_neither_counted_nor_shown(
    tmp_path,
):
    """A drive ending with a non-barrier write in flight shows it once it is read back; one
    that fencing kept out of the store is not in the log: no event, no count."""
    counts = _Counts()
    async with open_sqlite_store(tmp_path / "runs.db") as store:
        async with trio.open_nursery() as nursery:
            client, writer = await _fenced_writer(nursery, store, counts)
            subscription = await client.subscribe()
            await client.write(StoreOp.MODEL_RESULT, _result())  # queued, then fenced
            client.inbox.close()  # the drive ends (drained between steps, say)
            assert [e.kind async for e in subscription.events] == []
        assert writer.statistics().last_seq == 2
        assert len((await store.read_log("r")).records) == 2
    assert counts.added == {"treadle_runs_started": 1}


async def test_a_write_stored_without_a_barrier_is_counted_at_the_end_of_the_drive(tmp_path):
    counts = _Counts()
    async with open_sqlite_store(tmp_path / "runs.db") as store:
        async with trio.open_nursery() as nursery:
            client, writer = await _start(nursery, store)
            writer.metrics = MetricsRecorder(outputs=(counts,))
            await client.write(StoreOp.RUN_STARTED, started())
            await client.barrier(StoreOp.INTENT, _intent(1))
            await client.write(StoreOp.MODEL_RESULT, _result())
            assert counts.added == {"treadle_runs_started": 1}  # not yet durable
            client.inbox.close()
        assert writer.statistics().last_seq == 3
    assert counts.added == {"treadle_runs_started": 1, "treadle_model_attempts": 1}


async def test_a_subscriber_that_stops_reading_on_purpose_is_not_counted_as_cut_off():
    """A reader that left `handle.events()` after two events was counted as a subscriber
    cut off for falling behind (``subscriber_drops``, printed by `treadle show`); with three
    such readers the count was 2, the last one being dropped silently when a later one
    joined. A reader that left is now dropped without being counted, however it is found."""
    async with trio.open_nursery() as nursery:
        client, writer = await _start(nursery, MemoryStore())
        await client.barrier(StoreOp.RUN_STARTED, started())
        for _ in range(3):
            leaving = await client.subscribe()
            await client.barrier(StoreOp.INTENT, _intent(1))
            await leaving.events.receive()
            await leaving.events.aclose()
        await client.barrier(StoreOp.INTENT, _intent(2))  # finds the last one gone
        assert writer._subscribers == []
        assert writer.statistics().subscriber_drops == 0
        client.inbox.close()


async def test_the_records_a_drive_cut_from_outside_stored_are_counted():
    """A drive cut by a cancel scope from outside (``move_on_after`` around `treadle.run`)
    between two barriers never counted the model results and steps it had stored: they were
    counted with the next barrier or at the drive's end, and a cut drive reached neither.
    Its end now reads them back (shielded) and counts what the store holds."""
    counts = _Counts()
    store = MemoryStore()
    with trio.CancelScope() as drive:
        async with trio.open_nursery() as nursery:
            client, writer = await _start(nursery, store)
            writer.metrics = MetricsRecorder(outputs=(counts,))
            await client.write(StoreOp.RUN_STARTED, started())
            await client.barrier(StoreOp.INTENT, _intent(1))
            await client.barrier(StoreOp.INTENT, _intent(1))  # everything before it is taken
            await client.write(StoreOp.MODEL_RESULT, _result())
            await trio.testing.wait_all_tasks_blocked()  # the writer stored it
            drive.cancel()
    assert len((await store.read_log("r")).records) == 4
    assert counts.added == {"treadle_runs_started": 1, "treadle_model_attempts": 1}


class _BatchNeverHandedBack(MemoryStore):
    """A store whose run-finished write is stored, and its batch then never handed back."""

    async def write_run_finished(self, record: RunFinished, *, seq: int, generation: int) -> None:
        await super().write_run_finished(record, seq=seq, generation=generation)
        await trio.sleep_forever()


async def test_a_barrier_cut_while_it_waits_for_its_batch_is_counted_once_stored():
    # A barrier cut while it waits for its batch stays queued and commits all the same
    # (docs/seams.md, "Run store"): the end of the drive finds it in the log and counts it.
    counts = _Counts()
    store = _BatchNeverHandedBack()
    finished = RunFinished(
        run_id="r",
        ts=TS,
        state=RunState.SUCCEEDED,
        stop_reason=StopReason.FINAL_ANSWER,
        totals=Totals(),
    )
    with trio.CancelScope() as drive:
        async with trio.open_nursery() as nursery:
            client, writer = await _start(nursery, store)
            writer.metrics = MetricsRecorder(outputs=(counts,))
            await client.write(StoreOp.RUN_STARTED, started())
            await client.send_barrier(StoreOp.RUN_FINISHED, finished)
            await trio.testing.wait_all_tasks_blocked()  # stored, waiting for its batch
            drive.cancel()
    assert len((await store.read_log("r")).records) == 2
    assert counts.added == {"treadle_runs_started": 1, "treadle_runs_finished": 1}
