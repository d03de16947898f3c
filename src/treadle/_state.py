"""Folding a run's log into the state the step loop needs (pure, no I/O).

`RunView` is derived from the log only, so a resumed run and a live run that wrote the same
records agree on every counter. `PendingStep` describes the step in progress at the log's tail
(records after the last step record), which is what the resume table of docs/crash-safety.md,
"Resume" acts on.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping
from typing import TypeGuard

import attrs

from treadle._budget import Summary
from treadle.revisions import RevisionTable, fold_revisions
from treadle.types import (
    ActionIntent,
    ActionOutcome,
    ActionResult,
    ActionStatus,
    ApprovalDecided,
    ApprovalRequested,
    CancelRequested,
    ChildrenAwaited,
    DecisionKind,
    Message,
    ModelIntent,
    ModelReply,
    ModelResult,
    Record,
    RunFinished,
    StepRecord,
    SyntheticObservations,
    Totals,
    Usage,
)

CONTEXT_LENGTH = "context_length_exceeded"
"""The error kind of an attempt the provider refused for its context length."""

EMPTY_SUMMARY = "empty_summary"
"""The error kind of a summariser's reply without text (docs/context.md, "Summaries")."""


@attrs.define(eq=False)
class PendingStep:
    """What the log holds of the step after the last step record.

    Attributes:
        step: its index.
        attempts: model attempts already made in this step (failed or abandoned included).
        open_model_intent: a model intent whose result was never stored (outcome unknown).
        failures: failed attempts of this step, in order (abandoned ones included).
        refusals: the failed attempts of this step (its own call's or a summary's) that
            the provider refused for their context length (docs/context.md,
            "Context-length errors"), in order.
        call_failures: failed attempts of the model call at the log's tail (retry counting,
            `failures_of`).
        call_summary: whether that call is a summary's (``True``) or the step's own
            (``False``); ``None`` when no call is in progress (none failed yet, or the last
            one ended with a summary or a refusal for length).
        reply: the stored successful reply, if the model call finished.
        reply_intent_id: the intent id of that reply.
        action_intents: action intents already written for the reply, in call order.
        approvals: approval decisions recorded in this step, by call id.
        approval_requests: approval requests recorded in this step, by call id.
        recorded_s: seconds of this step's model attempts as their results recorded them
            (``latency_s``); a step resumed after a crash counts them as active time.
        children_awaited: the latest record of the step parking on child runs, or ``None``
            (docs/child-runs.md, "In a fleet").
    """

    step: int
    attempts: int = 0
    open_model_intent: ModelIntent | None = None
    failures: list[ModelResult] = attrs.Factory(list)
    refusals: list[ModelResult] = attrs.Factory(list)
    call_failures: int = 0
    call_summary: bool | None = None
    reply: ModelReply | None = None
    reply_intent_id: str | None = None
    action_intents: list[ActionIntent] = attrs.Factory(list)
    approvals: dict[str, ApprovalDecided] = attrs.Factory(dict)
    approval_requests: dict[str, ApprovalRequested] = attrs.Factory(dict)
    recorded_s: float = 0.0
    children_awaited: ChildrenAwaited | None = None

    def failures_of(self, *, summary: bool) -> int:
        """Failed attempts already made of the next model call of this kind, 0 or more.

        A model call is one summary (each a call of its own, docs/context.md, "Summaries")
        or the step's own call; its retries (`treadle.types.Limits.max_model_retries`) count
        only its own failed attempts. A summary written ends its call, and so does a refusal
        for length: the step's call after the compaction is a new one. A resumed step counts
        the same from the log as the live step did.
        """
        return self.call_failures if self.call_summary is summary else 0

    def add_failure(self, record: ModelResult, *, summary: bool) -> None:
        """Fold a failed or abandoned attempt, of a summary's call when ``summary``."""
        self.failures.append(record)
        if self.call_summary is not summary:
            self.call_summary, self.call_failures = summary, 0
        self.call_failures += 1
        error = record.error
        if error is not None and error.kind == CONTEXT_LENGTH:
            self.refusals.append(record)
            self.call_summary, self.call_failures = None, 0


