"""Fault injection for tests and simulations.

`CrashingStore` wraps any store and "crashes the process" at a chosen write: from then on
every operation raises `SimulatedCrash`, as if the process had died. Whether the write at the
crash point happened is chosen with ``when`` (``before``: it did not; ``after``: it did, but
the caller never learned). Reopening the inner store (or keeping the same memory store)
models the restart.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import attrs

from treadle.ports import RunStore
from treadle.types import (
    ActionIntent,
    ActionResult,
    ApprovalDecided,
    ApprovalRequested,
    CancelRequested,
    ModelIntent,
    ModelResult,
    RunFinished,
    RunLog,
    RunStarted,
    StepRecord,
)


class SimulatedCrash(Exception):
    """Raised by a fault-injecting wrapper once its simulated process has died."""


@attrs.define(eq=False)
class CrashingStore:
    """A `treadle.ports.RunStore` that dies at write number ``crash_at`` (1-based).

    Args:
        inner: the store that keeps what was written before the crash.
        crash_at: which write operation (counted over all runs) crashes.
        when: ``before`` (the write is lost) or ``after`` (it is stored, then the crash).

    Attributes:
        writes: write operations seen so far.
        crashed: whether the crash happened.
    """

    inner: RunStore
    crash_at: int
    when: Literal["before", "after"] = "before"
    writes: int = 0
    crashed: bool = False

    async def _guard(self) -> bool:
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

    async def write_run_started(self, record: RunStarted, *, seq: int) -> None:
        """Forward, crashing at the chosen write."""
        after = await self._guard()
        await self.inner.write_run_started(record, seq=seq)
        self._after(after)

    async def write_intent(self, record: ModelIntent | ActionIntent, *, seq: int) -> None:
        """Forward, crashing at the chosen write."""
        after = await self._guard()
        await self.inner.write_intent(record, seq=seq)
        self._after(after)

    async def write_model_result(self, record: ModelResult, *, seq: int) -> None:
        """Forward, crashing at the chosen write."""
        after = await self._guard()
        await self.inner.write_model_result(record, seq=seq)
        self._after(after)

    async def write_step(
        self, action_results: Sequence[ActionResult] | None, step: StepRecord, *, seq: int
    ) -> None:
        """Forward, crashing at the chosen write."""
        after = await self._guard()
        await self.inner.write_step(action_results, step, seq=seq)
        self._after(after)

    async def write_control(
        self, record: CancelRequested | ApprovalRequested | ApprovalDecided, *, seq: int
    ) -> None:
        """Forward, crashing at the chosen write."""
        after = await self._guard()
        await self.inner.write_control(record, seq=seq)
        self._after(after)

    async def write_run_finished(self, record: RunFinished, *, seq: int) -> None:
        """Forward, crashing at the chosen write."""
        after = await self._guard()
        await self.inner.write_run_finished(record, seq=seq)
        self._after(after)

    async def read_log(self, run_id: str) -> RunLog:
        """Forward unless dead."""
        if self.crashed:
            raise SimulatedCrash("the process is dead")
        return await self.inner.read_log(run_id)

    async def list_runs(self) -> tuple[str, ...]:
        """Forward unless dead."""
        if self.crashed:
            raise SimulatedCrash("the process is dead")
        return await self.inner.list_runs()

    async def aclose(self) -> None:
        """Nothing to release: the inner store belongs to the caller."""

    @staticmethod
    def _after(crash: bool) -> None:
        if crash:
            raise SimulatedCrash("crash after the write")
