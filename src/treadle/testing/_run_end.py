"""Invariants of how a run ended: its run-finished record and its cancel, against its log.

Part of `treadle.testing.invariants`, which re-exports `check_run_finished` and
`check_cancel` and runs both in `check_invariants` (docs/simulation.md, "Invariants checked
after every run").
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from treadle.types import (
    CancelRequested,
    DecisionKind,
    DefinitionAccepted,
    Record,
    RunFinished,
    RunLog,
    StepRecord,
    StopReason,
    final_state,
)

ACTIVE_S_TOLERANCE = 1e-6
"""Seconds the run-finished active time may differ from its step records' sum by: both are
rounded to microseconds when written (`treadle.types.Totals.active_s`)."""

_CUT_IN_A_STEP = frozenset(
    {
        StopReason.CANCELLED,
        StopReason.TIME_BUDGET,
        StopReason.TOKEN_BUDGET,
        StopReason.MAX_MODEL_ATTEMPTS,
    }
)
"""Stop reasons that can end a run in the middle of a step, which then has no step record
but whose active time the totals count (docs/design.md, "The stop rules")."""


def check_run_finished(log: RunLog) -> list[str]:
    """The run-finished record agrees with itself and with the log before it.

    - its state is its stop reason's: ``task_completed`` and ``final_answer`` succeeded,
      ``cancelled`` cancelled, every other reason failed (docs/concepts.md, "Stop reasons");
    - a stop reason read off the last step holds of the log's last step record
      (docs/design.md, "The stop rules"): ``final_answer`` a step decided as the final
      answer, ``task_completed`` a step whose action signalled completion, ``env_error`` one
      whose action's environment failed, ``model_error`` one whose model call failed for good
      (no decision);
    - a run ended ``final_answer`` holds that step's visible text as its final answer and the
      step's output as its output; a run ended otherwise has no output
      (docs/structured-output.md, "Where the output is stored");
    - its active time is the step records' sum, to the microsecond; more only when the run
      stopped in the middle of a step (a cancel, the time or token budget, the attempt
      budget: that step's time has no step record), never less.

    A log that does not end with a run-finished is not checked here (`check_invariants`
    says so).

    Returns:
        One sentence per violation.
    """
    finished = log.finished
    records = log.records
    if finished is None or not records or records[-1] is not finished:
        return []
    steps = log.steps
    last = steps[-1] if steps else None
    problems = _state_of_its_reason(log.run_id, finished)
    problems.extend(_reason_holds_of_last_step(log.run_id, finished, last))
    problems.extend(_answer_is_the_steps(log.run_id, finished, last))
    problems.extend(_active_time_is_the_steps(log.run_id, finished, steps))
    return problems


def _state_of_its_reason(run_id: str, finished: RunFinished) -> list[str]:
    expected = final_state(finished.stop_reason)
    if finished.state is expected:
        return []
    return [
        f"{run_id}: the run finished {finished.state.value} with stop reason "
        f"{finished.stop_reason.value}, which ends a run {expected.value}"
    ]


def _reason_holds_of_last_step(
    run_id: str, finished: RunFinished, last: StepRecord | None
) -> list[str]:
    """The rule B, C, D or F that ended the run holds of the last step record."""
    reason = finished.stop_reason
    if reason is StopReason.FINAL_ANSWER:
        holds = last is not None and last.decision is DecisionKind.FINAL_ANSWER
        wanted = "decided as the final answer"
    elif reason is StopReason.TASK_COMPLETED:
        holds = last is not None and last.task_completed
        wanted = "whose action signalled completion"
    elif reason is StopReason.ENV_ERROR:
        holds = last is not None and last.env_error
        wanted = "whose action's environment failed"
    elif reason is StopReason.MODEL_ERROR:
        holds = last is not None and last.decision is None
        wanted = "whose model call failed for good"
    else:
        return []
    if holds:
        return []
    shown = "no step" if last is None else f"step {last.step} ({_decided(last)})"
    return [
        f"{run_id}: the run finished {reason.value}, but its last step is {shown}, not one {wanted}"
    ]


def _decided(step: StepRecord) -> str:
    return step.decision.value if step.decision is not None else "no decision"


def _answer_is_the_steps(run_id: str, finished: RunFinished, last: StepRecord | None) -> list[str]:
    """The final answer and output are the answering step's; no output without one."""
    if finished.stop_reason is not StopReason.FINAL_ANSWER:
        if finished.output is None:
            return []
        return [
            f"{run_id}: the run finished {finished.stop_reason.value} with an output; only a "
            "run ended final_answer has one"
        ]
    if last is None or last.decision is not DecisionKind.FINAL_ANSWER:
        return []  # `_reason_holds_of_last_step` says so
    problems: list[str] = []
    if finished.final_answer != last.model_output_text:
        problems.append(
            f"{run_id}: the final answer {finished.final_answer!r} is not the text of step "
            f"{last.step}, which answered {last.model_output_text!r}"
        )
    if finished.output != last.output:
        problems.append(
            f"{run_id}: the run's output {finished.output!r} is not step {last.step}'s "
            f"output {last.output!r}"
        )
    return problems


def _active_time_is_the_steps(
    run_id: str, finished: RunFinished, steps: Sequence[StepRecord]
) -> list[str]:
    """The totals' active time is the steps' sum, plus a step cut in its middle."""
    total = finished.totals.active_s
    summed = 0.0
    for step in steps:  # in log order, as the run's view adds them
        summed += step.active_s
    if math.isclose(total, summed, rel_tol=0.0, abs_tol=ACTIVE_S_TOLERANCE):
        return []
    if total > summed and finished.stop_reason in _CUT_IN_A_STEP:
        return []  # the step the run stopped in counts, without a step record
    return [
        f"{run_id}: the run-finished active time {total:.6f} s is not its step records' "
        f"{summed:.6f} s, and the run did not stop in the middle of a step that could "
        "account for more"
        if total > summed
        else f"{run_id}: the run-finished active time {total:.6f} s is less than its step "
        f"records' {summed:.6f} s"
    ]


def check_cancel(log: RunLog) -> list[str]:
    """A cancel is recorded where docs/events.md, "Cancellation" puts it.

    - every intent comes before the ``cancel_requested`` record, which is followed only by
      ``run_finished``; a drive resumed in between under a changed definition writes its
      ``definition_accepted`` record first (docs/events.md, "Event types"), so that one may
      stand between them too. So a log holds one cancel at most;
    - a run whose log holds a cancel ended ``cancelled`` (rule A comes first:
      docs/concepts.md, "Stop reasons"), and a run that ended ``cancelled`` has its cancel
      in its log.

    Returns:
        One sentence per violation.
    """
    records = log.records
    at = next((i for i, r in enumerate(records) if isinstance(r, CancelRequested)), None)
    problems: list[str] = []
    if at is not None:
        problems.extend(_only_the_end_follows(log.run_id, at, records[at + 1 :]))
    finished = log.finished
    if finished is None:
        return problems
    cancelled = finished.stop_reason is StopReason.CANCELLED
    if at is not None and not cancelled:
        problems.append(
            f"{log.run_id}: the log holds a cancel (record {at + 1}), but the run finished "
            f"{finished.state.value} ({finished.stop_reason.value})"
        )
    if at is None and cancelled:
        problems.append(f"{log.run_id}: the run finished cancelled without a cancel in its log")
    return problems


def _only_the_end_follows(run_id: str, at: int, after: Sequence[Record]) -> list[str]:
    """Nothing but run-finished (and an accepted definition) after the cancel at ``at``."""
    for offset, record in enumerate(after, start=at + 2):
        if not isinstance(record, RunFinished | DefinitionAccepted):
            return [
                f"{run_id}: record {offset} ({type(record).__name__}) follows the cancel "
                f"(record {at + 1}), which only run-finished follows"
            ]
    return []