@attrs.define(eq=False)
class RunView:
    """Counters and flags of a run, folded from its log.

    The stop rules of docs/concepts.md, "Stop reasons" read these.

    Attributes:
        next_seq: the seq the next record gets.
        steps: completed steps.
        model_attempts: every model attempt (abandoned and failed included).
        input_tokens / output_tokens: sums of reported usage (``None`` until one is reported).
        other_tokens: tokens reported in totals beyond their parts (`treadle.types.Totals`).
        unknown_usage_attempts: attempts that reported no usage.
        unmetered_replies: replies (a step's or a summary's) whose usage reported no count of
            tokens: under a token budget, the first one ends the run (docs/decisions/0114).
        active_s: active seconds of the completed steps.
        consecutive_invalid: invalid decisions in a row at the end of the log.
        last_step: the last step record, if any.
        cancel: the cancel request, if one was recorded.
        finished: the run-finished record, if the run is finished.
        pending: the step in progress at the tail.
        revisions: the revisions of resources the run observed, by resource key, each
            key's distinct revisions with the latest observed last: folded from the
            executed, applied (not late) action results (docs/concepts.md, "Stale writes").
        summary: the latest durable summary (a compaction's result), ``None`` for none
            (docs/context.md, "Summaries and resume").
        calibration: ``(counted, reported)`` input tokens of the latest step request (not a
            summary's) whose result has a context record and a reported input size
            (docs/context.md, "Counting tokens").
    """

    next_seq: int = 1
    steps: int = 0
    model_attempts: int = 0
    input_tokens: int | None = None
    output_tokens: int | None = None
    other_tokens: int | None = None
    unknown_usage_attempts: int = 0
    unmetered_replies: int = 0
    active_s: float = 0.0
    consecutive_invalid: int = 0
    last_step: StepRecord | None = None
    cancel: CancelRequested | None = None
    finished: RunFinished | None = None
    pending: PendingStep = attrs.Factory(lambda: PendingStep(step=1))
    revisions: RevisionTable = attrs.Factory(dict)
    summary: Summary | None = None
    calibration: tuple[int, int] | None = None

    @property
    def tokens(self) -> int:
        """Tokens the token budget counts so far: each attempt's `Usage.known_total`.

        Unknown usage is not counted as anything (docs/concepts.md, "Budgets").
        """
        return (self.input_tokens or 0) + (self.output_tokens or 0) + (self.other_tokens or 0)

    def observed_revisions(self) -> dict[str, tuple[int, ...]]:
        """A copy of `revisions`, for the executor to check the next step's writes against."""
        return dict(self.revisions)

    def totals(self, *, extra_active_s: float = 0.0) -> Totals:
        """The run totals for a run-finished record."""
        return Totals(
            steps=self.steps,
            model_attempts=self.model_attempts,
            input_tokens=self.input_tokens,
            output_tokens=self.output_tokens,
            unknown_usage_attempts=self.unknown_usage_attempts,
            active_s=round(self.active_s + extra_active_s, 6),
            other_tokens=self.other_tokens,
        )

    def apply(self, record: Record) -> None:
        """Fold one record (in seq order) into the view."""
        self.next_seq += 1
        if isinstance(record, ModelIntent):
            self.model_attempts += 1
            self.pending.attempts += 1
            self.pending.open_model_intent = record
        elif isinstance(record, ModelResult):
            self._apply_model_result(record)
        elif isinstance(record, ActionIntent):
            self.pending.action_intents.append(record)
        elif isinstance(record, ActionResult):
            outcome = record.outcome
            if outcome.revisions and outcome.status is ActionStatus.EXECUTED and not record.late:
                fold_revisions(self.revisions, outcome.revisions)
            if outcome.usage is not None:  # a child run's tokens count in this run's budget
                self.count_usage(outcome.usage)
            self.unknown_usage_attempts += outcome.unknown_usage_attempts
        elif isinstance(record, StepRecord):
            self._apply_step(record)
        elif isinstance(record, CancelRequested):
            self.cancel = self.cancel or record
        elif isinstance(record, ApprovalRequested):
            self.pending.approval_requests[record.call_id] = record
        elif isinstance(record, ApprovalDecided):
            self.pending.approvals[record.call_id] = record
        elif isinstance(record, ChildrenAwaited):
            self.pending.children_awaited = record
        elif isinstance(record, RunFinished):
            self.finished = record

    def count_usage(self, usage: Usage) -> None:
        """Add one attempt's reported usage; unknown counts stay unknown.

        Of a total larger than its input and output tokens (or reported alone), the rest
        is added to ``other_tokens``, so that `tokens` is the sum of `Usage.known_total`.
        """
        counted = usage.known_total
        if counted is None:
            self.unknown_usage_attempts += 1
            return
        if usage.input_tokens is not None:
            self.input_tokens = (self.input_tokens or 0) + usage.input_tokens
        if usage.output_tokens is not None:
            self.output_tokens = (self.output_tokens or 0) + usage.output_tokens
        other = counted - (usage.input_tokens or 0) - (usage.output_tokens or 0)
        if other > 0:
            self.other_tokens = (self.other_tokens or 0) + other

    def _apply_model_result(self, record: ModelResult) -> None:
        pending = self.pending
        summary = record.summary_through is not None
        opened = pending.open_model_intent
        if opened is not None and opened.intent_id == record.intent_id:
            pending.open_model_intent = None
            summary = summary or opened.compaction  # an abandoned summary says so only there
        self.count_usage(record.usage)
        if record.unmetered:
            self.unmetered_replies += 1
        pending.recorded_s += record.latency_s or 0.0
        # Calibrated from the step's own requests: a summariser's request (a few long
        # texts) counts differently from a history of many short messages.
        if record.context is not None and record.usage.input_tokens and not summary:
            self.calibration = (record.context.counted_tokens, record.usage.input_tokens)
        if record.summary_through is not None and holds_summary(record.reply):
            self.summary = Summary(
                intent_id=record.intent_id,
                through=record.summary_through,
                text=record.reply.text or "",
            )
            pending.call_summary, pending.call_failures = None, 0
        elif record.reply is not None and not summary:
            pending.reply = record.reply
            pending.reply_intent_id = record.intent_id
        else:
            pending.add_failure(record, summary=summary)

    def _apply_step(self, record: StepRecord) -> None:
        self.steps = record.step
        self.active_s += record.active_s
        self.last_step = record
        if record.decision is DecisionKind.INVALID:
            self.consecutive_invalid += 1
        elif record.decision is not None:
            self.consecutive_invalid = 0
        self.pending = PendingStep(step=record.step + 1)


