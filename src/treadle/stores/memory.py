"""An in-process store: the whole log in memory, for tests and simulations.

Every operation checkpoints, so the store behaves like a real one under cancellation
(STYLE rule 14). Nothing survives the process; `MemoryStore.snapshot` and `MemoryStore.restore`
let a simulation model a process crash that keeps the durable prefix.
"""

from __future__ import annotations

import attrs
import trio

from treadle._exceptions import ConflictError, StoreError
from treadle.stores._ops import AppendStore
from treadle.types import (
    Record,
    RunLog,
)


@attrs.define(eq=False)
class MemoryStore(AppendStore):
    """A `treadle.ports.RunStore` that keeps every log in a dict.

    Every write is immediately "durable" (visible to `read_log`). Writes whose ``seq`` is
    not the next of the run raise `ConflictError`; writes after `aclose` raise `StoreError`.
    """

    _logs: dict[str, list[Record]] = attrs.field(factory=dict, alias="_logs")
    _closed: bool = attrs.field(default=False, alias="_closed")

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

    async def _append(
        self,
        run_id: str,
        seq: int,
        records: tuple[Record, ...],
        *,
        barrier: bool,
        closes: bool = False,
    ) -> None:
        await trio.lowlevel.checkpoint()
        if self._closed:
            raise StoreError("the memory store is closed")
        log = self._logs.setdefault(run_id, [])
        if seq != len(log) + 1:
            if not log:
                del self._logs[run_id]
            raise ConflictError(run_id, expected=len(log) + 1, got=seq)
        log.extend(records)
