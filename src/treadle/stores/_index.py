"""What a write changes in its run's index row (one rule for every store that keeps an index).

A store with a run index (`treadle.ports.RunIndex`) keeps one row per run: its state, agent,
step count, stop reason and approval deadline, so that listing runs never reads their logs.
The row changes in the same transaction as the write that changes it; `index_delta` says how,
from the write's records alone. Most writes change nothing but the next seq.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from treadle.types import (
    ApprovalDecided,
    ApprovalRequested,
    CancelRequested,
    DefinitionAccepted,
    Record,
    RunFinished,
    RunStarted,
    RunState,
    StepRecord,
    StopReason,
)


@attrs.frozen(kw_only=True)
class IndexDelta:
    """The index columns a write sets (``None``: unchanged).

    Attributes:
        state: the run's new state.
        agent: the agent name recorded at run start.
        agent_version: the agent version recorded at run start.
        started_at: the run-started instant (ISO-8601 UTC).
        steps: the number of the last step record written.
        stop_reason: the stop reason, once finished.
        awaiting_until: the approval deadline (ISO-8601); ``""`` clears it.
    """

    state: RunState | None = None
    agent: str | None = None
    agent_version: str | None = None
    started_at: str | None = None
    steps: int | None = None
    stop_reason: StopReason | None = None
    awaiting_until: str | None = None


_NOTHING = IndexDelta()


def index_delta(records: Sequence[Record]) -> IndexDelta | None:
    """The index change of a write of ``records`` (applied in order); ``None`` for none."""
    delta = _NOTHING
    for record in records:
        delta = _apply(delta, record)
    return None if delta is _NOTHING else delta


def _apply(delta: IndexDelta, record: Record) -> IndexDelta:
    if isinstance(record, StepRecord):
        return attrs.evolve(delta, steps=record.step)
    if isinstance(record, RunStarted):
        return attrs.evolve(
            delta,
            state=RunState.RUNNING,
            agent=record.agent,
            agent_version=record.agent_version,
            started_at=record.ts,
        )
    if isinstance(record, ApprovalRequested):
        return attrs.evolve(
            delta, state=RunState.AWAITING_APPROVAL, awaiting_until=record.deadline_ts
        )
    if isinstance(record, ApprovalDecided):
        return attrs.evolve(delta, state=RunState.RUNNING, awaiting_until="")
    if isinstance(record, CancelRequested):
        return attrs.evolve(delta, state=RunState.CANCELLING, awaiting_until="")
    if isinstance(record, DefinitionAccepted):
        return attrs.evolve(delta, agent_version=record.agent_version)
    if isinstance(record, RunFinished):
        return attrs.evolve(
            delta,
            state=record.state,
            stop_reason=record.stop_reason,
            steps=record.totals.steps,
            awaiting_until="",
        )
    return delta


def fold_delta(deltas: Sequence[IndexDelta]) -> IndexDelta:
    """Several deltas of one run applied in order, as one."""
    out = _NOTHING
    for delta in deltas:
        out = attrs.evolve(
            out, **{k: v for k, v in attrs.asdict(delta, recurse=False).items() if v is not None}
        )
    return out
