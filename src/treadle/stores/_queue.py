"""The claiming rules of a fleet's queue, shared by every store that keeps one.

docs/fleet.md, "Claiming": a worker claims, oldest first and up to its free slots, the runs of
the agents (and agent versions) it serves that nobody drives live:

* a queued run (never started), whatever version the worker serves of its agent (a takeover
  when its last claimer died before it wrote run-started);
* an orphaned run: its driver's lease expired unreleased (a **takeover**: the driver died) or
  was released without finishing the run (a clean shutdown);
* a parked run (waiting for an approval, lease released) once its control stream grew past what
  its last driver handled, or its approval deadline passed;
* a run parked on child runs (``awaiting_child``) once its control stream grew, one of its
  children woke it (`treadle.ports.RunQueue.wake`), or its recheck instant passed
  (docs/child-runs.md, "In a fleet").

A run is never claimed while quarantined, before its backoff ends (``not_before``), or once
finished. A run whose drivers died ``max_takeovers`` times is quarantined instead of claimed.
The SQL stores pick candidates with a statement that states the coarse part of these rules,
then apply `claim_kind` to each candidate in the same transaction.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping, Sequence
from typing import Literal

import attrs

from treadle._exceptions import UsageError
from treadle.stores import _leases
from treadle.types import Lease, Message, RunState, Submission

ClaimKind = Literal["queued", "takeover", "resume"]


@attrs.frozen(kw_only=True)
class QueueRow:
    """The columns of a run's index row that the claiming rules read."""

    state: RunState | None
    agent: str | None
    agent_version: str | None
    lease: Lease | None
    control_head: int
    control_seen: int
    awaiting_until: str | None
    not_before: float
    quarantined: str | None
    takeovers: int


def claim_kind(row: QueueRow, agents: Mapping[str, Sequence[str]], now: float) -> ClaimKind | None:
    """How a worker serving ``agents`` may claim ``row`` at ``now``, or ``None``."""
    if row.quarantined or row.state is None or row.state.is_terminal:
        return None
    if row.agent is None or row.agent not in agents or row.not_before > now:
        return None
    if _leases.is_live(row.lease, now):
        return None
    died = row.lease is not None and bool(row.lease.owner)  # expired, never released
    if row.state is RunState.QUEUED:  # its claimer may have died before run-started
        return "takeover" if died else "queued"
    if row.agent_version is not None and row.agent_version not in agents[row.agent]:
        return None
    if died:
        return "takeover"
    if row.state in (RunState.AWAITING_APPROVAL, RunState.AWAITING_CHILD):
        deadline = row.awaiting_until is not None and epoch_of(row.awaiting_until) <= now
        if row.control_head <= row.control_seen and not deadline:
            return None
    return "resume"


def next_not_before(now: float, takeovers: int, backoff_s: float) -> float:
    """When a run claimed at ``now`` after ``takeovers`` deaths may be claimed again."""
    return now + backoff_s * float(2**takeovers - 1)


def quarantine_reason(takeovers: int, lease: Lease | None) -> str:
    """Why a run is quarantined (shown by ``treadle runs``).

    A takeover counts a driver's death and a failed drive alike (decision 0015): the reason
    says both, since which one it was is in the worker's log, not in the store.
    """
    last = f" (last driver {lease.owner})" if lease is not None and lease.owner else ""
    return (
        f"its drives ended unfinished {takeovers} times{last}: a driver died, or its drive "
        "failed (the worker's log says why: a damaged log, a changed definition, a store "
        "error; docs/decisions/0015-failed-drives-count-as-deaths.md); `treadle unquarantine "
        "RUN_ID` makes it claimable again"
    )


def still_quarantined(state: RunState | None, reason: str | None) -> str | None:
    """The quarantine a run summary shows: none once the run finished (nothing to claim)."""
    return None if state is not None and state.is_terminal else reason


def same_submission(
    run_id: str, earlier: Submission | None, agent: str, input: tuple[Message, ...]
) -> Submission:
    """The earlier submission of ``run_id``, when a new one repeats it.

    Raises:
        UsageError: the run was started without the queue, or for another agent or input.
    """
    if earlier is None:
        raise UsageError(f"run {run_id!r} exists and was not submitted to a queue")
    if earlier.agent != agent:
        raise UsageError(
            f"run {run_id!r} was already submitted for agent {earlier.agent!r}, not "
            f"{agent!r}; a run id names one run"
        )
    if earlier.input != input:
        raise UsageError(
            f"run {run_id!r} was already submitted for agent {earlier.agent!r} with another "
            "input; a run id names one run"
        )
    return earlier


def epoch_of(instant: str) -> float:
    """Epoch seconds of an ISO-8601 instant."""
    return float(dt.datetime.fromisoformat(instant).timestamp())
