"""An in-process store: the whole log in memory, for tests and simulations.

Every operation checkpoints, so the store behaves like a real one under cancellation
(STYLE rule 14). Nothing survives the process; `MemoryStore.snapshot` and `MemoryStore.restore`
let a simulation model a process crash that keeps the durable prefix.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import trio

from treadle._exceptions import ConflictError, StoreError
from treadle.types import (
    ActionIntent,
    ActionResult,
    ApprovalDecided,
    ApprovalRequested,
    CancelRequested,
    ModelIntent,
    ModelResult,
    Record,
    RunFinished,
    RunLog,
    RunStarted,
    StepRecord,
)


@attrs.define(eq=False)
class MemoryStore:
    """A `treadle.ports.RunStore` that keeps every log in a dict.

    Every write is immediately "durable" (visible to `read_log`). Writes whose ``seq`` is
    not the next of the run raise `ConflictError`; writes after `aclose` raise `StoreError`.
    """

    _logs: dict[str, list[Record]] = attrs.field(factory=dict, alias="_logs")
    _closed: bool = attrs.field(default=False, alias="_closed")

    async def write_run_started(self, record: RunStarted, *, seq: int) -> None:
        """Append the run-started record."""
        await self._append(record.run_id, seq, (record,))

    async def write_intent(self, record: ModelIntent | ActionIntent, *, seq: int) -> None:
        """Append an intent (a barrier: durable on return)."""
        await self._append(record.run_id, seq, (record,))

    async def write_model_result(self, record: ModelResult, *, seq: int) -> None:
        """Append a model-call result."""
        await self._append(record.run_id, seq, (record,))

    async def write_step(
        self, action_results: Sequence[ActionResult] | None, step: StepRecord, *, seq: int
    ) -> None:
        """Append the action results and the step record atomically."""
        await self._append(step.run_id, seq, (*(action_results or ()), step))

    async def write_control(
        self, record: CancelRequested | ApprovalRequested | ApprovalDecided, *, seq: int
    ) -> None:
        """Append an approval or cancel record (a barrier)."""
        await self._append(record.run_id, seq, (record,))

    async def write_run_finished(self, record: RunFinished, *, seq: int) -> None:
        """Append the run-finished record (a barrier)."""
        await self._append(record.run_id, seq, (record,))

    async def read_log(self, run_id: str) -> RunLog:
        """Return the run's log; an empty log for a run that does not exist."""
        await trio.lowlevel.checkpoint()
        return RunLog(run_id=run_id, records=tuple(self._logs.get(run_id, ())))

    async def list_runs(self) -> tuple[str, ...]:
        """Every run id with at least one record, in first-write order."""
        await trio.lowlevel.checkpoint()
        return tuple(self._logs)

    async def aclose(self) -> None:
        """Refuse further writes."""
        await trio.lowlevel.checkpoint()
        self._closed = True

    async def _append(self, run_id: str, seq: int, records: tuple[Record, ...]) -> None:
        await trio.lowlevel.checkpoint()
        if self._closed:
            raise StoreError("the memory store is closed")
        log = self._logs.setdefault(run_id, [])
        if seq != len(log) + 1:
            if not log:
                del self._logs[run_id]
            raise ConflictError(run_id, expected=len(log) + 1, got=seq)
        log.extend(records)
