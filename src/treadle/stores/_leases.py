"""The lease rules every store applies the same way (docs/fleet.md, "Leases").

A lease is ``(owner, generation, expires_at)`` per run. Acquiring succeeds when the run has no
live lease (never leased, released, or expired by the store's clock) or when the caller holds
it already; every acquisition that is not the holder renewing its live lease takes the next
generation, so a write of any earlier holder is refused (fencing). The SQL stores state the
same rules in their statements; the memory and JSONL stores call these functions.
"""

from __future__ import annotations

import os
import re
import secrets
import socket
from typing import Final

from treadle._exceptions import LeaseLost, RunLeased, UsageError
from treadle.types import Lease, Liveness, RunState

LEASE_TTL_S: Final = 15.0
"""Default lease duration (seconds); a driver renews every third of it."""


def lease_owner(*, cancelling: bool = False) -> str:
    """A fresh owner id: ``host:pid:random`` (8 hex digits) for a driver.

    With ``cancelling``, ``host:pid:cancel-random``: the owner of a process that takes a run's
    lease only to finish it as cancelled (`treadle cancel`, the console, `finish_cancelled`),
    which `finishes_cancel` tells from a driver (docs/fleet.md, "Leases").
    """
    mark = _CANCEL_MARK if cancelling else ""
    return f"{socket.gethostname()}:{os.getpid()}:{mark}{secrets.token_hex(4)}"


def finishes_cancel(owner: str) -> bool:
    """Whether ``owner`` is a lease owner made to finish a run as cancelled (`lease_owner`).

    That is, it ends in ``:cancel-`` and 8 hex digits; `driver_owner` refuses such an owner
    to a driver.
    """
    return _CANCEL_OWNER.search(owner) is not None


def driver_owner(owner: str | None) -> str:
    """The lease owner id of a driver: ``owner``, or a fresh one (`lease_owner`) when not given.

    Raises:
        UsageError: ``owner`` is not a string, or has the form of a cancel's
            (`finishes_cancel`): every command and the console would say its holder is a
            cancel finishing the run, not a driver that applies decisions (docs/fleet.md,
            "Leases").
    """
    if owner is None or owner == "":
        return lease_owner()
    if not isinstance(owner, str):
        raise UsageError(f"owner must be a string, got {owner!r}")
    if finishes_cancel(owner):
        raise UsageError(
            f"owner {owner!r} has the form of a cancel's lease owner (ending ':cancel-' and 8 "
            "hex digits), which names no driver: choose another"
        )
    return owner


_CANCEL_MARK: Final = "cancel-"
_CANCEL_OWNER: Final = re.compile(rf"(?:^|:){_CANCEL_MARK}[0-9a-f]{{8}}\Z")


def check_ttl(ttl_s: float) -> None:
    """Refuse a lease duration that is not a positive, finite number of seconds.

    Raises:
        UsageError: it is not.
    """
    if not (isinstance(ttl_s, int | float) and 0 < ttl_s < float("inf")):
        raise UsageError(f"a lease TTL is a positive number of seconds, got {ttl_s!r}")


def is_live(lease: Lease | None, now: float) -> bool:
    """Whether ``lease`` is held by someone and not expired at ``now`` (store clock)."""
    return lease is not None and bool(lease.owner) and lease.expires_at > now


def acquire(current: Lease | None, *, run_id: str, owner: str, ttl_s: float, now: float) -> Lease:
    """The lease after ``owner`` acquires ``run_id`` at ``now``.

    Raises:
        RunLeased: another owner holds a live lease.
    """
    check_ttl(ttl_s)
    if current is not None and is_live(current, now):
        if current.owner != owner:
            raise RunLeased(run_id, current)
        generation = current.generation
    else:
        generation = (current.generation if current is not None else 0) + 1
    return Lease(
        run_id=run_id, owner=owner, generation=generation, expires_at=now + ttl_s, heartbeat_at=now
    )


def renew(current: Lease | None, held: Lease, *, ttl_s: float, now: float) -> Lease | None:
    """``held`` renewed at ``now``, or ``None`` when the store's lease is no longer it."""
    if current is None or current.owner != held.owner or current.generation != held.generation:
        return None
    return Lease(
        run_id=held.run_id,
        owner=held.owner,
        generation=held.generation,
        expires_at=now + ttl_s,
        heartbeat_at=now,
    )


def released(current: Lease, held: Lease) -> Lease | None:
    """The lease after ``held`` is released (owner cleared), or ``None`` if not held."""
    if current.owner != held.owner or current.generation != held.generation:
        return None
    return Lease(
        run_id=current.run_id,
        owner="",
        generation=current.generation,
        expires_at=current.expires_at,
        heartbeat_at=current.heartbeat_at,
    )


def fence(run_id: str, generation: int, current: Lease | None) -> None:
    """Refuse a write of generation ``generation`` unless it is the run's current one.

    Raises:
        LeaseLost: it is not, the lease was released, or the run has no lease at all.
    """
    if current is None or not current.owner or current.generation != generation or generation < 1:
        raise LeaseLost(
            run_id, generation=generation, current=current.generation if current else None
        )


def liveness(
    *,
    state: RunState | None,
    lease: Lease | None,
    quarantined: str | None,
    now: float,
) -> Liveness:
    """Who drives a run with this index row at ``now`` (see `treadle.types.Liveness`)."""
    if state is not None and state.is_terminal:
        return Liveness.FINISHED
    if is_live(lease, now):
        return Liveness.DRIVEN
    if quarantined:
        return Liveness.QUARANTINED
    if state is RunState.QUEUED:
        return Liveness.QUEUED
    parked = state in (RunState.AWAITING_APPROVAL, RunState.AWAITING_CHILD)
    if parked and (lease is None or not lease.owner):
        return Liveness.PARKED
    return Liveness.ORPHANED
