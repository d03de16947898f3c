"""The run coordinator: the state machine, the step loop, stop rules and budgets.

See docs/concepts.md, "Stop reasons".

It never reasons about text. Each iteration checks the stop rules A-H in order, then runs one
step: a model request from the hydrator, the model call through the gateway, the parse, the
actions through the tool executor, and the step record through the event writer. Its counters
are folded from the records the other actors report having written, so a resumed run and a
live run agree.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import functools
import secrets
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, TypeVar

import attrs
import trio

from treadle._budget import window_from_error
from treadle._clock import Clock
from treadle._exceptions import SeamViolation
from treadle._output import OutputSpec
from treadle._state import (
    PendingStep,
    RunView,
    carried_active_s,
    closing_records,
    seconds_between,
)
from treadle._text import repaired
from treadle.actors._mailbox import MailboxReceiver, MailboxSender
from treadle.actors._messages import (
    ActionsOutcome,
    CallModel,
    Cancel,
    Compaction,
    Control,
    Hydrate,
    KeepDecision,
    ModelOutcome,
    Offer,
    RunActions,
    take_offer,
)
from treadle.actors._retries import ends_the_call
from treadle.actors._rpc import CANCEL_GRACE_S, ReplySlot, StepScope, request
from treadle.actors._writer import WriterClient
from treadle.approvals import (
    DECISIONS,
    EXPIRED_DETAIL,
    Decision,
    counts,
    expired_decision,
    request_digest,
)
from treadle.parsers import refuse_non_finite
from treadle.ports import DecisionParser
from treadle.redaction import NO_REDACTION, Redaction
from treadle.types import (
    ActionIntent,
    ActionOutcome,
    ActionResult,
    ActionStatus,
    ApprovalDecided,
    ApprovalRequested,
    Budgets,
    CancelRequested,
    ChildrenAwaited,
    DecisionKind,
    ImageRef,
    JSONValue,
    Limits,
    Message,
    ModelErrorInfo,
    ModelRequest,
    ModelResult,
    ParsedReply,
    RunFinished,
    RunResult,
    RunState,
    StepRecord,
    StopReason,
    StoreOp,
    SyntheticObservations,
    ToolCall,
    ToolSpec,
    final_state,
)


def _no_status(state: RunState, awaiting: ApprovalRequested | None) -> None:
    """The default status report: nobody is told."""


class Parked(Exception):
    """Raised by `RunCoordinator.run` when the run waited ``park_after_s`` for a decision.

    The run supervisor then stops the run's actors, waits for the decision (or a cancel, or
    the approval deadline) with nothing but the handle in memory, and resumes the run from
    its log (docs/decisions/0010).

    Attributes:
        request: the approval request the run waits on (durable).
        deadline: the trio time at which the wait expires.
        active_s: active seconds of the step so far (carried into the resumed step).
    """

    def __init__(self, request: ApprovalRequested, deadline: float, active_s: float) -> None:
        super().__init__(f"run {request.run_id!r} parked on call {request.call_id!r}")
        self.request = request
        self.deadline = deadline
        self.active_s = active_s


class AwaitingChildren(Exception):
    """Raised by `RunCoordinator.run` once its step parked on child runs queued in a fleet.

    The `ChildrenAwaited` record is durable; the run supervisor stops the run's actors and
    releases its lease, leaving the run claimable when a child wakes it or at the record's
    ``recheck_ts`` (docs/child-runs.md, "In a fleet").

    Attributes:
        record: the durable record of the wait.
    """

    def __init__(self, record: ChildrenAwaited) -> None:
        super().__init__(f"run {record.run_id!r} parked on child runs {', '.join(record.children)}")
        self.record = record


class Drained(Exception):
    """Raised by `RunCoordinator.run` at a safe point after `RunCoordinator.drain`.

    The run is left unfinished between two steps (or parked while it waits on a human), so
    that the process driving it can stop and another take it over from its log (a worker
    shutting down, docs/fleet.md "Shutting a worker down").
    """


STOP_GRACE_S = 5.0
"""Seconds an actor may take to answer after its step ran out of active time."""


@attrs.define(eq=False)
class RunCoordinator:
    """The run coordinator actor of one run.

    Args:
        view: the run's state, folded from its log (fresh or resumed).
        output: the agent's output type; a final answer must fit it
            (docs/structured-output.md). ``None`` takes any final answer.
        on_status: ``on_status(state, awaiting)``: told every change of the run state and
            of the approval request the run waits on (the run's handle owns what it
            reports, docs/events.md "Reading events").
        state: the run state now.
        park_at_deadline: the run's store has control streams: when the deadline passes
            while it waits with no decision (or a wait begins past it with none offered),
            raise `Parked` instead of expiring the call itself, so that the supervisor
            writes the expiry to the control stream, reads the stream once more and hands
            the first decision there that counts (a human's written before the expiry, or
            the expiry) to the resumed run (docs/events.md, "Human approval"). A drive that
            begins past the deadline wrote the expiry before its first reading, so its
            wait finds it offered.
        compaction: the agent declares a context window: a step whose attempt the provider
            refused for its context length compacts once and retries (docs/context.md,
            "Context-length errors").
        synthetic: the definition's synthetic observations: a run that ends before it ran
            its resumed step again gives that step's open intents their ``unknown`` results
            (`treadle._state.closing_records`).
        ended_children: for a run resumed onto a step with open calls, the outcomes of
            those whose child runs had finished (each looked up by its derived child run
            id, whether the step parked on it or not), by intent id: a run that ends before
            it runs the step again records these instead of ``unknown`` (docs/child-runs.md,
            "Budgets").
        redaction: the run's secret tool arguments, shared with the writer and the handle:
            it learns each reply before the step acts on it (`Redaction.learn`), so the
            step's intents and requests hide the reply's secret values wherever they stand,
            and an approval request of a call shown with something hidden is bound to a
            digest no one can compute back from what is shown
            (`treadle.approvals.request_digest`).
        digest_keys: where the keys of such digests come from (``n`` bytes a call).
        read_control: reads the run's control stream once, now: the entries not handed over
            yet, as `Control` messages in order (``None``: the store has no control
            streams). A decision handed over by the run's handle is taken only after this
            reading, so a cancel written there before it wins (`take_offer`).
        keep_decision: makes a decision handed over by the run's handle durable in the
            control stream before the run takes it, and says which decision counts there
            (`KeepDecision`; ``None``: the store has no control streams). The run takes
            that one, so the first decision made durable counts (`take_offer`).
    """

    run_id: str
    view: RunView
    parser: DecisionParser
    tools: tuple[ToolSpec, ...]
    budgets: Budgets
    limits: Limits
    clock: Clock
    writer: WriterClient
    hydrator: MailboxSender[Hydrate]
    gateway: MailboxSender[CallModel]
    executor: MailboxSender[RunActions]
    needs_approval: Callable[[str, Mapping[str, Any]], bool] = lambda tool, arguments: False
    output: OutputSpec | None = None
    park_after_s: float | None = None
    park_at_deadline: bool = False
    carried_active_s: float = 0.0
    ended_children: Mapping[str, ActionOutcome] = attrs.Factory(dict)
    compaction: bool = False
    synthetic: SyntheticObservations = SyntheticObservations()
    redaction: Redaction = NO_REDACTION
    digest_keys: Callable[[int], bytes] = secrets.token_bytes
    on_status: Callable[[RunState, ApprovalRequested | None], None] = _no_status
    read_control: Callable[[], Awaitable[Sequence[Control]]] | None = None
    keep_decision: KeepDecision | None = None
    state: RunState = RunState.RUNNING
    _step_scope: StepScope | None = attrs.field(init=False, default=None)
    _cancel: tuple[str, str] | None = attrs.field(init=False, default=None)
    _finishing: bool = attrs.field(init=False, default=False)
    _reply_wait: trio.CancelScope | None = attrs.field(init=False, default=None)
    # the reply the hydrator or gateway owes; None: given up
    _asked: ReplySlot[Any] | None = attrs.field(init=False, default=None)
    # serve_control's wait, ended to give up on it
    _give_up: trio.CancelScope | None = attrs.field(init=False, default=None)
    _give_up_at: float = attrs.field(init=False, default=float("inf"))
    _approval_wait: trio.CancelScope | None = attrs.field(init=False, default=None)
    _awaiting: ApprovalRequested | None = attrs.field(init=False, default=None)
    _offered: list[Offer] = attrs.field(init=False, factory=list)
    _offer_arrived: trio.Event = attrs.field(init=False, factory=trio.Event)
    _waited_s: float = attrs.field(init=False, default=0.0)
    _step_started: float = attrs.field(init=False, default=0.0)
    _late: tuple[ActionResult, ...] = attrs.field(init=False, default=())
    _late_step: StepRecord | None = attrs.field(init=False, default=None)
    _unsent_steps: list[StepRecord] = attrs.field(init=False, factory=list)
    _final_answer: str | None = attrs.field(init=False, default=None)
    _answer_output: JSONValue = attrs.field(init=False, default=None)
    _error: str | None = attrs.field(init=False, default=None)
    _model_error: ModelErrorInfo | None = attrs.field(init=False, default=None)
    _draining: bool = attrs.field(init=False, default=False)

    @trio.lowlevel.enable_ki_protection  # Ctrl-C reaches the main task: decision 0097
    async def serve_control(
        self,
        inbox: MailboxReceiver[Control],
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Apply the `Control` messages of ``inbox`` (cancel, decision, drain) until it ends.

        Each is applied at once, also while a step is in flight (`apply`).
        """
        with inbox:
            # what was sent before it runs (the control stream's backlog) is applied before
            # its first step: a wait that begins past its deadline finds the expiry offered
            with contextlib.suppress(trio.WouldBlock, trio.EndOfChannel):
                while True:
                    self.apply(inbox.receive_nowait())
            task_status.started()
            while True:
                with trio.CancelScope(deadline=self._give_up_at) as self._give_up:
                    try:
                        message = await inbox.receive()
                    except trio.EndOfChannel:
                        return
                    self.apply(message)
                if self._give_up.cancelled_caught:
                    self._give_up_at = float("inf")
                    self._stop_waiting()

    def _stop_waiting(self) -> None:
        """A cancel's grace period ran out: end the wait for the hydrator's or gateway's reply.

        Each enforces the cancellation itself and answers within it; one that does not (a
        fake that stops answering) would hold the run for good. Its reply slot is closed, and
        the request raises `trio.TooSlowError` naming it (`_ask`).
        """
        asked, self._asked = self._asked, None  # `_ask` tells the give-up by this None
        if asked is not None:
            asked.close()

    async def _ask(
        self,
        actor: str,
        scope: StepScope | None,
        inbox: MailboxSender[Q],
        make: Callable[[ReplySlot[R]], Q],
    ) -> R:
        """Request/reply whose wait ends at the step's deadline or a cancel, plus grace.

        The actor enforces the deadline and the cancellation itself; the grace periods
        (`STOP_GRACE_S` after the deadline, `CANCEL_GRACE_S` more after a cancel) only make
        sure that an actor ignoring them cannot hang the run.

        Raises:
            trio.TooSlowError: the actor did not answer within its grace period; the run is
                interrupted and left resumable.
        """

        def asking(reply_to: ReplySlot[R]) -> Q:
            self._asked = reply_to
            return make(reply_to)

        try:
            if scope is None or scope.deadline == float("inf"):
                return await request(inbox, asking)  # each actor bounds its own calls
            with trio.fail_at(scope.deadline + STOP_GRACE_S):
                return await request(inbox, asking)
        except trio.TooSlowError:
            late = f"{STOP_GRACE_S:g} s after the step's deadline"
        except trio.EndOfChannel:
            if self._asked is not None:  # not given up: the actor failed (its error reaches
                # the run's supervisor) or closed the reply unanswered
                closed = f"the {actor} actor closed a request without answering"
                raise trio.EndOfChannel(closed) from None
            late = f"{CANCEL_GRACE_S + STOP_GRACE_S:g} s after the run was cancelled"
        finally:
            self._asked = None
        raise trio.TooSlowError(f"the {actor} actor did not answer {late}")

    def apply(self, message: Control) -> None:
        """Apply one control message now (never blocks).

        * `Cancel`: the step in flight is cancelled at once (docs/concepts.md, "Stop
          reasons", rule A); a no-op once the run is finishing or finished.
        * `Offer`: an approval decision (approve, reject, edit, or the expiry the driver
          wrote to the control stream); the first one that counts for the request the run
          waits on is applied (`treadle.approvals.counts`): one that matches no request
          of this run (another step, call or arguments), of no known kind, or a human's
          stamped after the deadline never is; one for a step the run has left is not kept.
        * `Drain`: stop at the next safe point (before the next step, or at once while
          waiting on a human): `run` raises `Drained` (or `Parked`) and the log is left to
          resume from.
        """
        if isinstance(message, Cancel):
            self._on_cancel(message.reason, message.canceller)
        elif isinstance(message, Offer):
            self._on_offer(message)
        else:
            self._on_drain()

    def _on_cancel(self, reason: str, canceller: str) -> None:
        if self.state.is_terminal or self._finishing or self._cancel is not None:
            return
        self._cancel = (reason, canceller)
        self._set_state(RunState.CANCELLING)
        if self._step_scope is not None:
            self._step_scope.cancel(reason or "run cancelled")
        if self._approval_wait is not None:
            self._approval_wait.cancel()
        give_up_at = trio.current_time() + CANCEL_GRACE_S + STOP_GRACE_S
        if self._reply_wait is not None:
            self._reply_wait.deadline = min(self._reply_wait.deadline, give_up_at)
        self._give_up_at = give_up_at
        if self._give_up is not None:
            self._give_up.deadline = give_up_at

    def _on_drain(self) -> None:
        self._draining = True
        if self._approval_wait is not None:
            self._approval_wait.cancel()

    def _set_state(self, state: RunState) -> None:
        self.state = state
        self.on_status(state, self._awaiting)

    def _on_offer(self, offer: Offer) -> None:
        decided = offer.decided
        if decided.decision not in DECISIONS:
            return  # an unknown decision is never applied
        if decided.step < self.view.pending.step:
            return  # for a step already done: it can never match, so it is not kept
        decided = repaired(attrs.evolve(decided, run_id=self.run_id))
        self._offered.append(attrs.evolve(offer, decided=decided))
        self._offer_arrived.set()

    @trio.lowlevel.enable_ki_protection  # Ctrl-C reaches the main task: decision 0097
    async def run(self, *, resumed_steps: tuple[StepRecord, ...] = ()) -> RunResult:
        """Run steps until a stop rule holds; write run-finished (a barrier) and return.

        Raises:
            Whatever a seam raised that is not part of its contract (a parser or executor bug,
            a store failure): the run is left unfinished and resumable.
        """
        self._unsent_steps.extend(resumed_steps)
        if (
            self.view.last_step is not None
            and self.view.last_step.decision is DecisionKind.FINAL_ANSWER
        ):
            self._final_answer = self.view.last_step.model_output_text
            self._answer_output = self.view.last_step.output
        while True:
            reason = self.stop_reason()
            if reason is not None:
                return await self._finish(reason)
            if self._draining:
                raise Drained(f"run {self.run_id!r} stopped between steps to be driven elsewhere")
            reason = await self._step()
            if reason is not None:
                # from the step's start as `_step` counts it: the time it carried (parked on
                # children, or recorded before a crash) is the cut step's too
                return await self._finish(reason, cut_active_s=self._elapsed(self._step_started))

    def close_inboxes(self) -> None:
        """Close the hydrator, gateway and executor inboxes: their actors then return."""
        for channel in (self.hydrator, self.gateway, self.executor):
            channel.close()

    def stop_reason(self) -> StopReason | None:
        """The first stop rule A-H that holds, or ``None`` to continue.

        See docs/concepts.md, "Stop reasons".
        """
        view = self.view
        last = view.last_step
        if self._cancel is not None or view.cancel is not None:
            return StopReason.CANCELLED
        if last is not None and last.env_error:
            return StopReason.ENV_ERROR
        if last is not None and last.task_completed:
            return StopReason.TASK_COMPLETED
        if last is not None and last.decision is DecisionKind.FINAL_ANSWER:
            return StopReason.FINAL_ANSWER
        if view.consecutive_invalid >= self.limits.invalid_decisions:
            return StopReason.INVALID_DECISIONS
        if last is not None and last.decision is None:
            return StopReason.MODEL_ERROR
        return self._budget_reason()

    def _tokens_left(self) -> int | None:
        """The token budget minus what the run spent (``None``: no token budget)."""
        budget = self.budgets.token_budget
        return None if budget is None else max(0, budget - self.view.tokens)

    def _budget_reason(self) -> StopReason | None:
        budgets, view = self.budgets, self.view
        if budgets.max_steps is not None and view.steps >= budgets.max_steps:
            return StopReason.MAX_STEPS
        # A model call the log shows ended (`_call_ended`) already counts in both: it was
        # made within them, and its reply or failure is acted on when its usage reached the
        # token budget exactly, not when it crossed it (docs/models.md, "Budgets during a
        # call"). Resumed, the same: its step is finished, and the next one stops.
        settled = 1 if self._call_ended(view.pending) else 0
        attempts = budgets.max_model_attempts
        if attempts is not None and view.model_attempts >= attempts + settled:
            return StopReason.MAX_MODEL_ATTEMPTS
        if budgets.token_budget is not None and (
            view.tokens >= budgets.token_budget + settled or view.unmetered_replies
        ):  # a reply of unknown usage is not acted on: docs/decisions/0114
            return StopReason.TOKEN_BUDGET
        if budgets.time_budget_s is None:
            return None
        # A step resumed with its time already spent (parked on child runs while its time
        # went on) ends the run here, before its calls run again only to be cut at once.
        # (Read only under a time budget: `_recorded_s` reads the clock.)
        spent_s = view.active_s + (self.carried_active_s or self._recorded_s())
        return StopReason.TIME_BUDGET if spent_s >= budgets.time_budget_s else None

    async def _step(self) -> StopReason | None:
        """Run one step; return a stop reason when the step itself was cut off."""
        # A step resumed after parking continues its active time; one resumed after a crash
        # counts what its recorded model attempts took (the rest of the crashed process's
        # time on it is unknown); one that parked on child runs counts its time parked.
        started = trio.current_time() - (self.carried_active_s or self._recorded_s())
        self.carried_active_s = 0.0
        self._step_started = started
        deadline = float("inf")
        if self.budgets.time_budget_s is not None:
            deadline = started + self.budgets.time_budget_s - self.view.active_s
        scope = StepScope(deadline)
        self._waited_s = 0.0
        if self._cancel is not None:
            scope.cancel(self._cancel[0] or "run cancelled")
        self._step_scope = scope
        try:
            return await self._run_step(scope, started)
        finally:
            self._step_scope = None

    def _recorded_s(self) -> float:
        """Active seconds the log shows the pending step has taken (see `_step`)."""
        return carried_active_s(self.view.pending, self.clock.now_iso())

    async def _run_step(self, scope: StepScope, started: float) -> StopReason | None:
        pending = self.view.pending
        step = pending.step
        reply, intent_id = pending.reply, pending.reply_intent_id
        if pending.open_model_intent is not None:
            await self._abandon(pending.open_model_intent.intent_id, step)
        if reply is None:
            failed = self._failed_for_good(pending)
            if failed is not None:  # resume: reuse the recorded failure, never re-run it
                outcome = ModelOutcome(error=failed)
            else:
                forced = self._compact_retry(pending)
                outcome = await self._call_model(step, scope, force=forced)
                refused = outcome.stop is None and outcome.reply is None and not forced
                if refused and self._compact_retry(pending):  # the first refusal, just now
                    outcome = await self._call_model(step, scope, force=True)
            if outcome.stop is not None:
                return outcome.stop
            if outcome.reply is None:
                self._error = outcome.error.kind if outcome.error else "model_error"
                self._model_error = outcome.error
                await self._write_step(
                    StepRecord(
                        run_id=self.run_id,
                        step=step,
                        ts=self.clock.now_iso(),
                        model_intent_id=None,
                        decision=None,
                        active_s=self._elapsed(started),
                    ),
                    None,
                )
                return None
            reply, intent_id = outcome.reply, outcome.intent_id
        parsed = self.parser.parse(reply, self.tools)
        if not isinstance(parsed, ParsedReply) or not isinstance(parsed.kind, DecisionKind):
            # A bug in the parser: the run is interrupted, never ended with a made-up reason.
            raise SeamViolation("decision parser", parsed, "a ParsedReply")
        parsed = refuse_non_finite(parsed)  # whichever parser: arguments are strict JSON
        output: JSONValue = None
        if self.output is not None:  # the final answer must fit the output type
            parsed, output = self.output.decide(parsed, reply)
        return await self._act(step, intent_id, parsed, scope, started, output)

    def _call_ended(self, pending: PendingStep) -> bool:
        """Whether the log holds how the pending step's model call ended.

        Its reply, or its failure for good (`_failed_for_good`): a resumed run acts on it
        as the live run did (docs/crash-safety.md, "Resume"), never calling the model again.
        """
        return pending.reply is not None or self._failed_for_good(pending) is not None

    def _failed_for_good(self, pending: PendingStep) -> ModelErrorInfo | None:
        """The step's last model attempt, when it failed for good before its step record.

        A crash between a final model error and the step record leaves exactly that in the
        log; resuming reuses the recorded result (docs/crash-safety.md, "Resume") instead of a
        new attempt. Whether the error is final is `ends_the_call`'s answer for the call it
        ended (a summary's or the step's own, counted by `PendingStep.failures_of`), the
        gateway's rule live (a wait the server asked for longer than ``retry_after_max_s``
        included). A cut (cancel, time or token budget), an abandoned attempt, or the step's
        first refusal for length with compaction on (`_compact_retry`) is not a failure for
        good.
        """
        if pending.open_model_intent is not None or not pending.failures:
            return None
        last = pending.failures[-1]
        error = last.error
        if error is None or error.kind in _CUT_KINDS:
            return None
        if pending.refusals and pending.refusals[-1] is last:
            return None if self._compact_retry(pending) else error
        summary = pending.call_summary is True
        if not ends_the_call(error, pending.failures_of(summary=summary), self.limits):
            return None
        return error

    def _compact_retry(self, pending: PendingStep) -> bool:
        """Whether the step compacts and retries (docs/context.md, "Context-length errors").

        True when the agent compacts and the provider has refused a request of this step (its
        own or a summary's) for its context length exactly once, whatever failed after that
        refusal (an attempt of the forced compaction's summaries, abandoned by a crash or
        retried): live and on resume, the step's next call is built by that compaction, with
        ``force``.
        """
        return self.compaction and len(pending.refusals) == 1

    async def _act(
        self,
        step: int,
        intent_id: str | None,
        parsed: ParsedReply,
        scope: StepScope,
        started: float,
        output: JSONValue = None,
    ) -> StopReason | None:
        fields: dict[str, Any] = {
            "run_id": self.run_id,
            "step": step,
            "model_intent_id": intent_id,
            "decision": parsed.kind,
            "history_message": parsed.history_message,
            "feedback": parsed.feedback,
            "model_output_text": parsed.history_message.content,
            "visible_output_chars": len(parsed.history_message.content or ""),
            "output": output,
            "repairs": tuple(parsed.repairs),
        }
        results: tuple[ActionResult, ...] | None = None
        reported_s = 0.0
        if parsed.kind is DecisionKind.ACTIONS:
            approved = await self._approvals(step, parsed.actions)
            if approved is None:
                return StopReason.CANCELLED
            calls, rejected = approved
            outcome = await self._run_actions(step, calls, rejected, scope)
            if outcome.awaiting and outcome.stop is None:
                await self._park_on_children(step, outcome, started)
                return StopReason.CANCELLED  # cancelled while the wait became durable
            if outcome.stop is not None:
                if outcome.results:  # cancelled or cut by the time budget: kept, late
                    self._late = outcome.results
                    self._late_step = StepRecord(
                        ts="",
                        action_result_ids=tuple(r.intent_id for r in outcome.results),
                        observations=self._late_observations(parsed, outcome.results),
                        **fields,
                    )
                return outcome.stop
            results = outcome.results
            reported_s = outcome.reported_active_s
            fields.update(
                observations=outcome.observations,
                observation_images=_observation_images(results),
                observation_truncated_chars=sum(
                    r.outcome.observation_truncated_chars for r in results
                ),
                task_completed=any(r.outcome.task_completed for r in results),
                env_error=any(r.outcome.status is ActionStatus.ENV_ERROR for r in results),
                action_result_ids=tuple(r.intent_id for r in results),
            )
        elif parsed.kind is DecisionKind.FINAL_ANSWER:
            self._final_answer = parsed.text
            self._answer_output = output
        # one record, built once its fields are known (a step record is wide)
        active_s = self._step_active_s(started, reported_s)
        record = StepRecord(ts=self.clock.now_iso(), active_s=active_s, **fields)
        await self._write_step(record, results)
        return None

    def _step_active_s(self, started: float, reported_s: float) -> float:
        """The finished step's active seconds, the time its calls reported counted.

        The seconds since ``started``, and at least its model attempts' recorded time plus
        ``reported_s``: the most active seconds a call of the step reported spending on the
        run's behalf as another log records them (a child run's). A step resumed after its
        process died during the call counts from ``started`` only what its model attempts
        took, and the call answers at once from a finished child: the child's time, which
        its log keeps, is counted all the same, as its tokens are (docs/child-runs.md,
        "Budgets"). A live step has taken at least that long already.
        """
        elapsed = self._elapsed(started)
        if not reported_s:
            return elapsed
        return max(elapsed, round(self.view.pending.recorded_s + reported_s, 6))

    async def _park_on_children(self, step: int, outcome: ActionsOutcome, started: float) -> None:
        """Record that the step's calls wait on child runs (a barrier), then park.

        Returns only when the run was cancelled meanwhile: it then finishes ``cancelled``
        (the calls get their ``unknown`` results, `_finish`), rather than parking with a
        cancel that its control stream shows as handled.

        Raises:
            AwaitingChildren: once the record is durable, unless cancelled meanwhile.
        """
        now = self.clock.now_iso()
        recheck_s = min(awaited.recheck_s for awaited in outcome.awaiting)
        active_s = self._elapsed(started)
        budget_s = self.budgets.time_budget_s
        if budget_s is not None:  # its time budget runs on while parked: claimable when spent
            recheck_s = min(recheck_s, max(0.0, budget_s - self.view.active_s - active_s))
        record = ChildrenAwaited(
            run_id=self.run_id,
            step=step,
            ts=now,
            intent_ids=tuple(awaited.intent_id for awaited in outcome.awaiting),
            children=tuple(awaited.child_run_id for awaited in outcome.awaiting),
            active_s=active_s,
            recheck_ts=_plus_s(now, recheck_s),
        )
        if self._cancel is None:
            await self.writer.barrier(StoreOp.CONTROL, record)
            self.view.apply(record)
        if self._cancel is None:
            raise AwaitingChildren(record)

    async def _approvals(
        self, step: int, calls: tuple[ToolCall, ...]
    ) -> tuple[tuple[ToolCall, ...], dict[str, str]] | None:
        """Wait for the decisions the calls need; ``None`` when cancelled meanwhile.

        Returns:
            The calls to run (edited arguments applied) and the rejected ones by call id,
            with the detail of their synthetic observation.
        """
        pending = self.view.pending
        started = {intent.call_id for intent in pending.action_intents}
        runnable: list[ToolCall] = []
        rejected: dict[str, str] = {}
        for call in calls:
            # A call the log shows was put to a human stays so, whatever the policy of the
            # process resuming the run says.
            asked = call.id in pending.approval_requests or call.id in pending.approvals
            if not asked and (
                call.id in started or not self.needs_approval(call.name, call.arguments)
            ):
                runnable.append(call)
                continue
            decided = await self._decision(step, call)
            if decided is None:
                return None
            if decided.decision == Decision.EDIT and decided.edited_arguments is not None:
                call = attrs.evolve(call, arguments=decided.edited_arguments)
            elif decided.decision == Decision.EXPIRED:
                rejected[call.id] = decided.message or EXPIRED_DETAIL
            elif decided.decision != Decision.APPROVE:  # reject, or anything unknown
                rejected[call.id] = decided.message or "rejected"
            runnable.append(call)
        return tuple(runnable), rejected

    async def _decision(self, step: int, call: ToolCall) -> ApprovalDecided | None:
        """The recorded decision on ``call``: found in the log, or awaited and written."""
        pending = self.view.pending
        decided = pending.approvals.get(call.id)
        if decided is not None:
            return decided
        request = pending.approval_requests.get(call.id)
        if request is None:
            now = self.clock.now_iso()
            request = ApprovalRequested(
                run_id=self.run_id,
                step=step,
                call_id=call.id,
                tool=call.name,
                arguments_digest=request_digest(
                    call.name, call.arguments, self.redaction, self.digest_keys, step=step
                ),
                ts=now,
                deadline_ts=_plus_s(now, self.limits.approval_timeout_s),
                arguments=dict(call.arguments),
            )
            # The handle reports the wait before the request's event reaches anyone: whoever
            # receives it may decide at once (docs/events.md, "Reading events").
            self._awaiting_state(request)
            try:
                await self.writer.barrier(StoreOp.CONTROL, request)
            except BaseException:
                self._awaiting_state(None)
                raise
            self.view.apply(request)
        found = await self._await_decision(request)
        if found is None:
            if self._cancel is not None:
                return None
            found = expired_decision(request, self.clock)
        await self.writer.barrier(StoreOp.CONTROL, found)
        self.view.apply(found)
        return found

    async def _await_decision(self, request: ApprovalRequested) -> ApprovalDecided | None:
        """Wait (not active time) until the deadline for a decision matching ``request``.

        The decision found is taken by `take_offer`: ``None`` when a cancel comes first.
        """
        remaining = seconds_between(self.clock.now_iso(), request.deadline_ts)
        began = trio.current_time()
        offer: Offer | None = None
        found: ApprovalDecided | None = None
        self._awaiting_state(request)
        try:
            with trio.CancelScope() as wait:
                self._approval_wait = wait
                if self._cancel is not None or self._draining:
                    wait.cancel()
                deadline = began + max(0.0, remaining)
                park_at = deadline
                if self.park_after_s is not None:
                    park_at = min(deadline, began + self.park_after_s)
                with trio.move_on_at(deadline):
                    while (offer := self._matching(request)) is None:
                        self._offer_arrived = trio.Event()
                        with trio.move_on_at(park_at):
                            await self._offer_arrived.wait()
                        if trio.current_time() >= park_at and park_at < deadline:
                            if self._matching_exists(request):
                                continue
                            active = round(began - self._step_started - self._waited_s, 6)
                            raise Parked(request, deadline, active)
            self._approval_wait = None
            if offer is None and self._cancel is None:
                offer = self._matching(request)  # a decision that came with the drain
            if offer is not None:  # a cancel known by now (read first for the handle's) wins
                found = await take_offer(
                    offer, self.read_control, self.apply, self._cancelled, keep=self._keep(request)
                )
            if found is None and self._cancel is None and (self._draining or self.park_at_deadline):
                # Drained; or at the deadline, parked so that the expiry is written to the
                # control stream and the stream read once more: the first decision there counts
                # (docs/events.md, "Human approval"). A drive that began past the deadline wrote
                # the expiry before its first reading, so it found it (or a decision before it).
                active = round(began - self._step_started - self._waited_s, 6)
                raise Parked(request, deadline, active)
        finally:
            self._approval_wait = None
            self._awaiting_state(None)
            waited = trio.current_time() - began
            self._waited_s += waited
            if self._step_scope is not None:
                self._step_scope.deadline += waited
        return found

    def _awaiting_state(self, request: ApprovalRequested | None) -> None:
        """Wait on ``request`` (state ``awaiting_approval``), or on nothing (``running``)."""
        self._awaiting = request
        if self._cancel is None:
            self._set_state(RunState.AWAITING_APPROVAL if request is not None else RunState.RUNNING)
        else:
            self.on_status(self.state, request)

    def _cancelled(self) -> bool:
        return self._cancel is not None

    def _keep(
        self, request: ApprovalRequested
    ) -> Callable[[ApprovalDecided], Awaitable[tuple[ApprovalDecided, Sequence[Control]]]] | None:
        """`keep_decision` for ``request`` (``None`` without one): see `take_offer`."""
        keep = self.keep_decision
        return None if keep is None else functools.partial(keep, request)

    def _matching_exists(self, request: ApprovalRequested) -> bool:
        return any(counts(offer.decided, request) for offer in self._offered)

    def _matching(self, request: ApprovalRequested) -> Offer | None:
        # Offers for earlier steps can never match again: let them go (a service keeps a
        # run for days, and a decision may be written for a step the run has left).
        offered = self._offered = [o for o in self._offered if o.decided.step >= request.step]
        for offer in offered:  # in the order they arrived: the control stream's
            if counts(offer.decided, request):
                offered.remove(offer)
                return offer
        return None

    async def _call_model(
        self, step: int, scope: StepScope, *, force: bool = False
    ) -> ModelOutcome:
        """The step's model call; first the summaries the hydrator asks for, each durable."""
        answer = await self._hydrate(force)
        # steps up to 0 are a thread's inherited history: a summary may cover part of it
        covered = self.view.summary.through if self.view.summary is not None else None
        while isinstance(answer, Compaction):
            if covered is not None and answer.through <= covered:  # ignores its summary
                raise SeamViolation("context hydrator", answer, "a summary of uncovered steps")
            covered = answer.through
            outcome = await self._gateway_call(
                step, scope, answer.request, summary_through=answer.through
            )
            if outcome.reply is None:  # the summariser failed or a budget ended the call
                return outcome
            answer = await self._hydrate(force)
        return await self._gateway_call(step, scope, answer)

    async def _hydrate(self, force: bool) -> ModelRequest | Compaction:
        refusals = self.view.pending.refusals
        last = refusals[-1] if force and refusals else None
        refused = last.context if last is not None else None
        stated = window_from_error(last.error.message) if last and last.error else None
        answer: ModelRequest | Compaction = await self._ask(
            "context hydrator",
            None,
            self.hydrator,
            lambda reply_to: Hydrate(
                new_steps=tuple(self._unsent_steps),
                reply_to=reply_to,
                summary=self.view.summary,
                calibration=self.view.calibration,
                force=force,
                refused_tokens=refused.estimated_input_tokens if refused is not None else None,
                refused_window=stated,
            ),
        )
        self._unsent_steps.clear()
        return answer

    async def _gateway_call(
        self,
        step: int,
        scope: StepScope,
        model_request: ModelRequest,
        *,
        summary_through: int | None = None,
    ) -> ModelOutcome:
        pending = self.view.pending
        outcome: ModelOutcome = await self._ask(
            "model gateway",
            scope,
            self.gateway,
            lambda reply_to: CallModel(
                step=step,
                request=model_request,
                run_attempts=self.view.model_attempts,
                step_attempts=pending.attempts,
                step_failures=pending.failures_of(summary=summary_through is not None),
                tokens=self.view.tokens,
                scope=scope,
                reply_to=reply_to,
                summary_through=summary_through,
                last_failure=pending.failures[-1] if pending.failures else None,
            ),
        )
        for record in outcome.written:
            # Before the step acts on the reply: its intents and approval requests, and the
            # handle's pending approval, hide the reply's secret values wherever they stand.
            self.redaction.learn(record)
            self.view.apply(record)
        return outcome

    async def _run_actions(
        self,
        step: int,
        calls: tuple[ToolCall, ...],
        rejected: dict[str, str],
        scope: StepScope,
    ) -> ActionsOutcome:
        existing = tuple(self.view.pending.action_intents)
        handed: list[ActionIntent] = []
        # The executor bounds its own wait (the tool host keeps a call it gives up on): this
        # deadline only keeps an executor actor that does not answer from hanging the run.
        with trio.CancelScope(deadline=scope.deadline + STOP_GRACE_S) as wait:
            self._reply_wait = wait
            if self._cancel is not None:
                wait.deadline = trio.current_time() + CANCEL_GRACE_S + STOP_GRACE_S
            try:
                outcome: ActionsOutcome = await request(
                    self.executor,
                    lambda reply_to: RunActions(
                        step=step,
                        calls=calls,
                        existing=existing,
                        scope=scope,
                        rejected=rejected,
                        revisions=self.view.observed_revisions(),
                        tokens_left=self._tokens_left(),
                        reply_to=reply_to,
                        handed=handed,
                    ),
                )
            finally:
                self._reply_wait = None
        if wait.cancelled_caught:  # the executor did not answer in time
            stop = StopReason.CANCELLED if self._cancel is not None else StopReason.TIME_BUDGET
            for intent in handed:
                self.view.apply(intent)
            return ActionsOutcome(stop=stop, results=self._unanswered(handed), written=())
        for record in outcome.written:
            self.view.apply(record)
        return outcome

    def _late_observations(
        self, parsed: ParsedReply, results: tuple[ActionResult, ...]
    ) -> tuple[str, ...]:
        """What a cut step's history shows for each tool call of its reply.

        Its late result's observation when it has one (what the tool returned in its grace
        period, or why it never ran), else the synthetic ``unknown`` text (docs/events.md,
        "Cancellation"). Never applied to the run (it ends whatever they say); a thread's
        next run, or a fork, sees them. Empty for a text reply treated as an action (no call
        ids).
        """
        calls = parsed.history_message.tool_calls
        said = {r.call_id: r.outcome.observation for r in results if r.call_id is not None}
        unknown = self.synthetic.unknown
        return tuple(
            said[c.id] if c.id in said else unknown.format(tool=c.name, detail="") for c in calls
        )

    def _unanswered(self, intents: list[ActionIntent]) -> tuple[ActionResult, ...]:
        """UNKNOWN late results for the intents of an executor that never answered."""
        return tuple(
            ActionResult.unknown(
                intent,
                observation=(
                    f"the outcome of the call to {intent.tool} is unknown: the run "
                    "stopped waiting for its executor"
                ),
                detail="the tool executor did not answer in time",
                ts=self.clock.now_iso(),
                late=True,
            )
            for intent in intents
        )

    async def _abandon(self, intent_id: str, step: int) -> None:
        """Resume: a model intent without result is recorded as abandoned.

        See docs/crash-safety.md, "Resume".
        """
        record = ModelResult(
            run_id=self.run_id,
            step=step,
            intent_id=intent_id,
            ts=self.clock.now_iso(),
            abandoned=True,
        )
        await self.writer.write(StoreOp.MODEL_RESULT, record)
        self.view.apply(record)

    async def _write_step(
        self, record: StepRecord, results: tuple[ActionResult, ...] | None
    ) -> None:
        await self.writer.write(StoreOp.STEP, *(results or ()), record)
        for result in results or ():
            self.view.apply(result)
        self.view.apply(record)
        self._unsent_steps.append(record)

    async def _close_pending(self) -> None:
        """A run ending before it ran its resumed step again: no intent stays without outcome."""
        now = self.clock.now_iso()
        closing = closing_records(
            self.run_id,
            self.view.pending,
            self.synthetic,
            now,
            "the run ended before the interrupted step was run again",
            active_s=carried_active_s(self.view.pending, now),
            ended=self.ended_children,
            history=self._pending_history(),
        )
        if closing and isinstance(closing[0], ModelResult):
            abandoned = closing.pop(0)
            await self.writer.write(StoreOp.MODEL_RESULT, abandoned)
            self.view.apply(abandoned)
        if closing:
            await self.writer.write(StoreOp.STEP, *closing)
            for record in closing:
                self.view.apply(record)

    def _pending_history(self) -> Message | None:
        """The pending step's assistant message as the parser gives it; ``None``: no reply.

        The parser is pure, so this is the message the step's action intents were written
        from (docs/seams.md, "Decision parser"): the calls under the ids the intents carry,
        repaired calls included, never the reply's raw calls.
        """
        reply = self.view.pending.reply
        if reply is None:
            return None
        return refuse_non_finite(self.parser.parse(reply, self.tools)).history_message

    def _elapsed(self, started: float) -> float:
        """Active seconds since ``started`` (approval waits of the step excluded)."""
        return round(trio.current_time() - started - self._waited_s, 6)

    async def _last_reading(self, reason: StopReason) -> StopReason:
        """``reason``, or ``cancelled`` when the control stream holds a cancel not read yet.

        Before a run ends for any other reason, it reads its control stream once
        (`read_control`) and applies what is there: a cancel written before that reading
        (``treadle cancel``, `treadle.approvals.request_cancel`) that the run's polling, every
        ``control_poll_s``, had not read yet ends the run ``cancelled``, as rule A says of a
        cancel known at the top of a step (docs/concepts.md, "Stop reasons"), rather than be
        left unapplied in the stream of a finished run (docs/events.md, "Cancellation").

        Raises:
            StoreError: the reading failed (the run is left unfinished and resumable).
        """
        if reason is StopReason.CANCELLED or self._cancel is not None or self.read_control is None:
            return reason
        for message in await self.read_control():
            self.apply(message)
        return StopReason.CANCELLED if self._cancel is not None else reason

    async def _finish(self, reason: StopReason, *, cut_active_s: float = 0.0) -> RunResult:
        reason = await self._last_reading(reason)
        self._finishing = True
        if self._late_step is not None and reason in (StopReason.CANCELLED, StopReason.TIME_BUDGET):
            # What the cut step's actions did is kept, marked late, before the cancel
            # record: none of it is applied (the run ends whatever they returned), and no
            # intent is left without a result.
            late_step = attrs.evolve(
                self._late_step, ts=self.clock.now_iso(), active_s=cut_active_s
            )
            await self.writer.write(StoreOp.STEP, *self._late, late_step)
            for result in self._late:
                self.view.apply(result)
            self.view.apply(late_step)
            cut_active_s = 0.0
        else:
            await self._close_pending()
        if reason is StopReason.CANCELLED and self.view.cancel is None:
            why, who = self._cancel or ("", "")
            cancel = repaired(
                CancelRequested(
                    run_id=self.run_id, ts=self.clock.now_iso(), reason=why, canceller=who
                )
            )
            await self.writer.barrier(StoreOp.CONTROL, cancel)
            self.view.apply(cancel)
        state = final_state(reason)
        record = RunFinished(
            run_id=self.run_id,
            ts=self.clock.now_iso(),
            state=state,
            stop_reason=reason,
            totals=self.view.totals(extra_active_s=cut_active_s),
            final_answer=self._final_answer if reason is StopReason.FINAL_ANSWER else None,
            error=self._error if reason is StopReason.MODEL_ERROR else None,
            model_error=self._model_error if reason is StopReason.MODEL_ERROR else None,
            output=self._answer_output if reason is StopReason.FINAL_ANSWER else None,
        )  # the event writer stamps its delivery counters into it
        await self.writer.barrier(StoreOp.RUN_FINISHED, record)
        self.view.apply(record)
        self._set_state(state)
        output_type = self.output.output_type if self.output is not None else None
        return RunResult.from_finished(record, output_type=output_type)


def _plus_s(instant: str, seconds: float) -> str:
    """The ISO-8601 instant ``seconds`` after ``instant``."""
    return (dt.datetime.fromisoformat(instant) + dt.timedelta(seconds=seconds)).isoformat()


_CUT_KINDS = frozenset(
    {StopReason.CANCELLED.value, StopReason.TIME_BUDGET.value, StopReason.TOKEN_BUDGET.value}
)
"""Error kinds of attempts cut by the run itself, not failed by the provider."""


Q = TypeVar("Q")
R = TypeVar("R")


def _observation_images(results: tuple[ActionResult, ...]) -> tuple[tuple[ImageRef, ...], ...]:
    """Per result, the images that enter history with it; empty when no result has any."""
    images = tuple(r.outcome.images for r in results)
    return images if any(images) else ()
