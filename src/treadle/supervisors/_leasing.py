"""Holding a run's lease while driving it: acquire, renew every TTL/3, release (docs/fleet.md).

A `LeaseKeeper` renews every lease it holds for one store in one call per interval: a fleet
worker has one for all its runs, and the runs driven on their own in one trio run share one per
store and TTL (`shared_keeper`), so that 100 concurrent runs renew in one transaction per
interval, not 100 (each a write transaction, and on SQLite an fsync, beside the log's group
commits).

When a renewal shows that a lease was lost (another driver took the run over after it expired),
the keeper tells the run's `LeaseHold`, which cancels the drive: the run stops without writing
more, and its handle reports `treadle.LeaseLost`. Writes are fenced by the store anyway, so a
lost lease can never let a stale driver write; the keeper only makes it stop sooner.
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from collections.abc import Callable, Iterator
from typing import Final

import attrs
import trio

from treadle._exceptions import (
    LeaseLost,
    StoreUnavailable,
    busy_in,
    lease_lost_in,
    refusal_in,
    unavailable_in,
)
from treadle.ports import LeaseStore, RunStore
from treadle.supervisors._relay import Relay
from treadle.types import Lease

RELEASE_GRACE_S: Final = 5.0
"""Seconds a lease release may take on a shutdown path (shielded) before it is left to expire."""

RELEASE_AGAIN_AFTER_S: Final = (0.1, 0.2, 0.4, 0.8, 1.6)
"""Seconds before each further try of a release on a shutdown path whose store found no
connection for it (`treadle.StoreUnavailable`: nothing was done), 3.1 s in all, within
`RELEASE_GRACE_S`: a server short of connection slots frees one within moments, and a
release that gives up leaves the lease to expire, which the next claim counts as a takeover."""

_LOG = logging.getLogger("treadle.leases")


def leases_of(store: RunStore) -> LeaseStore | None:
    """``store`` as a `LeaseStore`, or ``None`` for a store without leases."""
    return store if isinstance(store, LeaseStore) else None


@attrs.define(eq=False)
class LeaseHold:
    """One run's lease as its driver holds it.

    For a store without leases the hold is empty: generation 0, nothing to renew or release.

    Attributes:
        run_id: the run.
        owner: the driver's owner id.
        ttl_s: the lease duration (seconds).
        store: the store's lease capability, or ``None``.
        lease: the lease now (renewals replace it), or ``None`` while not held.
        lost: the error once the lease was lost, else ``None``.
        expire_on_failure: after the run's own error, leave the lease to expire instead of
            releasing it (a fleet's hold: the next claim is then a takeover, with its backoff
            and quarantine; docs/fleet.md, "Poison runs").
        expiring: the hold let go of a lease it did not release (the release failed, or
            the run failed under ``expire_on_failure``): it expires after its TTL.
    """

    run_id: str
    owner: str
    ttl_s: float
    store: LeaseStore | None
    lease: Lease | None = None
    lost: LeaseLost | None = None
    expire_on_failure: bool = False
    expiring: bool = False
    _scope: trio.CancelScope | None = None

    @property
    def generation(self) -> int:
        """The generation every write of the run carries (0 without leases)."""
        return self.lease.generation if self.lease is not None else 0

    async def acquire(self) -> None:
        """Take the lease (or keep it, when held already).

        Raises:
            RunLeased: another live driver holds it.
        """
        if self.store is not None:
            self.lease = await self.store.acquire_lease(
                self.run_id, owner=self.owner, ttl_s=self.ttl_s
            )
            self.lost = None

    def adopt(self, lease: Lease) -> None:
        """Hold ``lease``, taken by a claim."""
        self.lease = lease
        self.lost = None

    async def release(self, *, control_seen: int = 0) -> None:
        """Give the lease up (a no-op when not held or lost).

        The hold keeps the lease until the store has released it: a release cancelled or
        failed halfway (the caller's block failing as the run parks) is made again by
        `release_quietly` on the way out. Releasing is idempotent (`LeaseStore`).

        Raises:
            StoreError: the release failed (the lease then expires after its TTL).
        """
        lease = self.lease
        if self.store is not None and lease is not None and self.lost is None:
            await self.store.release_lease(lease, control_seen=control_seen)
        self.lease = None

    @property
    def unreleased(self) -> bool:
        """The lease was this driver's and is neither released nor lost: it expires."""
        return self.expiring or (self.lease is not None and self.lost is None)

    async def release_quietly(self, *, control_seen: int = 0) -> None:
        """`release`, shielded and bounded, on a path that already carries an error.

        A release whose store found no connection is tried again (`RELEASE_AGAIN_AFTER_S`).
        A failure is logged and not raised over the error on its way out: the lease then
        expires after its TTL, and the next driver takes the run over. The hold lets go of
        it then, so a later call on the way out does not try (and wait) again.
        """
        with trio.move_on_after(RELEASE_GRACE_S, shield=True):
            try:
                await self._release_when_connected(control_seen)
            except Exception as exc:  # see the docstring: the first error propagates
                self.lease = None
                self.expiring = True
                _LOG.warning(
                    "run %r: the lease was not released (%s); it expires", self.run_id, exc
                )

    async def _release_when_connected(self, control_seen: int) -> None:
        """`release`, tried again while the store finds no connection for it.

        Raises:
            StoreUnavailable: still no connection after the waits of `RELEASE_AGAIN_AFTER_S`.
            StoreError: the release failed otherwise (it is not tried again: a write whose
                connection was lost has an unknown outcome).
        """
        for wait_s in (*RELEASE_AGAIN_AFTER_S, None):
            try:
                await self.release(control_seen=control_seen)
            except StoreUnavailable:
                if wait_s is None:
                    raise
                await trio.sleep(wait_s)
            else:
                return

    async def release_failed(self, error: BaseException) -> None:
        """After the run's ``error``: `release_quietly`, or drop the lease unreleased.

        With ``expire_on_failure`` the lease is no longer renewed nor released: it expires
        after its TTL, and a run that fails at once is not claimed again in a hot loop. Not
        when ``error`` is the database refusing the driver (`StoreRefused`), another
        transaction keeping a lock past the store's wait (`StoreBusy`) or the store finding
        no connection for a call (`StoreUnavailable`), anywhere in it: that is not the run's
        failure, and its next claim must not count as a takeover (docs/fleet.md, "Poison
        runs"), so the lease is released. Nor when ``error`` says the lease was lost
        (`LeaseLost`: another driver, or ``treadle cancel``, took the run): it is not this
        driver's to release or to leave to expire, so it is not counted as `unreleased`.
        """
        lost = lease_lost_in(error)
        if lost is not None and lost.run_id == self.run_id:
            self.lost = self.lost or lost
            self.lease = None
            await trio.lowlevel.checkpoint()
            return
        if (
            not self.expire_on_failure
            or refusal_in(error)
            or busy_in(error)
            or unavailable_in(error)
        ):
            await self.release_quietly()
            return
        if self.lease is not None and self.lost is None:
            self.expiring = True
            _LOG.info(
                "run %r: its lease is left to expire; it is retried as a takeover", self.run_id
            )
        self.lease = None
        await trio.lowlevel.checkpoint()

    @contextlib.contextmanager
    def driving(self) -> Iterator[trio.CancelScope]:
        """A cancel scope for one stretch of driving, cancelled if the lease is lost.

        Raises:
            LeaseLost: on leaving, when the lease was lost meanwhile.
        """
        with trio.CancelScope() as scope:
            self._scope = scope
            try:
                yield scope
            finally:
                self._scope = None
        if self.lost is not None:
            raise self.lost

    def lose(self, current: int | None) -> None:
        """Called by the keeper when a renewal shows the lease was lost: stop driving."""
        if self.lost is not None or self.lease is None:
            return
        self.lost = LeaseLost(self.run_id, generation=self.lease.generation, current=current)
        self.lease = None
        if self._scope is not None:
            self._scope.cancel(reason=f"the lease of run {self.run_id!r} was lost")


@attrs.define(eq=False)
class LeaseKeeper:
    """Renews the leases of one store's runs held in this process, every ``ttl_s / 3``.

    Made inside a trio run (it starts counting from the trio clock's now).

    Attributes:
        store: the store's lease capability.
        ttl_s: the lease duration (seconds).
    """

    store: LeaseStore
    ttl_s: float
    _holds: dict[str, LeaseHold] = attrs.Factory(dict)
    _renewed_at: float = attrs.Factory(trio.current_time)
    _relay: Relay = attrs.Factory(lambda self: Relay(self.run), takes_self=True)
    _token: object = attrs.Factory(trio.lowlevel.current_trio_token)

    def add(self, hold: LeaseHold) -> Callable[[], None]:
        """Keep ``hold``'s lease renewed; returns the function that stops renewing it."""
        self._holds[hold.run_id] = hold

        def stop() -> None:
            if self._holds.get(hold.run_id) is hold:
                del self._holds[hold.run_id]

        return stop

    @trio.lowlevel.enable_ki_protection  # Ctrl-C reaches the main task: decision 0097
    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Renew every ``ttl_s / 3`` seconds until cancelled.

        A renewal that fails (the store is unreachable) is logged and tried again at the next
        interval; the run's own writes report the outage, and fencing keeps a driver whose
        lease expired meanwhile from writing after a takeover.
        """
        task_status.started()
        while True:
            await trio.sleep_until(self._renewed_at + self.ttl_s / 3)
            started = trio.current_time()
            await self.renew_once()
            # Only a renewal that was made counts: one cancelled halfway (its host run was
            # cancelled) is made again at once by the next host (`share`).
            self._renewed_at = started

    def share(self, hold: LeaseHold, nursery: trio.Nursery) -> Callable[[], None]:
        """`add` ``hold``, the renewal hosted in turn by the runs that share the keeper.

        The renewal (`run`) is one task, in the nursery of one of the runs that share the
        keeper; when that run leaves, it goes on in another's (`treadle.supervisors._relay`).
        Returns the function that stops renewing ``hold`` and leaves; call it before
        ``nursery`` closes.
        """
        stop = self.add(hold)
        key = self._relay.join(nursery)

        def stop_and_leave() -> None:
            stop()
            self._relay.leave(key)

        return stop_and_leave

    async def renew_once(self) -> None:
        """Renew every held lease now; tell the holds whose lease was lost."""
        holds = [h for h in self._holds.values() if h.lease is not None]
        if not holds:
            return
        leases = [h.lease for h in holds if h.lease is not None]
        try:
            renewed = await self.store.renew_leases(leases, ttl_s=self.ttl_s)
        except Exception as exc:  # see `run`: reported, retried, and writes stay fenced
            _LOG.warning("lease renewal failed (%s); trying again in %.1f s", exc, self.ttl_s / 3)
            return
        fresh = {lease.run_id: lease for lease in renewed}
        for hold in holds:
            lease = fresh.get(hold.run_id)
            if lease is not None:
                if hold.lease is not None:  # not released meanwhile
                    hold.lease = lease
            elif hold.lease is not None and hold.lease.generation == _generation(leases, hold):
                hold.lose(await self._current_generation(hold.run_id))

    async def _current_generation(self, run_id: str) -> int | None:
        """The generation that took ``run_id`` over, for the message; ``None`` if unknown.

        The renewal already said the lease is lost: a store error here changes nothing.
        """
        try:
            current = await self.store.read_lease(run_id)
        except Exception as exc:
            _LOG.warning(
                "run %s: its lease was lost; reading who holds it now failed (%s)", run_id, exc
            )
            return None
        return current.generation if current is not None else None


_SHARED: weakref.WeakValueDictionary[tuple[int, float], LeaseKeeper] = weakref.WeakValueDictionary()
"""The keepers shared by the runs driven on their own, by ``(id(store), ttl_s)``.

A keeper lives while a run uses it (each holds it), and it holds its store, so an id in a key
names one live store."""


def shared_keeper(store: LeaseStore, ttl_s: float) -> LeaseKeeper:
    """The `LeaseKeeper` shared in this trio run by the runs of ``store`` with TTL ``ttl_s``.

    Every run that holds it joins it with `LeaseKeeper.share` while it drives.
    """
    key = (id(store), ttl_s)
    keeper = _SHARED.get(key)
    if keeper is None or keeper._token is not trio.lowlevel.current_trio_token():
        keeper = _SHARED[key] = LeaseKeeper(store=store, ttl_s=ttl_s)
    return keeper


def _generation(leases: list[Lease], hold: LeaseHold) -> int:
    for lease in leases:
        if lease.run_id == hold.run_id:
            return lease.generation
    return -1
