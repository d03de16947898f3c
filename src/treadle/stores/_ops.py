"""The six write operations of `treadle.ports.RunStore`, mapped onto one append.

Every store persists the same thing for each operation: a batch of records at consecutive
seqs, some of them barriers (DESIGN §4). `AppendStore` spells the six operations out once;
a store implements `AppendStore._append`.
"""

from __future__ import annotations

from collections.abc import Sequence

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
    RunStarted,
    StepRecord,
)


class AppendStore:
    """Base of the stores: the six write operations as calls of `_append`."""

    __slots__ = ()

    async def _append(
        self,
        run_id: str,
        seq: int,
        records: tuple[Record, ...],
        *,
        barrier: bool,
        closes: bool = False,
    ) -> None:
        """Append ``records`` to ``run_id``'s log at seqs ``seq, seq + 1, ...``, atomically.

        Args:
            run_id: the run whose log grows.
            seq: the seq of the first record (1-based position in the run's log).
            records: one record, or a step's action results followed by its step record.
            barrier: return only once this write and everything before it is durable.
            closes: the write is the run's run-finished record.

        Raises:
            ConflictError: ``seq`` is not the run's next seq; nothing is written.
            StoreError: the write (or an earlier non-barrier one of the run) failed.
        """
        raise NotImplementedError

    async def write_run_started(self, record: RunStarted, *, seq: int) -> None:
        """Append the run-started record (not a barrier)."""
        await self._append(record.run_id, seq, (record,), barrier=False)

    async def write_intent(self, record: ModelIntent | ActionIntent, *, seq: int) -> None:
        """Append an intent; a barrier: durable, with all before it, on return."""
        await self._append(record.run_id, seq, (record,), barrier=True)

    async def write_model_result(self, record: ModelResult, *, seq: int) -> None:
        """Append a model-call result (not a barrier)."""
        await self._append(record.run_id, seq, (record,), barrier=False)

    async def write_step(
        self, action_results: Sequence[ActionResult] | None, step: StepRecord, *, seq: int
    ) -> None:
        """Append the action results and their step record as one atomic write (no barrier).

        ``action_results`` is required and ``None`` for a step without action; the records
        take seqs ``seq, seq + 1, ...`` with the step record last.
        """
        await self._append(step.run_id, seq, (*(action_results or ()), step), barrier=False)

    async def write_control(
        self, record: CancelRequested | ApprovalRequested | ApprovalDecided, *, seq: int
    ) -> None:
        """Append an approval or cancel record; a barrier."""
        await self._append(record.run_id, seq, (record,), barrier=True)

    async def write_run_finished(self, record: RunFinished, *, seq: int) -> None:
        """Append the run-finished record; a barrier."""
        await self._append(record.run_id, seq, (record,), barrier=True, closes=True)
