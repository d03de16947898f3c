"""What a write changes in its run's index row (one rule for every store that keeps an index).

A store with a run index (`treadle.ports.RunIndex`) keeps one row per run: its state, agent,
step count, stop reason and approval deadline, so that listing runs never reads their logs.
The row changes in the same transaction as the write that changes it; `index_delta` says how,
from the write's records alone. Most writes change nothing but the next seq.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Final

import attrs

from treadle._exceptions import UsageError
from treadle.types import (
    ApprovalDecided,
    ApprovalRequested,
    CancelRequested,
    ChildrenAwaited,
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
        awaiting_until: the approval deadline, or when a run waiting on child runs is
            claimable again without a wake-up (ISO-8601); ``""`` clears it.
        unpark: a step record was written: a row in state ``awaiting_child`` becomes
            ``running`` with no ``awaiting_until`` (any other state stays; ``state``, when
            set too, wins). Every step sets it, so a store applies it without a statement
            of its own where it can (SQLite's trigger, PostgreSQL's commit statement).
    """

    state: RunState | None = None
    agent: str | None = None
    agent_version: str | None = None
    started_at: str | None = None
    steps: int | None = None
    stop_reason: StopReason | None = None
    awaiting_until: str | None = None
    unpark: bool | None = None


_NOTHING = IndexDelta()


def index_delta(records: Sequence[Record]) -> IndexDelta | None:
    """The index change of a write of ``records`` (applied in order); ``None`` for none."""
    changes: dict[str, object] = {}
    for record in records:
        rule = _RULES.get(type(record))
        if rule is not None:
            _merge(changes, rule(record))
    return IndexDelta(**changes) if changes else None  # type: ignore[arg-type]


def _merge(changes: dict[str, object], later: dict[str, object]) -> None:
    """Apply the changes ``later`` onto ``changes``, resolving an unpark of a parked state."""
    if later.get("unpark") and changes.get("state") is RunState.AWAITING_CHILD:
        changes.update(state=RunState.RUNNING, awaiting_until="")
    changes.update(later)


def _step(record: StepRecord) -> dict[str, object]:
    # A step record ends a wait on child runs (the resumed step got its results).
    return {"steps": record.step, "unpark": True}


def _started(record: RunStarted) -> dict[str, object]:
    return {
        "state": RunState.RUNNING,
        "agent": record.agent,
        "agent_version": record.agent_version,
        "started_at": record.ts,
    }


def _approval_requested(record: ApprovalRequested) -> dict[str, object]:
    return {"state": RunState.AWAITING_APPROVAL, "awaiting_until": record.deadline_ts}


def _children_awaited(record: ChildrenAwaited) -> dict[str, object]:
    return {"state": RunState.AWAITING_CHILD, "awaiting_until": record.recheck_ts}


def _approval_decided(record: ApprovalDecided) -> dict[str, object]:
    return {"state": RunState.RUNNING, "awaiting_until": ""}


def _cancel_requested(record: CancelRequested) -> dict[str, object]:
    return {"state": RunState.CANCELLING, "awaiting_until": ""}


def _definition_accepted(record: DefinitionAccepted) -> dict[str, object]:
    return {"agent_version": record.agent_version}


def _finished(record: RunFinished) -> dict[str, object]:
    return {
        "state": record.state,
        "stop_reason": record.stop_reason,
        "steps": record.totals.steps,
        "awaiting_until": "",
    }


# The record types that change a run's index row; every other type changes only next seq.
_RULES: dict[type, Callable[[Any], dict[str, object]]] = {
    StepRecord: _step,
    RunStarted: _started,
    ApprovalRequested: _approval_requested,
    ApprovalDecided: _approval_decided,
    ChildrenAwaited: _children_awaited,
    CancelRequested: _cancel_requested,
    DefinitionAccepted: _definition_accepted,
    RunFinished: _finished,
}


def fold_delta(deltas: Sequence[IndexDelta]) -> IndexDelta:
    """Several deltas of one run applied in order, as one."""
    if len(deltas) == 1:
        return deltas[0]
    if not deltas:
        return _NOTHING
    changes: dict[str, object] = {}
    for delta in deltas:
        _merge(changes, {n: v for n in _FIELDS if (v := getattr(delta, n)) is not None})
    return IndexDelta(**changes)  # type: ignore[arg-type]


_FIELDS = tuple(field.name for field in attrs.fields(IndexDelta))


MAX_LAST: Final = 2**63 - 1
"""The largest ``last`` a store lists with: the largest SQL integer, more runs than any store
holds; a larger one lists every run as this one does."""


def checked_last(last: int | None) -> int | None:
    """The ``last`` of `treadle.ports.RunIndex.list_summaries` to list with, at most `MAX_LAST`.

    Any ``last`` at or above the number of runs lists every run; one beyond the range of an
    SQL integer was sent to the database as it was, and SQLite and PostgreSQL refused it as if
    the store were broken.

    Returns:
        ``None`` for ``None`` (every run), else ``min(last, MAX_LAST)``.

    Raises:
        UsageError: ``last`` is below 1.
    """
    if last is None:
        return None
    if last < 1:
        raise UsageError(f"last must be at least 1 (or None for every run), not {last}")
    return min(last, MAX_LAST)
