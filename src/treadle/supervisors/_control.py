"""Reading a run's control log (cancels and approval decisions of other processes).

Each driven run reads its control log every ``control_poll_s`` (docs/decisions/0007). With
thousands of runs in one process that would be thousands of store reads a second, almost all
of empty logs. So the runs of one store share a `ControlIndex`: one `list_runs` per interval
says which control logs exist at all, and only those are read.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Protocol

import attrs
import trio

from treadle.approvals import control_log_id, read_control
from treadle.ports import RunStore
from treadle.types import ApprovalDecided, CancelRequested


class ControlTarget(Protocol):
    """Who takes the control log's records: the coordinator, or a parked run's state."""

    def cancel(self, reason: str = "", canceller: str = "") -> None:
        """Cancel the run."""
        ...

    def offer(self, decided: ApprovalDecided) -> None:
        """Take an approval decision (one matching no pending request is ignored)."""
        ...


@attrs.define(eq=False)
class ControlIndex:
    """Which control logs exist in one store, listed at most once per ``max_age_s``.

    Attributes:
        store: the store.
        max_age_s: seconds a listing is reused for (the shortest poll interval asked).
    """

    store: RunStore
    max_age_s: float
    _ids: frozenset[str] = frozenset()
    _listed_at: float = float("-inf")
    _listing: bool = False
    _token: object = None
    _watchers: dict[str, set[trio.Event]] = attrs.Factory(dict)
    _sweeping: bool = False

    def _same_run(self) -> None:
        token = trio.lowlevel.current_trio_token()
        if token is not self._token:  # a store used again in another trio.run: a new clock
            self._token, self._listed_at, self._listing = token, float("-inf"), False
            self._watchers, self._sweeping = {}, False

    def watch(self, run_id: str, wake: trio.Event) -> Callable[[], None]:
        """Set ``wake`` once a listing shows that ``run_id`` has a control log.

        Parked runs wait this way instead of each reading on its own timer: one task per
        store lists the store every ``max_age_s`` while anyone watches, so 10,000 parked
        runs cost one listing per interval, not 20,000 wake-ups a second.

        Returns:
            A function that stops the watch.
        """
        self._same_run()
        self._watchers.setdefault(run_id, set()).add(wake)
        if not self._sweeping:
            self._sweeping = True
            trio.lowlevel.spawn_system_task(self._sweep, name="treadle control-log sweep")

        def stop() -> None:
            wakes = self._watchers.get(run_id)
            if wakes is not None:
                wakes.discard(wake)
                if not wakes:
                    del self._watchers[run_id]

        return stop

    async def _sweep(self) -> None:
        """List the store every ``max_age_s`` while anyone watches; wake the ones listed.

        A failed listing is tried again at the next interval: the watching runs read their
        control log themselves at their deadline, where a broken store surfaces.
        """
        try:
            while self._watchers:
                await trio.sleep(self.max_age_s)
                try:
                    ids = frozenset(await self.store.list_runs())
                except Exception:  # a read; see the docstring
                    continue
                self._ids, self._listed_at = ids, trio.current_time()
                for run_id, wakes in list(self._watchers.items()):
                    if control_log_id(run_id) in ids:
                        for wake in wakes:
                            wake.set()
        finally:
            self._sweeping = False

    async def exists(self, run_id: str) -> bool:
        """Whether ``run_id`` has a control log, per a listing at most ``max_age_s`` old.

        Raises:
            StoreError: the store cannot be listed.
        """
        self._same_run()
        if trio.current_time() - self._listed_at >= self.max_age_s and not self._listing:
            # One run lists; the others go on with the listing before (at most one interval
            # older) instead of queueing behind it.
            self._listing = True
            try:
                self._ids = frozenset(await self.store.list_runs())
                self._listed_at = trio.current_time()
            finally:
                self._listing = False
        else:
            await trio.lowlevel.checkpoint()
        return control_log_id(run_id) in self._ids


_INDEXES: weakref.WeakKeyDictionary[RunStore, ControlIndex] = weakref.WeakKeyDictionary()


def shared_index(store: RunStore, max_age_s: float) -> ControlIndex | None:
    """The `ControlIndex` shared by every run of ``store`` in this process.

    ``None`` when the store cannot be a weak key (then each run reads its control log).
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
    """Copies what other processes wrote to the run's control log into the running run.

    The control log is append-only, so the records already handed over are a prefix of it.
    Cancel requests cancel the run (the coordinator writes the cancel record); approval
    decisions are offered to the target, which records the one matching its pending request
    and never applies one that matches none (docs/decisions/0007).

    Attributes:
        store: the run store.
        run_id: the run.
        target: the coordinator, or a parked run's state.
        index: the store's shared listing of control logs (``None``: read every time).
    """

    store: RunStore
    run_id: str
    target: ControlTarget
    index: ControlIndex | None = None
    _seen: int = 0

    async def poll(self, *, fresh: bool = False) -> None:
        """Read the control log once (if it exists) and hand over the records not seen yet.

        Args:
            fresh: read the log itself, not trusting the shared listing (used when a run
                starts: what was written while no one drove it must be seen at once).

        Raises:
            StoreError: the store cannot be read.
        """
        if not fresh and self.index is not None and not await self.index.exists(self.run_id):
            return
        records = await read_control(self.store, self.run_id)
        for record in records[self._seen :]:
            if isinstance(record, CancelRequested):
                self.target.cancel(record.reason, record.canceller)
            else:
                self.target.offer(record)
        self._seen = len(records)

    async def poll_every(self, interval_s: float, scope: trio.CancelScope) -> None:
        """Poll every ``interval_s`` seconds until ``scope`` is cancelled."""
        with scope:
            while True:
                await trio.sleep(interval_s)
                await self.poll()
