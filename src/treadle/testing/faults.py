"""Fault injection for tests and simulations.

* `CrashingStore` wraps any store and "crashes the process" at a chosen write: from then on
  every operation raises `SimulatedCrash`, as if the process had died. Whether the write at
  the crash point happened is chosen with ``when`` (``before``: it did not; ``after``: it did,
  but the caller never learned). Reopening the inner store (or keeping the same memory store)
  models the restart.
* `CrashingExecutor` wraps an action executor and crashes the process in the middle of a
  chosen action: before its effect or after it (the effect happened, its outcome is lost).
* `FailingStore` wraps any store and fails one chosen write with an error (a full disk, a
  read-only file) without killing the process: the run must stop with that error.
* `FailingFileOps` are file operations for `treadle.stores.jsonl.JsonlStore` that run out of
  space after a byte budget (a short write, then ``ENOSPC``), fail a chosen sync, or SIGKILL
  the real process half-way through an append.
"""

from __future__ import annotations

import errno
import os
import signal
from typing import Any, Literal, NoReturn

import attrs

from treadle._exceptions import StoreError, UsageError
from treadle.policies import POLICY_METHODS
from treadle.ports import ActionExecutor, LeaseStore, RunStore
from treadle.stores.jsonl import FileOps, OsFileOps
from treadle.testing._intercept import InterceptingStore
from treadle.types import (
    Action,
    ActionOutcome,
    Lease,
    Record,
    ReplayPolicy,
    StoreOp,
    ToolSpec,
)


class SimulatedCrash(Exception):
    """Raised by a fault-injecting wrapper once its simulated process has died."""


FAULT_KINDS = (
    "crash",
    "store_error",
    "model_429",
    "model_5xx",
    "model_reset",
    "model_truncated",
    "model_stalled",
    "model_context_length",
    "tool_exception",
    "tool_timeout",
    "tool_stuck",
    "bad_text",
    "env_error",
    "cancel",
    "approval",
    "latency",
    "takeover",
    "child_run",
    "thread",
)
"""Every fault kind a `FaultPlan` can switch on."""


def check_when(wrapper: object, field: attrs.Attribute[Any], value: object) -> None:
    """An attrs validator: a fault's side is ``"before"`` or ``"after"``.

    Raises:
        UsageError: anything else (a misspelt side acted as ``after``).
    """
    if value not in ("before", "after"):
        raise UsageError(
            f"{type(wrapper).__name__}: {field.name} must be 'before' or 'after', not {value!r}"
        )


def check_ordinal(wrapper: object, field: attrs.Attribute[Any], value: object) -> None:
    """An attrs validator: which operation a fault hits, a whole number from 1.

    ``None`` passes where it is the field's default (never).

    Raises:
        UsageError: 0, a negative number or no int (0 never came: the fault never happened).
    """
    if value is None and field.default is None:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise UsageError(
            f"{type(wrapper).__name__}: {field.name} must be a whole number of 1 or more "
            f"(operations are counted from 1), not {value!r}"
        )