def holds_summary(reply: ModelReply | None) -> TypeGuard[ModelReply]:
    """Whether a summariser's ``reply`` holds a summary: text that is not blank.

    One without (docs/context.md, "Summaries") is a failed attempt (``empty_summary``,
    `treadle.actors._gateway`), also when an older log recorded it as a reply.
    """
    return reply is not None and reply.text is not None and bool(reply.text.strip())


def fold(records: tuple[Record, ...]) -> RunView:
    """Fold a whole log into a `RunView`."""
    view = RunView()
    for record in records:
        view.apply(record)
    return view


def seconds_between(start: str, end: str) -> float:
    """Seconds from ISO-8601 instant ``start`` to ``end`` (negative when ``end`` is earlier)."""
    return (dt.datetime.fromisoformat(end) - dt.datetime.fromisoformat(start)).total_seconds()


def carried_active_s(pending: PendingStep, now: str) -> float:
    """Active seconds the log shows the pending step has taken by ``now`` (ISO-8601).

    What its recorded model attempts took (the rest of a crashed process's time on it is
    unknown); for a step parked on child runs, its active time when it parked plus the time
    since: a parked parent's time goes on (docs/child-runs.md, "Parking while the child
    works").
    """
    awaited = pending.children_awaited
    if awaited is None:
        return pending.recorded_s
    parked_s = max(0.0, seconds_between(awaited.ts, now))
    return max(pending.recorded_s, awaited.active_s + parked_s)


def closing_records(
    run_id: str,
    pending: PendingStep,
    synthetic: SyntheticObservations,
    ts: str,
    detail: str,
    *,
    active_s: float = 0.0,
    ended: Mapping[str, ActionOutcome] | None = None,
    history: Message | None = None,
) -> list[Record]:
    """What leaves no intent of a pending step without an outcome when the run ends there.

    For a run that finishes (cancelled, a budget) before it ran the step its log shows in
    progress again (docs/crash-safety.md, "Resume"): the open model intent is recorded as
    abandoned, and every action intent gets its ``unknown`` result (the definition's
    synthetic text) with the step's record; a call whose child run has finished (parked on
    it or not) gets the child's outcome instead (``ended``), marked ``late`` as a cut call's kept
    outcome is, so the child's tokens count in the run's totals (docs/child-runs.md,
    "Budgets"). Empty when the pending step holds no open intent (an action result is only
    ever written with its step record, so every action intent of the pending step is open).

    Args:
        run_id: the run.
        pending: the step in progress (`RunView.pending`).
        synthetic: the definition's synthetic observations.
        ts: the records' instant (ISO-8601).
        detail: why the outcomes are unknown (diagnostics).
        active_s: the step record's active seconds (`carried_active_s`).
        ended: outcomes of calls whose child runs have finished, by intent id
            (`treadle.supervisors._child_links.ended_children`); ``None``: none.
        history: the step's assistant message as the agent's decision parser gives it for
            the reply (the calls, with the ids its action intents were written under:
            docs/seams.md, "Decision parser"); ``None`` (a run finished without its agent
            definition): the reply's text and native calls as the model sent them.
    """
    records: list[Record] = []
    if pending.open_model_intent is not None:
        intent_id = pending.open_model_intent.intent_id
        step = pending.step
        records.append(
            ModelResult(run_id=run_id, step=step, intent_id=intent_id, ts=ts, abandoned=True)
        )
    if not pending.action_intents:
        return records
    ended = ended or {}
    results = [
        ActionResult.unknown(
            intent,
            observation=synthetic.unknown.format(tool=intent.tool, detail=""),
            detail=detail,
            ts=ts,
            synthetic=True,
        )
        if intent.intent_id not in ended
        else ActionResult(
            run_id=run_id,
            step=intent.step,
            intent_id=intent.intent_id,
            call_id=intent.call_id,
            tool=intent.tool,
            outcome=ended[intent.intent_id],
            ts=ts,
            late=True,
        )
        for intent in pending.action_intents
    ]
    reply = pending.reply
    records += results
    records.append(
        StepRecord(
            run_id=run_id,
            step=pending.step,
            ts=ts,
            model_intent_id=pending.reply_intent_id,
            decision=DecisionKind.ACTIONS,
            history_message=history
            or Message(
                role="assistant",
                content=reply.text if reply else None,
                tool_calls=reply.tool_calls if reply else (),
            ),
            model_output_text=reply.text if reply else None,
            visible_output_chars=len(reply.text or "") if reply else 0,
            observations=tuple(r.outcome.observation for r in results),
            action_result_ids=tuple(r.intent_id for r in results),
            active_s=round(active_s, 6),
        )
    )
    return records
