"""One store wrapper for every fault injector and recorder of writes.

It forwards everything, and lets a subclass act around each of the six log writes (crash
before or after it, fail it, kill the process, record it).

`CrashingStore`, `FailingStore` (`treadle.testing.faults`) and `KillingStore`
(`treadle.testing.crashdriver`) are it. A wrapper has exactly the capabilities (leases,
control streams, run index, run counts, queue; docs/seams.md, "Run store") of its inner store:
its class is made per set of capabilities, so that ``isinstance(wrapper, LeaseStore)`` is what
it is for the inner store, and the runtime uses what the inner store has. A wrapper around a
store without leases takes no lease, as the store alone would. `InterceptingStore.check_other`
lets a subclass refuse the forwarded operations too (a crashed process reads nothing).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Any, Final, Self

from treadle.ports import ControlStream, LeaseStore, RunCounts, RunIndex, RunQueue, RunStore
from treadle.types import (
    ActionIntent,
    ActionResult,
    ApprovalDecided,
    BudgetCaps,
    CancelRequested,
    Claim,
    ControlEntry,
    ControlRecord,
    Lease,
    Liveness,
    Message,
    ModelIntent,
    ModelResult,
    Record,
    RunFinished,
    RunLog,
    RunStarted,
    RunSummary,
    StepRecord,
    StoreOp,
    Submission,
)


class _Wrapper:
    """What the forwarding of a capability needs: the inner store and the refusal hook."""

    inner: RunStore

    def check_other(self) -> None:
        """Called before every other operation (reads, leases, control): may raise."""


class InterceptingStore(_Wrapper):
    """Forwards to ``inner``; `before_write` and `after_write` run around each log write.

    The object made is of a subclass of the class called that adds the forwarding of each
    capability ``inner`` has, and of no other (see the module docstring).

    Args:
        inner: the store that keeps what is written (it belongs to the caller).
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> Self:
        """Make the object of ``cls`` extended with the capabilities of ``inner``."""
        inner = kwargs["inner"] if "inner" in kwargs else args[0]
        return object.__new__(_with_capabilities_of(cls, inner))

    def __init__(self, inner: RunStore) -> None:
        self.inner = inner

    # ------------------------------------------------------------------ hooks

    async def before_write(self, op: StoreOp, records: tuple[Record, ...], seq: int) -> bool:
        """Called before a write reaches ``inner``; returns whether `after_write` must act."""
        return False

    def after_write(self, act: bool, op: StoreOp, records: tuple[Record, ...], seq: int) -> None:
        """Called once ``inner`` accepted the write (with what `before_write` returned)."""

    # ------------------------------------------------------------------ the six writes

    async def _write(
        self, op: StoreOp, records: tuple[Record, ...], seq: int, forward: Any
    ) -> None:
        act = await self.before_write(op, records, seq)
        await forward()
        self.after_write(act, op, records, seq)

    async def write_run_started(self, record: RunStarted, *, seq: int, generation: int) -> None:
        """Forward, with the hooks around it."""
        await self._write(
            StoreOp.RUN_STARTED,
            (record,),
            seq,
            lambda: self.inner.write_run_started(record, seq=seq, generation=generation),
        )

    async def write_intent(
        self, record: ModelIntent | ActionIntent, *, seq: int, generation: int
    ) -> None:
        """Forward, with the hooks around it."""
        await self._write(
            StoreOp.INTENT,
            (record,),
            seq,
            lambda: self.inner.write_intent(record, seq=seq, generation=generation),
        )

    async def write_model_result(self, record: ModelResult, *, seq: int, generation: int) -> None:
        """Forward, with the hooks around it."""
        await self._write(
            StoreOp.MODEL_RESULT,
            (record,),
            seq,
            lambda: self.inner.write_model_result(record, seq=seq, generation=generation),
        )

    async def write_step(
        self,
        action_results: Sequence[ActionResult] | None,
        step: StepRecord,
        *,
        seq: int,
        generation: int,
    ) -> None:
        """Forward, with the hooks around it."""
        await self._write(
            StoreOp.STEP,
            (*(action_results or ()), step),
            seq,
            lambda: self.inner.write_step(action_results, step, seq=seq, generation=generation),
        )

    async def write_control(
        self,
        record: ControlRecord,
        *,
        seq: int,
        generation: int,
    ) -> None:
        """Forward, with the hooks around it."""
        await self._write(
            StoreOp.CONTROL,
            (record,),
            seq,
            lambda: self.inner.write_control(record, seq=seq, generation=generation),
        )

    async def write_run_finished(self, record: RunFinished, *, seq: int, generation: int) -> None:
        """Forward, with the hooks around it."""
        await self._write(
            StoreOp.RUN_FINISHED,
            (record,),
            seq,
            lambda: self.inner.write_run_finished(record, seq=seq, generation=generation),
        )

    # ------------------------------------------------------------------ forwarded as is

    async def read_log(self, run_id: str) -> RunLog:
        """Forward."""
        self.check_other()
        return await self.inner.read_log(run_id)

    async def list_runs(self) -> tuple[str, ...]:
        """Forward."""
        self.check_other()
        return await self.inner.list_runs()

    async def aclose(self) -> None:
        """Nothing to release: the inner store belongs to the caller."""


# ---------------------------------------------------------------------- the capabilities


