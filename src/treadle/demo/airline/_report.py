"""Scoring a replayed run and comparing it with its recording (`ReplayReport`).

Part of `treadle.demo.airline.replay`, which re-exports the public names (docs/demo.md).
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import attrs

from treadle.demo.airline._discovery import run_id_of
from treadle.demo.airline._workspace import RunCounts
from treadle.demo.airline.agent import (
    RESPOND_TOOL,
)
from treadle.demo.airline.data import (
    Recording,
)
from treadle.demo.airline.db import AirlineDatabase
from treadle.demo.airline.scoring import (
    expected_data_hash,
    recorded_tool_calls,
    replay_tool_calls,
    score,
)
from treadle.demo.airline.tools import WRITE_TOOLS
from treadle.types import (
    ActionResult,
    ActionStatus,
    DecisionKind,
    RunLog,
    StopReason,
)


@attrs.frozen(kw_only=True)
class ReplayReport:
    """How a recording's replay went.

    Attributes:
        task_id / trial: the recording.
        recorded_reward: the benchmark's score of the recording.
        reward: our score of the replay (`treadle.demo.airline.scoring.score`).
        tool_calls: airline tool calls the run made (replies to the customer not counted).
        observations_matching: those whose output equals the recorded output exactly (the
            n-th call of the run is compared with the n-th recorded call: same call id, same
            tool, same output text).
        history_mismatches: model requests whose history differed from the recording's,
            over every invocation that drove the run.
        crashes: driver processes of the run killed with SIGKILL.
        resumes: driver processes that resumed the run from its log.
        run_id: ``airline-<task_id>-<trial>``.
        stop_reason: why the run ended.
        recorded_tool_calls: tool calls in the recording.
        writes_applied: database changes in the conversation's ``applied_actions``.
        writes_in_log: executed database-changing actions in the run's log.
        applied_once: every change in the database belongs to exactly one logged action,
            and every logged change is in the database once.
        db_matches_recording: the final database equals a fresh one to which the recorded
            tool calls were applied directly.
        error: why the run could not be replayed; ``None`` when it was. The other figures
            are then the run's as far as it got (its log, database and counts as stored):
            its score is 0.0 and its database is not the recorded calls' result.
    """

    task_id: int
    trial: int
    recorded_reward: float
    reward: float
    tool_calls: int
    observations_matching: int
    history_mismatches: int
    crashes: int
    resumes: int
    run_id: str
    stop_reason: str | None
    recorded_tool_calls: int
    writes_applied: int
    writes_in_log: int
    applied_once: bool
    db_matches_recording: bool
    error: str | None = None

    def to_json(self) -> dict[str, Any]:
        """The report as a JSON object: the nine summary fields first, then the details."""
        return attrs.asdict(self)


def _write_results(log: RunLog) -> list[ActionResult]:
    return [
        r
        for r in log.records
        if isinstance(r, ActionResult)
        and r.tool in WRITE_TOOLS
        and r.outcome.status is ActionStatus.EXECUTED
    ]


def _observations(log: RunLog) -> dict[str, str]:
    """Intent id -> the observation text that entered history."""
    found: dict[str, str] = {}
    for step in log.steps:
        found.update(zip(step.action_result_ids, step.observations, strict=False))
    return found


def agent_replies(log: RunLog) -> list[str]:
    """What the agent said to the customer in a run: text replies without tool calls."""
    replies = []
    for step in log.steps:
        message = step.history_message
        if step.decision is DecisionKind.INVALID or message is None:
            continue
        if message.content and not message.tool_calls:
            replies.append(message.content)
    return replies


@attrs.frozen(kw_only=True)
class _Expected:
    """What a recording's replay is compared with."""

    data_hash: str
    recorded_calls_hash: str


def expected_for(
    recording: Recording, fresh: AirlineDatabase, *, task_hash: str | None = None
) -> _Expected:
    """The ground-truth hash of the task and the hash after the recorded calls (slow-ish).

    ``task_hash`` is the task's ground-truth hash when already known (the same for every
    trial of a task).
    """
    with tempfile.TemporaryDirectory(prefix="treadle-airline-") as tmp:
        copy = fresh.copy_to(Path(tmp) / "recorded.sqlite3")
        replay_tool_calls(recording, copy)
        recorded = copy.data_hash()
    expected = task_hash if task_hash is not None else expected_data_hash(recording.task, fresh)
    return _Expected(data_hash=expected, recorded_calls_hash=recorded)


def build_report(
    recording: Recording,
    log: RunLog,
    db: AirlineDatabase,
    fresh: AirlineDatabase,
    *,
    counts: RunCounts,
    mismatches: int,
    expected: _Expected,
) -> ReplayReport:
    """Score a replay and compare it with the recording (reads both databases).

    An unfinished run (``log.finished`` is ``None``) is scored 0.0; its other figures are
    what its log and database hold so far.
    """
    finished = log.finished
    tool_results = [
        r for r in log.records if isinstance(r, ActionResult) and r.tool != RESPOND_TOOL
    ]
    recorded = recorded_tool_calls(recording)
    observations = _observations(log)
    # Call ids repeat within some recordings, so calls are paired by position.
    matching = sum(
        1
        for r, (call_id, tool, _, output) in zip(tool_results, recorded, strict=False)
        if (r.call_id, r.tool, observations.get(r.intent_id)) == (call_id, tool, output)
    )
    completed = finished is not None and finished.stop_reason is StopReason.TASK_COMPLETED
    result = score(
        db,
        recording.task,
        agent_replies(log),
        completed=completed,
        fresh=fresh,
        expected_hash=expected.data_hash,
    )
    applied = db.applied_actions()
    logged = _write_results(log)
    applied_ids = sorted(intent for intent, _, _ in applied)
    return ReplayReport(
        task_id=recording.task_id,
        trial=recording.trial,
        recorded_reward=recording.reward,
        reward=result.reward,
        tool_calls=len(tool_results),
        observations_matching=matching,
        history_mismatches=mismatches,
        crashes=counts.crashes,
        resumes=counts.resumes,
        run_id=run_id_of(recording),
        stop_reason=finished.stop_reason.value if finished else None,
        recorded_tool_calls=len(recorded),
        writes_applied=len(applied),
        writes_in_log=len(logged),
        applied_once=applied_ids == sorted(r.intent_id for r in logged),
        db_matches_recording=result.data_hash == expected.recorded_calls_hash,
    )


def failed_report(recording: Recording, counts: RunCounts, error: str) -> ReplayReport:
    """The report of a recording whose conversation database is missing: nothing to read."""
    return ReplayReport(
        task_id=recording.task_id,
        trial=recording.trial,
        recorded_reward=recording.reward,
        reward=0.0,
        tool_calls=0,
        observations_matching=0,
        history_mismatches=0,
        crashes=counts.crashes,
        resumes=counts.resumes,
        run_id=run_id_of(recording),
        stop_reason=None,
        recorded_tool_calls=len(recorded_tool_calls(recording)),
        writes_applied=0,
        writes_in_log=0,
        applied_once=False,
        db_matches_recording=False,
        error=error,
    )
