"""Reading a run's control stream (cancels and approval decisions of other processes).

Each driven run's control stream is read every ``control_poll_s`` (docs/decisions/0007). With
thousands of runs in one process that would be thousands of store reads a second, almost all
of empty streams. So the runs of one store share a `ControlIndex`: one
`treadle.ports.ControlStream.control_heads` call per interval, for every run polling through
it, says which streams grew, and only those are read. That reading is one task for all the
runs, driven or parked, hosted by one of them at a time (`treadle.supervisors._relay`).
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from collections.abc import Callable, Iterable

import attrs
import trio

from treadle._exceptions import StoreError
from treadle.actors import Cancel, Control, Offer
from treadle.approvals import first_counting
from treadle.ports import ControlStream, RunStore
from treadle.supervisors._relay import Relay
from treadle.types import ApprovalDecided, ApprovalRequested, CancelRequested, ControlEntry

_LOG = logging.getLogger("treadle.control")


def control_of(store: RunStore) -> ControlStream | None:
    """``store`` as a `ControlStream`, or ``None`` for a store without control streams."""
    return store if isinstance(store, ControlStream) else None


@attrs.define(eq=False)
class ControlIndex:
    """The control heads of the runs one store drives (or parks) in one trio run.

    One `ControlStream.control_heads` call at most every ``max_age_s`` answers for all of them.
    It owns no task: the reading is one task for every run polling (`subscribe`) or waiting
    (`wait_grown`) through it, hosted by one of them at a time.

    A shared index holds its store weakly: the trio run's indexes are keyed by their stores
    (weak keys), and a strong reference back would keep every store used in the trio run, with
    all it holds, alive until the trio run ends.

    Attributes:
        max_age_s: seconds a reading of the heads is reused for (the shortest poll asked).
    """

    _store: Callable[[], ControlStream | None]
    max_age_s: float
    _heads: dict[str, int] = attrs.Factory(dict)
    _inboxes: dict[ControlInbox, None] = attrs.Factory(dict)  # an ordered set
    _relay: Relay = attrs.Factory(lambda self: Relay(self._poll), takes_self=True)
    _read_at: float = float("-inf")
    _reading: bool = False
    _watches: set[_Watch] = attrs.Factory(set)
    _nap: trio.CancelScope | None = None  # the reading task's wait for its next reading

    @property
    def store(self) -> ControlStream:
        """The store (alive while a run of it uses the index).

        Raises:
            ReferenceError: the store is gone.
        """
        store = self._store()
        if store is None:
            raise ReferenceError("the control index's store is gone")
        return store

    def subscribe(self, inbox: ControlInbox, nursery: trio.Nursery) -> Callable[[], None]:
        """Poll ``inbox`` every ``max_age_s`` from now on; returns the function that stops.

        The polling is one task for every subscribed inbox, hosted in ``nursery`` or in another
        subscriber's (`treadle.supervisors._relay.Relay`); stop before ``nursery`` closes. A
        reading finds which streams grew beyond what their inbox handed over, and only those
        are read. A reading that fails with `StoreError` is logged and made again at the next
        interval: the run's own writes report a store that stays broken.
        """
        self._inboxes[inbox] = None
        key = self._relay.join(nursery)

        def stop() -> None:
            self._inboxes.pop(inbox, None)
            self._relay.leave(key)

        return stop

    def ask(self, max_age_s: float) -> None:
        """Read at least every ``max_age_s`` from now on (a run that polls more often joined).

        A wait for the next reading that is already under way ends earlier too.
        """
        if max_age_s >= self.max_age_s:
            return
        self.max_age_s = max_age_s
        if self._nap is not None:
            self._nap.deadline = min(self._nap.deadline, self._read_at + max_age_s)

    async def head(self, run_id: str) -> int:
        """The run's last control position per a reading at most ``max_age_s`` old.

        Raises:
            StoreError: the store cannot be read.
        """
        if trio.current_time() - self._read_at >= self.max_age_s and not self._reading:
            # One run reads; the others go on with the reading before (at most one interval
            # older) instead of queueing behind it.
            await self._read()
        else:
            await trio.lowlevel.checkpoint()
        return self._heads.get(run_id, 0)

    async def _read(self) -> None:
        self._reading = True
        try:
            ids = sorted({*(i.run_id for i in self._inboxes), *(w.run_id for w in self._watches)})
            self._heads = dict(await self.store.control_heads(ids))
            self._read_at = trio.current_time()
        finally:
            self._reading = False

    async def wait_grown(
        self, inbox: ControlInbox, nursery: trio.Nursery, woken: trio.Event
    ) -> None:
        """Wait until ``woken`` is set: when a reading shows ``inbox``'s stream grew.

        Grew, that is, beyond what ``inbox`` had handed over when the wait began.

        The caller may set ``woken`` too (a decision handed over in process, a drain), and it
        is set when a reading shows the stream grew; either way the caller checks what it
        waits for and calls again.

        Parked runs wait this way instead of each reading on its own timer: the reading is
        the driven runs' polling job (`subscribe`), which reads the heads every ``max_age_s``
        for every run waiting or polling through the index and wakes only the waiters whose
        stream grew. So 10,000 parked runs cost one small read per interval, not 20,000
        wake-ups a second. While it waits, the caller is a member that can host the job in
        ``nursery`` (`treadle.supervisors._relay.Relay`), so no task outlives the runs it
        serves (docs/decisions/0010-parking-waiting-runs.md).

        A reading that fails with `StoreError` is logged and made again at the next interval:
        each waiting run reads its own control stream at its deadline, where a store that stays
        broken is that run's error. Any other exception is the error of the run hosting the
        job.
        """
        watch = _Watch(run_id=inbox.run_id, seen=inbox.seen, woken=woken)
        self._watches.add(watch)
        key = self._relay.join(nursery)
        try:
            await woken.wait()
        finally:
            self._watches.discard(watch)
            self._relay.leave(key)

    async def _refresh(self) -> bool:
        """Read the heads and wake the waiters whose stream grew.

        Returns ``False`` when the reading failed with `StoreError`: it is logged and made
        again at the next interval (see `wait_grown` and `subscribe`).
        """
        try:
            await self._read()
        except StoreError as exc:
            self._read_at = trio.current_time()
            _LOG.warning("reading the control heads failed (%s); trying again", exc)
            return False
        for watch in self._watches:
            if self._grown(watch.run_id, watch.seen):
                watch.woken.set()
        return True

    async def _poll(self) -> None:
        """Read for the subscribed inboxes and the waiters until cancelled (see `subscribe`)."""
        while True:
            # until the next reading is due (sooner when `ask` shortens the interval)
            try:
                with trio.move_on_at(self._read_at + self.max_age_s) as self._nap:
                    await trio.sleep_forever()
            finally:
                self._nap = None
            if not await self._refresh():
                continue
            for inbox in [i for i in self._inboxes if self._grown(i.run_id, i.seen)]:
                try:
                    entries = await inbox.read()
                except StoreError as exc:  # see subscribe
                    _LOG.warning(
                        "reading run %r's control stream failed (%s); trying again",
                        inbox.run_id,
                        exc,
                    )
                    continue
                if inbox in self._inboxes:  # not stopped while reading
                    with contextlib.suppress(trio.BrokenResourceError):
                        # its coordinator stopped, and its run is stopping: what it did not
                        # take stays in the stream for the run's next driver
                        inbox.hand_over(entries)

    def _grown(self, run_id: str, seen: int) -> bool:
        return self._heads.get(run_id, 0) > seen


@attrs.define(eq=False)
class _Watch:
    """A run waiting in `ControlIndex.wait_grown`: its stream, what it has seen, its wake-up."""

    run_id: str
    seen: int
    woken: trio.Event


_INDEXES: trio.lowlevel.RunVar[weakref.WeakKeyDictionary[ControlStream, ControlIndex]] = (
    trio.lowlevel.RunVar("treadle control indexes")
)


def shared_index(store: ControlStream, max_age_s: float) -> ControlIndex:
    """The `ControlIndex` shared by every run of ``store`` in the current trio run.

    The indexes live as long as the trio run (a `trio.lowlevel.RunVar`) and their store (weak
    keys): a store used again in another `trio.run` gets a new one, on that run's clock. A
    store that cannot be a weak key gets an index of its own for each caller.
    """
    try:
        indexes = _INDEXES.get()
    except LookupError:
        indexes = weakref.WeakKeyDictionary()
        _INDEXES.set(indexes)
    try:
        index = indexes.get(store)
        if index is None:
            index = indexes[store] = ControlIndex(weakref.ref(store), max_age_s)
    except TypeError:  # not weakly referable: not shared
        return ControlIndex(lambda: store, max_age_s)
    index.ask(max_age_s)
    return index


@attrs.define(eq=False)
class ControlInbox:
    """Copies what other processes appended to the run's control stream into the running run.

    The stream is append-only, so the entries already handed over are a prefix of it. Cancel
    requests cancel the run (the coordinator writes the cancel record); approval decisions are
    offered to the target, which records the one matching its pending request and never
    applies one that matches none (docs/decisions/0007). Both go to it as
    `treadle.actors.Control` messages.

    Attributes:
        store: the store's control streams.
        run_id: the run.
        target: takes each message: the coordinator's inbox, or a parked run's state.
        index: the store's shared reading of control heads (``None``: read every time).
        seen: the last position handed over.
    """

    store: ControlStream
    run_id: str
    target: Callable[[Control], None]
    index: ControlIndex | None = None
    seen: int = 0

    async def poll(self, *, fresh: bool = False) -> None:
        """Read the control stream once (if it grew) and hand over the entries not seen yet.

        Args:
            fresh: read the stream itself, not trusting the shared reading (used when a run
                starts: what was written while no one drove it must be seen at once).

        Raises:
            StoreError: the store cannot be read.
        """
        if not fresh and self.index is not None and await self.index.head(self.run_id) <= self.seen:
            return
        self.hand_over(await self.read())

    async def read_new(self) -> list[Control]:
        """Read the stream itself once: the entries not handed over yet, as messages, in order.

        They count as handed over from now on: the caller applies them. Used before a run
        takes a decision handed over by its handle (`treadle.actors.take_offer`), so that a
        cancel written before it wins (docs/events.md, "Human approval").

        Raises:
            StoreError: the store cannot be read.
        """
        return self._unseen(await self.read())

    async def keep(
        self, request: ApprovalRequested, decided: ApprovalDecided
    ) -> tuple[ApprovalDecided, list[Control]]:
        """Make ``decided``, handed over by the run's handle, durable; say which decision counts.

        It is appended to the stream, then the stream is read once, whole: the decision that
        counts for ``request`` is the first there that counts (`first_counting`), the
        handle's or one another process wrote before it (`treadle.approvals.decide`), as a
        run resumed from the stream after a crash finds it (docs/events.md, "Human
        approval"). One write and one reading a decision (`treadle.actors.KeepDecision`).

        Returns:
            The decision that counts, and the entries not handed over yet, as messages in
            order; they count as handed over from now on (the caller applies them).

        Raises:
            StoreError: the write or the reading failed.
        """
        await self.store.append_control(decided)
        entries = await self.store.read_control(self.run_id)
        counting = first_counting([entry.record for entry in entries], request)
        return counting or decided, self._unseen(entries)

    async def read(self) -> tuple[ControlEntry, ...]:
        """The entries after the last one handed over.

        Raises:
            StoreError: the store cannot be read.
        """
        return await self.store.read_control(self.run_id, after=self.seen)

    def hand_over(self, entries: Iterable[ControlEntry]) -> None:
        """Give ``entries`` (read after `seen`) to the target, in order."""
        for message in self._unseen(entries):
            self.target(message)

    def _unseen(self, entries: Iterable[ControlEntry]) -> list[Control]:
        """The messages of ``entries`` not handed over yet; `seen` moves past them.

        Two readings may overlap (the shared one, and one before a decision is taken): an
        entry the other handed over meanwhile is not handed over twice.
        """
        messages: list[Control] = []
        for entry in entries:
            if entry.position <= self.seen:
                continue
            record = entry.record
            if isinstance(record, CancelRequested):
                messages.append(Cancel(reason=record.reason, canceller=record.canceller))
            else:
                messages.append(Offer(decided=record))
            self.seen = entry.position
        return messages