class _ForwardsLeases(_Wrapper):
    """Forwards `LeaseStore` to the inner store."""

    __slots__ = ()

    def _leases(self) -> LeaseStore:
        self.check_other()
        assert isinstance(self.inner, LeaseStore)
        return self.inner

    async def acquire_lease(self, run_id: str, *, owner: str, ttl_s: float) -> Lease:
        """Forward."""
        return await self._leases().acquire_lease(run_id, owner=owner, ttl_s=ttl_s)

    async def renew_leases(self, leases: Sequence[Lease], *, ttl_s: float) -> tuple[Lease, ...]:
        """Forward."""
        return await self._leases().renew_leases(leases, ttl_s=ttl_s)

    async def release_lease(self, lease: Lease, *, control_seen: int = 0) -> None:
        """Forward."""
        await self._leases().release_lease(lease, control_seen=control_seen)

    async def read_lease(self, run_id: str) -> Lease | None:
        """Forward."""
        return await self._leases().read_lease(run_id)


class _ForwardsControls(_Wrapper):
    """Forwards `ControlStream` to the inner store."""

    __slots__ = ()

    def _controls(self) -> ControlStream:
        self.check_other()
        assert isinstance(self.inner, ControlStream)
        return self.inner

    async def append_control(self, record: CancelRequested | ApprovalDecided) -> ControlEntry:
        """Forward."""
        return await self._controls().append_control(record)

    async def read_control(self, run_id: str, *, after: int = 0) -> tuple[ControlEntry, ...]:
        """Forward."""
        return await self._controls().read_control(run_id, after=after)

    async def control_heads(self, run_ids: Sequence[str]) -> Mapping[str, int]:
        """Forward."""
        return await self._controls().control_heads(run_ids)


class _ForwardsIndex(_Wrapper):
    """Forwards `RunIndex` to the inner store."""

    __slots__ = ()

    def _index(self) -> RunIndex:
        self.check_other()
        assert isinstance(self.inner, RunIndex)
        return self.inner

    async def list_summaries(self, *, last: int | None = None) -> tuple[RunSummary, ...]:
        """Forward."""
        return await self._index().list_summaries(last=last)

    async def read_summary(self, run_id: str) -> RunSummary | None:
        """Forward."""
        return await self._index().read_summary(run_id)


class _ForwardsCounts(_Wrapper):
    """Forwards `RunCounts` to the inner store."""

    __slots__ = ()

    async def count_runs(self) -> Mapping[Liveness, int]:
        """Forward."""
        self.check_other()
        assert isinstance(self.inner, RunCounts)
        return await self.inner.count_runs()


class _ForwardsQueue(_Wrapper):
    """Forwards `RunQueue` to the inner store."""

    __slots__ = ()

    def _queue(self) -> RunQueue:
        self.check_other()
        assert isinstance(self.inner, RunQueue)
        return self.inner

    async def submit(
        self,
        run_id: str,
        *,
        agent: str,
        input: tuple[Message, ...],
        caps: BudgetCaps | None = None,
        parent: tuple[str, str] | None = None,
    ) -> Submission:
        """Forward."""
        return await self._queue().submit(
            run_id, agent=agent, input=input, caps=caps, parent=parent
        )

    async def claim(
        self,
        *,
        owner: str,
        agents: Mapping[str, Sequence[str]],
        limit: int,
        ttl_s: float,
        max_takeovers: int,
        backoff_s: float,
        driving: Collection[str] = (),
    ) -> tuple[Claim, ...]:
        """Forward."""
        return await self._queue().claim(
            owner=owner,
            agents=agents,
            limit=limit,
            ttl_s=ttl_s,
            max_takeovers=max_takeovers,
            backoff_s=backoff_s,
            driving=driving,
        )

    async def release_quarantine(self, run_id: str) -> bool:
        """Forward."""
        return await self._queue().release_quarantine(run_id)

    async def wake(self, run_id: str) -> bool:
        """Forward."""
        return await self._queue().wake(run_id)

    async def read_submission(self, run_id: str) -> Submission | None:
        """Forward."""
        return await self._queue().read_submission(run_id)


_CAPABILITIES: Final[tuple[tuple[type, type[_Wrapper]], ...]] = (
    (LeaseStore, _ForwardsLeases),
    (ControlStream, _ForwardsControls),
    (RunIndex, _ForwardsIndex),
    (RunCounts, _ForwardsCounts),
    (RunQueue, _ForwardsQueue),
)
"""Each capability protocol of `treadle.ports` and the mixin that forwards it."""

_MADE: dict[tuple[type, tuple[type[_Wrapper], ...]], type] = {}


def _with_capabilities_of(cls: type, inner: object) -> type:
    """``cls`` extended with the forwarding of each capability ``inner`` has (made once).

    The class keeps the name of ``cls``, so that messages naming the wrapper read as before.
    """
    mixins = tuple(mixin for protocol, mixin in _CAPABILITIES if isinstance(inner, protocol))
    if not mixins:
        return cls
    made = _MADE.get((cls, mixins))
    if made is None:
        namespace = {
            "__slots__": (),
            "__module__": cls.__module__,
            "__qualname__": cls.__qualname__,
        }
        made = _MADE[(cls, mixins)] = type(cls.__name__, (cls, *mixins), namespace)
    return made
