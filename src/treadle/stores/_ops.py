"""The six write operations of `treadle.ports.RunStore`, implemented once for every store.

Each operation names its records and its `treadle.types.StoreOp`, which says whether it is a
barrier; every store persists the same thing for each: a batch of records at consecutive seqs,
checked against the writer's lease generation (docs/crash-safety.md, "The write protocol").
A store implements only `AppendStore._append`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from treadle.types import (
    ActionIntent,
    ActionResult,
    ControlRecord,
    ModelIntent,
    ModelResult,
    Record,
    RunFinished,
    RunStarted,
    StepRecord,
    StoreOp,
)

if TYPE_CHECKING:
    from treadle.metrics import MetricsRecorder
    from treadle.ports import RunStore
    from treadle.stores._engine import CommitEngine


class AppendStore:
    """Base of the stores: the six write operations as calls of `_append`."""

    __slots__ = ()

    async def _append(
        self,
        run_id: str,
        seq: int,
        records: tuple[Record, ...],
        *,
        op: StoreOp,
        generation: int,
    ) -> None:
        """Append ``records`` to ``run_id``'s log at seqs ``seq, seq + 1, ...``, atomically.

        Args:
            run_id: the run whose log grows.
            seq: the seq of the first record (1-based position in the run's log).
            records: one record, or a step's action results followed by its step record.
            op: the operation; ``op.barrier`` means: return only once this write and
                everything before it is durable.
            generation: the writer's lease generation.

        Raises:
            ConflictError: ``seq`` is not the run's next seq; nothing is written.
            LeaseLost: ``generation`` is not the run's current lease generation.
            StoreError: the write (or an earlier non-barrier one of the run) failed.
        """
        raise NotImplementedError

    async def write_run_started(self, record: RunStarted, *, seq: int, generation: int) -> None:
        """Append the run-started record (not a barrier)."""
        await self._append(
            record.run_id, seq, (record,), op=StoreOp.RUN_STARTED, generation=generation
        )

    async def write_intent(
        self, record: ModelIntent | ActionIntent, *, seq: int, generation: int
    ) -> None:
        """Append an intent; a barrier: durable, with all before it, on return."""
        await self._append(record.run_id, seq, (record,), op=StoreOp.INTENT, generation=generation)

    async def write_model_result(self, record: ModelResult, *, seq: int, generation: int) -> None:
        """Append a model-call result (not a barrier)."""
        await self._append(
            record.run_id, seq, (record,), op=StoreOp.MODEL_RESULT, generation=generation
        )

    async def write_step(
        self,
        action_results: Sequence[ActionResult] | None,
        step: StepRecord,
        *,
        seq: int,
        generation: int,
    ) -> None:
        """Append the action results and their step record as one atomic write (no barrier).

        ``action_results`` is required and ``None`` for a step without action; the records
        take seqs ``seq, seq + 1, ...`` with the step record last.
        """
        records: tuple[Record, ...] = (*(action_results or ()), step)
        await self._append(step.run_id, seq, records, op=StoreOp.STEP, generation=generation)

    async def write_control(
        self,
        record: ControlRecord,
        *,
        seq: int,
        generation: int,
    ) -> None:
        """Append a control record (approval, cancel, accepted definition); a barrier."""
        await self._append(record.run_id, seq, (record,), op=StoreOp.CONTROL, generation=generation)

    async def write_run_finished(self, record: RunFinished, *, seq: int, generation: int) -> None:
        """Append the run-finished record; a barrier."""
        await self._append(
            record.run_id, seq, (record,), op=StoreOp.RUN_FINISHED, generation=generation
        )


class EngineStore(AppendStore):
    """A store whose writes go through a commit engine (`treadle.stores._engine.CommitEngine`).

    The subclass sets ``self._engine`` when it is opened.
    """

    _engine: CommitEngine

    def same_database(self, other: object) -> bool:
        """Whether ``other`` is a store object on the same stored runs: here, this object.

        SQL stores also answer yes for another object on the same file or DSN and schema.
        """
        return other is self

    def observe_commits(self, metrics: MetricsRecorder | None) -> None:
        """Report each committed batch and each barrier's wait to ``metrics`` from now on.

        ``None`` stops reporting (docs/metrics.md, "What is counted").
        """
        self._engine.metrics = metrics

    async def _append(
        self,
        run_id: str,
        seq: int,
        records: tuple[Record, ...],
        *,
        op: StoreOp,
        generation: int,
    ) -> None:
        await self._engine.append(
            run_id,
            seq,
            records,
            generation=generation,
            barrier=op.barrier,
            closes=op is StoreOp.RUN_FINISHED,
        )


async def write_records(
    store: RunStore, records: Sequence[Record], *, seq: int, generation: int
) -> int:
    """Write one run's ``records`` through the typed operations, as a driver would.

    Each record goes through the operation of its kind; a step's action results and its step
    record are one `RunStore.write_step`.

    Returns:
        The seq after the last record written.

    Raises:
        ValueError: action results that no step record follows.
        ConflictError, LeaseLost, StoreError: as the store's writes.
    """
    pending: list[ActionResult] = []
    for record in records:
        if isinstance(record, ActionResult):
            pending.append(record)
            continue
        seq += await _write_one(store, record, pending, seq, generation)
        pending = []
    if pending:
        raise ValueError("action results must be followed by their step record")
    return seq


async def _write_one(
    store: RunStore, record: Record, results: list[ActionResult], seq: int, generation: int
) -> int:
    if isinstance(record, StepRecord):
        await store.write_step(results or None, record, seq=seq, generation=generation)
        return len(results) + 1
    if isinstance(record, RunStarted):
        await store.write_run_started(record, seq=seq, generation=generation)
    elif isinstance(record, ModelIntent | ActionIntent):
        await store.write_intent(record, seq=seq, generation=generation)
    elif isinstance(record, ModelResult):
        await store.write_model_result(record, seq=seq, generation=generation)
    elif isinstance(record, RunFinished):
        await store.write_run_finished(record, seq=seq, generation=generation)
    elif isinstance(record, ControlRecord):
        await store.write_control(record, seq=seq, generation=generation)
    else:  # an action result: only ever written with its step record
        raise TypeError(f"a {type(record).__name__} cannot be written on its own")
    return 1
