"""Reading a run's control stream (cancels and approval decisions of other processes).

Each driven run reads its control stream every ``control_poll_s`` (docs/decisions/0007). With
thousands of runs in one process that would be thousands of store reads a second, almost all
of empty streams. So the runs of one store share a `ControlIndex`: one
`treadle.ports.ControlStream.control_heads` call per interval, for every run polling through
it, says which streams grew, and only those are read.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from typing import Protocol

import attrs
import trio

from treadle.ports import ControlStream, RunStore
from treadle.types import ApprovalDecided, CancelRequested, ControlEntry

_LOG = logging.getLogger("treadle.control")


class ControlTarget(Protocol):
    """Who takes the control stream's records: the coordinator, or a parked run's state."""

    def cancel(self, reason: str = "", canceller: str = "") -> None:
        """Cancel the run."""
        ...

    def offer(self, decided: ApprovalDecided) -> None:
        """Take an approval decision (one matching no pending request is ignored)."""
        ...


def control_of(store: RunStore) -> ControlStream | None:
    """``store`` as a `ControlStream`, or ``None`` for a store without control streams."""
    return store if isinstance(store, ControlStream) else None


@attrs.define(eq=False)
class ControlIndex:
    """The control heads of the runs one store drives (or parks) in this process.

    One `ControlStream.control_heads` call at most every ``max_age_s`` answers for all of them.

    Attributes:
        store: the store.
        max_age_s: seconds a reading of the heads is reused for (the shortest poll asked).
    """

    store: ControlStream
    max_age_s: float
    _heads: dict[str, int] = attrs.Factory(dict)
    _registered: dict[str, int] = attrs.Factory(dict)
    _read_at: float = float("-inf")
    _reading: bool = False
    _token: object = None
    _watchers: dict[str, set[tuple[int, trio.Event]]] = attrs.Factory(dict)
    _sweeping: bool = False

    def _same_run(self) -> None:
        token = trio.lowlevel.current_trio_token()
        if token is not self._token:  # a store used again in another trio.run: a new clock
            self._token, self._read_at, self._reading = token, float("-inf"), False
            self._watchers, self._sweeping, self._registered = {}, False, {}

    def register(self, run_id: str) -> Callable[[], None]:
        """Include ``run_id`` in every reading of the heads; returns the function that stops."""
        self._same_run()
        self._registered[run_id] = self._registered.get(run_id, 0) + 1
        self._read_at = float("-inf")  # read the newcomer's head at the next poll

        def stop() -> None:
            count = self._registered.get(run_id, 0) - 1
            if count > 0:
                self._registered[run_id] = count
            else:
                self._registered.pop(run_id, None)
                self._heads.pop(run_id, None)

        return stop

    async def head(self, run_id: str) -> int:
        """The run's last control position per a reading at most ``max_age_s`` old.

        Raises:
            StoreError: the store cannot be read.
        """
        self._same_run()
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
            ids = sorted({*self._registered, *self._watchers})
            self._heads = dict(await self.store.control_heads(ids))
            self._read_at = trio.current_time()
        finally:
            self._reading = False

    def watch(self, run_id: str, seen: int, wake: trio.Event) -> Callable[[], None]:
        """Set ``wake`` once a reading shows ``run_id``'s control stream beyond ``seen``.

        Parked runs wait this way instead of each reading on its own timer: one task per
        store reads the heads every ``max_age_s`` while anyone watches, so 10,000 parked
        runs cost one small read per interval, not 20,000 wake-ups a second.

        Returns:
            A function that stops the watch.
        """
        self._same_run()
        entry = (seen, wake)
        self._watchers.setdefault(run_id, set()).add(entry)
        if not self._sweeping:
            self._sweeping = True
            trio.lowlevel.spawn_system_task(self._sweep, name="treadle control-stream sweep")

        def stop() -> None:
            entries = self._watchers.get(run_id)
            if entries is not None:
                entries.discard(entry)
                if not entries:
                    del self._watchers[run_id]

        return stop

    async def _sweep(self) -> None:
        """Read the heads every ``max_age_s`` while anyone watches; wake those that grew.

        A failed reading is logged and tried again at the next interval: the watching runs
        read their control streams themselves at their deadline, where a broken store
        surfaces as their error.
        """
        try:
            while self._watchers:
                await trio.sleep(self.max_age_s)
                try:
                    await self._read()
                except Exception as exc:  # see the docstring
                    _LOG.warning("reading the control heads failed (%s); trying again", exc)
                    continue
                for run_id, entries in list(self._watchers.items()):
                    head = self._heads.get(run_id, 0)
                    for seen, wake in entries:
                        if head > seen:
                            wake.set()
        finally:
            self._sweeping = False


_INDEXES: weakref.WeakKeyDictionary[ControlStream, ControlIndex] = weakref.WeakKeyDictionary()


def shared_index(store: ControlStream, max_age_s: float) -> ControlIndex | None:
    """The `ControlIndex` shared by every run of ``store`` in this process.

    ``None`` when the store cannot be a weak key (then each run reads its control stream).
    """
    try:
        index = _INDEXES.get(store)
        if index is None:
            index = _INDEXES[store] = ControlIndex(store=store, max_age_s=max_age_s)
    except TypeError:
        return None
    index.max_age_s = min(index.max_age_s, max_age_s)
    return index


@attrs.define(eq=False)
class ControlInbox:
    """Copies what other processes appended to the run's control stream into the running run.

    The stream is append-only, so the entries already handed over are a prefix of it. Cancel
    requests cancel the run (the coordinator writes the cancel record); approval decisions are
    offered to the target, which records the one matching its pending request and never
    applies one that matches none (docs/decisions/0007).

    Attributes:
        store: the store's control streams.
        run_id: the run.
        target: the coordinator, or a parked run's state.
        index: the store's shared reading of control heads (``None``: read every time).
        seen: the last position handed over.
    """

    store: ControlStream
    run_id: str
    target: ControlTarget
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
        for entry in await self.store.read_control(self.run_id, after=self.seen):
            self._hand_over(entry)

    def _hand_over(self, entry: ControlEntry) -> None:
        record = entry.record
        if isinstance(record, CancelRequested):
            self.target.cancel(record.reason, record.canceller)
        else:
            self.target.offer(record)
        self.seen = max(self.seen, entry.position)

    async def poll_every(self, interval_s: float, scope: trio.CancelScope) -> None:
        """Poll every ``interval_s`` seconds until ``scope`` is cancelled."""
        with scope:
            while True:
                await trio.sleep(interval_s)
                await self.poll()