@attrs.define(eq=False)
class CrashingStore(InterceptingStore):
    """A `treadle.ports.RunStore` that dies at write number ``crash_at`` (1-based).

    Args:
        inner: the store that keeps what was written before the crash.
        crash_at: which write operation (counted over all runs) crashes.
        when: ``before`` (the write is lost) or ``after`` (it is stored, then the crash).

    Attributes:
        writes: write operations seen so far.
        crashed: whether the crash happened. From then on every operation (reads, leases and
            control streams included) raises `SimulatedCrash`, except the release of the dying
            run's lease: that lease lapses, as its TTL would make it.

    Raises:
        UsageError: when made, the operation to hit is not a whole number from 1, or
            ``when`` is neither ``before`` nor ``after``.
    """

    inner: RunStore
    crash_at: int = attrs.field(validator=check_ordinal)
    when: Literal["before", "after"] = attrs.field(default="before", validator=check_when)
    writes: int = 0
    crashed: bool = False

    def crash(self) -> None:
        """Die now: every later operation raises `SimulatedCrash` (used by `CrashingExecutor`)."""
        self.crashed = True

    async def before_write(self, op: StoreOp, records: tuple[Record, ...], seq: int) -> bool:
        """Count a write; raise if dead; return True when the write must crash after."""
        if self.crashed:
            raise SimulatedCrash("the process is dead")
        self.writes += 1
        if self.writes == self.crash_at:
            self.crashed = True
            if self.when == "before":
                raise SimulatedCrash(f"crash before write {self.writes}")
            return True
        return False

    def after_write(self, act: bool, op: StoreOp, records: tuple[Record, ...], seq: int) -> None:
        """Crash once the chosen write was stored."""
        if act:
            raise SimulatedCrash("crash after the write")

    def check_other(self) -> None:
        """A dead process reads nothing."""
        if self.crashed:
            raise SimulatedCrash("the process is dead")

    async def release_lease(self, lease: Lease, *, control_seen: int = 0) -> None:
        """Forward, dead or alive (a store without leases has this method but is no LeaseStore).

        A process that died holds no lease for long: here it lapses at once (as after its
        TTL), so that the next incarnation takes the run over without waiting.

        Raises:
            TypeError: the inner store keeps no leases.
        """
        if not isinstance(self.inner, LeaseStore):
            raise TypeError(f"{type(self.inner).__name__} is no LeaseStore")
        await self.inner.release_lease(lease, control_seen=control_seen)


@attrs.define(eq=False)
class CrashingExecutor:
    """A `treadle.ports.ActionExecutor` that crashes the process in the middle of an action.

    Args:
        inner: the executor doing the real work.
        crash_at: which `execute` call (1-based, counted over all runs) crashes.
        when: ``before`` (the action's effect never happens) or ``after`` (the inner action
            ran to its end, then the process dies before its outcome is returned).
        store: the run's `CrashingStore`, killed at the same moment, so that nothing is
            written after the crash; ``None`` to leave the store alive.

    Attributes:
        calls: `execute` calls seen so far.
        crashed: whether the crash happened.

    Raises:
        UsageError: when made, the operation to hit is not a whole number from 1, or
            ``when`` is neither ``before`` nor ``after``.
    """

    inner: ActionExecutor
    crash_at: int = attrs.field(validator=check_ordinal)
    when: Literal["before", "after"] = attrs.field(default="after", validator=check_when)
    store: CrashingStore | None = None
    calls: int = 0
    crashed: bool = False

    def tool_specs(self) -> tuple[ToolSpec, ...]:
        """Forward."""
        return self.inner.tool_specs()

    def replay_policy(self, tool: str) -> ReplayPolicy:
        """Forward."""
        return self.inner.replay_policy(tool)

    async def execute(self, action: Action) -> ActionOutcome:
        """Forward, crashing in the chosen call.

        Raises:
            SimulatedCrash: at the crash point and after it.
        """
        self._check_alive()
        self.calls += 1
        if self.calls != self.crash_at:
            return await self.inner.execute(action)
        if self.when == "before":
            self._crash(f"crash before action {self.calls} ({action.tool})")
        await self.inner.execute(action)
        self._crash(f"crash after action {self.calls} ({action.tool}) ran")

    async def reconcile(self, action: Action) -> ActionOutcome | None:
        """Forward unless dead."""
        self._check_alive()
        return await self.inner.reconcile(action)

    def __getattr__(self, name: str) -> Any:
        """Forward the inner executor's `treadle.ports.ToolPolicies` methods (those it has).

        So a wrapped executor keeps its approvals, secret arguments, argument checks,
        timeouts, stale-write declarations and images (`treadle.policies.policies_of` finds
        the inner executor's methods through here), and its run's snapshot is unchanged.
        """
        if name in _TOOL_POLICIES:
            return getattr(self.inner, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def _check_alive(self) -> None:
        if self.crashed:
            raise SimulatedCrash("the process is dead")

    def _crash(self, message: str) -> NoReturn:
        self.crashed = True
        if self.store is not None:
            self.store.crash()
        raise SimulatedCrash(message)


_TOOL_POLICIES = frozenset(POLICY_METHODS)


def _default_failure() -> StoreError:
    return StoreError("simulated write failure: no space left on device")


@attrs.define(eq=False)
class FailingStore(InterceptingStore):
    """A `treadle.ports.RunStore` whose write number ``fail_at`` fails with ``error``.

    The process stays alive (unlike `CrashingStore`): reads and other runs keep working,
    and, like a real store, every later write of the failed run raises `StoreError`.

    Args:
        inner: the store that keeps what was written.
        fail_at: which write operation (1-based, counted over all runs) fails.
        error: what it raises (default: a `StoreError` saying the disk is full).
        when: ``before`` (nothing is written) or ``after`` (the write is stored, but the
            caller is told it failed, as after a failed sync).

    Attributes:
        writes: write operations seen so far.
        failed_runs: runs whose write failed.

    Raises:
        UsageError: when made, the operation to hit is not a whole number from 1, or
            ``when`` is neither ``before`` nor ``after``.
    """

    inner: RunStore
    fail_at: int = attrs.field(validator=check_ordinal)
    error: Exception = attrs.Factory(_default_failure)
    when: Literal["before", "after"] = attrs.field(default="before", validator=check_when)
    writes: int = 0
    failed_runs: set[str] = attrs.Factory(set)

    async def before_write(self, op: StoreOp, records: tuple[Record, ...], seq: int) -> bool:
        """Refuse writes of a failed run; fail the chosen write (before or after it)."""
        run_id = records[0].run_id
        if run_id in self.failed_runs:
            raise StoreError(f"run {run_id!r}: an earlier write of this run failed") from (
                self.error
            )
        self.writes += 1
        if self.writes != self.fail_at:
            return False
        self.failed_runs.add(run_id)
        if self.when == "before":
            raise self.error
        return True

    def after_write(self, act: bool, op: StoreOp, records: tuple[Record, ...], seq: int) -> None:
        """Report the chosen write failed although it was stored."""
        if act:
            raise self.error


@attrs.define(eq=False)
class FailingFileOps:
    """`treadle.stores.jsonl.FileOps` with a full disk, a failing sync, or a real crash.

    Args:
        inner: the real file operations.
        space_bytes: bytes that may still be appended (over all files); the write that
            crosses it writes what fits (a short write) and the next one fails with
            ``ENOSPC``. ``None``: unlimited. Raise it again to model freed space.
        fail_sync_at: the sync call (1-based) that fails with ``EIO``; ``None``: never.
        kill: instead of raising, SIGKILL this process right after the short write (a crash
            half-way through an append) or at the failing sync.

    Attributes:
        written: bytes appended so far.
        syncs: sync calls so far.
    """

    inner: FileOps = attrs.Factory(OsFileOps)
    space_bytes: int | None = None
    fail_sync_at: int | None = None
    kill: bool = False
    written: int = 0
    syncs: int = 0

    def open(self, path: str, *, create: bool) -> int:
        """Forward."""
        return self.inner.open(path, create=create)

    def read(self, fd: int, offset: int, size: int) -> bytes:
        """Forward."""
        return self.inner.read(fd, offset, size)

    def write(self, fd: int, data: bytes | memoryview) -> int:
        """Append what fits; raise ``ENOSPC`` when nothing does."""
        room = None if self.space_bytes is None else self.space_bytes - self.written
        if room is not None and room <= 0:
            self._fault(OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)))
        chunk = data if room is None or room >= len(data) else data[:room]
        count = self.inner.write(fd, chunk)
        self.written += count
        if count < len(data) and self.kill:
            self._fault(OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)))
        return count

    def sync(self, fd: int) -> None:
        """Forward, failing at the chosen call."""
        self.syncs += 1
        if self.syncs == self.fail_sync_at:
            self._fault(OSError(errno.EIO, os.strerror(errno.EIO)))
        self.inner.sync(fd)

    def sync_dir(self, path: str) -> None:
        """Forward."""
        self.inner.sync_dir(path)

    def truncate(self, fd: int, size: int) -> None:
        """Forward."""
        self.inner.truncate(fd, size)

    def size(self, fd: int) -> int:
        """Forward."""
        return self.inner.size(fd)

    def close(self, fd: int) -> None:
        """Forward."""
        self.inner.close(fd)

    def same_file(self, fd: int, path: str) -> bool:
        """Forward."""
        return self.inner.same_file(fd, path)

    def _fault(self, error: OSError) -> NoReturn:
        if self.kill:
            os.kill(os.getpid(), signal.SIGKILL)
        raise error
