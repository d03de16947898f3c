"""The tool executor actor: intent before effect, timeouts, replay policies.

See docs/seams.md, "Action executor", and docs/crash-safety.md, "Resume".

For each action it writes the action intent (a barrier) before the action starts, runs it
under the per-call timeout inside the step's cancel scope, and turns the executor's outcome
into what enters history: NOT_EXECUTED and ENV_ERROR get the definition's synthetic text (the
executor's own text is kept as ``detail``), every observation is cut to the limit, and executed
ones not flagged synthetic are rendered through the observation template.

The call itself runs in the tool host (`treadle._toolhost`, docs/decisions/0025-tool-host.md),
not in the run's nursery: this actor only waits for it, so it answers on time whatever the
call does. A call it stops waiting for (cancelled past its grace period, cut by the time
budget, past its timeout) is abandoned: its result is UNKNOWN and ``late``, and what it
returns afterwards is a diagnostic only. So is the result of a call that gave up on a worker
thread still running (a thread tool at its timeout). A call that ended with no outcome of its
own (a process tool whose process died) or whose executor answered UNKNOWN itself is not late:
the run waited for it (docs/decisions/0137-late-is-the-runs-wait-not-a-verdict.md). Every
action whose intent was written gets exactly one result.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Protocol

import attrs
import trio

from treadle._budget import fit_text
from treadle._clock import Clock, seconds_out_of_range
from treadle._exceptions import ChildPending, SeamViolation, UsageError
from treadle._shapes import outcome_problem
from treadle._text import valid_unicode
from treadle._toolhost import HostedCall, ToolHost, current_host
from treadle.actors._mailbox import MailboxReceiver
from treadle.actors._messages import ActionsOutcome, AwaitedChild, RunActions
from treadle.actors._rpc import CANCEL_GRACE_S, StepScope, reply
from treadle.actors._writer import WriterClient
from treadle.policies import ExecutorPolicies, policies_of, replay_policy_of
from treadle.ports import ActionExecutor
from treadle.redaction import secret_values, without_secret_values
from treadle.types import (
    Action,
    ActionIntent,
    ActionOutcome,
    ActionResult,
    ActionStatus,
    JSONValue,
    Limits,
    Record,
    ReplayPolicy,
    StopReason,
    StoreOp,
    SyntheticObservations,
    ToolCall,
)

_TIMEOUT_GRACE_S = 1.0
"""Seconds past its timeout a call may take to end after it was cancelled, before the tool
executor abandons it (an executor that times its own calls out answers within this)."""


class _Done(Protocol):
    def __call__(
        self, outcome: ActionOutcome, reconciled: bool = ..., late: bool = ...
    ) -> None: ...


@attrs.frozen
class _Ended:
    """How one call of a step ended.

    Attributes:
        outcome: the executor's outcome (or the tool executor's own, for a call it gave up on).
        duration_s: seconds from its start to its end (0 for one that never ran).
        reconciled: the outcome came from the executor's ``reconcile`` on resume.
        late: the run stopped waiting for the call while it still ran: abandoned at its
            timeout, or a worker thread of it left running (`ToolExecutor._execute`).
    """

    outcome: ActionOutcome
    duration_s: float = 0.0
    reconciled: bool = False
    late: bool = False


_NOT_SECONDS = "must be a finite number of seconds >= 0, not None"


@attrs.define(eq=False)
class _ReportedTime:
    """Active seconds the calls of one step reported spending on the run's behalf.

    As another log records them (a child run's `treadle.types.Totals.active_s`); the most
    any call reported is kept, the step's calls running at once (docs/child-runs.md,
    "Budgets").
    """

    seconds: float = 0.0

    def report(self, seconds: float) -> None:
        """Keep ``seconds`` when more than reported so far.

        Raises:
            UsageError: ``seconds`` is not a finite number of 0 or more.
        """
        why = seconds_out_of_range(seconds) if seconds is not None else _NOT_SECONDS
        if why is not None:
            raise UsageError(f"report_active_s: {why}")
        self.seconds = max(self.seconds, seconds)


@attrs.define(eq=False)
class ToolExecutor:
    """The tool executor actor of one run.

    Args:
        generation: the run's lease generation under this drive (0 without a lease): each
            action carries it (`treadle.types.Action.generation`), for a tool to hand on as
            a fencing token (docs/crash-safety.md, "A paused driver").
        policies: what ``executor`` declares about its tools (`treadle.Agent.tool_policies`);
            looked up from ``executor`` when not given.
    """

    run_id: str
    executor: ActionExecutor
    writer: WriterClient
    clock: Clock
    limits: Limits
    synthetic: SyntheticObservations
    observation_template: str = "{observation}"
    host: ToolHost | None = None
    cancel_grace_s: float = CANCEL_GRACE_S
    generation: int = 0
    policies: ExecutorPolicies = attrs.field(
        default=attrs.Factory(lambda self: policies_of(self.executor), takes_self=True)
    )

    @trio.lowlevel.enable_ki_protection  # Ctrl-C reaches the main task: decision 0097
    async def run(
        self,
        inbox: MailboxReceiver[RunActions],
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Serve `RunActions` requests, one step at a time, until ``inbox`` ends."""
        task_status.started()
        async with inbox:
            async for message in inbox:
                reply(message.reply_to, await self.run_actions(message))

    async def run_actions(self, message: RunActions) -> ActionsOutcome:
        """Write the intents, run the actions, and build their results."""
        cancelled = _cancel_called(message.scope)
        running = [call for call in message.calls if call.id not in message.rejected]
        can_park = all(
            replay_policy_of(self.executor, call.name) is ReplayPolicy.SAFE for call in running
        )
        tokens_left = message.tokens_left
        if tokens_left is not None and len(running) > 1:  # calls at once share what is left
            tokens_left //= len(running)
        reported = _ReportedTime()
        actions = [
            self._action(
                message.step,
                i,
                call,
                message.revisions,
                tokens_left=tokens_left,
                deadline=message.scope.deadline,
                forward=self.writer.forward,
                cancelled=cancelled,
                report_active_s=reported.report,
                can_park=can_park,
            )
            for i, call in enumerate(message.calls)
        ]
        existing = {intent.intent_id: intent for intent in message.existing}
        written: list[Record] = []
        outcomes: dict[int, _Ended] = {}
        awaiting: dict[int, AwaitedChild] = {}
        for index, action in enumerate(actions):
            detail = message.rejected.get(action.call_id)
            if detail is not None and action.intent_id not in existing:
                outcomes[index] = _Ended(self._rejected(action, detail))
        began: set[int] = set()
        with message.scope.open() as cut:
            fresh = [
                a
                for i, a in enumerate(actions)
                if a.intent_id not in existing and i not in outcomes
            ]
            for action in fresh:
                await self._write_intent(action, written, message.handed)
            runnable = [(i, a) for i, a in enumerate(actions) if i not in outcomes]
            if len(runnable) == 1:  # the common case: performed here, no nursery or task
                index, action = runnable[0]
                began.add(index)
                replay = action.intent_id in existing
                await self._perform(index, action, replay, outcomes, awaiting, message.scope)
            else:
                async with trio.open_nursery() as nursery:
                    for index, action in runnable:
                        replay = action.intent_id in existing
                        began.add(index)
                        nursery.start_soon(
                            self._perform,
                            index,
                            action,
                            replay,
                            outcomes,
                            awaiting,
                            message.scope,
                        )
        if message.scope.cancel_called:
            stop = StopReason.CANCELLED
            return self._cut(stop, actions, existing, written, outcomes, began, message.calls)
        if awaiting and not cut.cancelled_caught and len(outcomes) + len(awaiting) == len(actions):
            parked = tuple(awaiting[i] for i in sorted(awaiting))
            return ActionsOutcome(written=tuple(written), awaiting=parked)
        if cut.cancelled_caught or len(outcomes) < len(actions):
            stop = StopReason.TIME_BUDGET
            return self._cut(stop, actions, existing, written, outcomes, began, message.calls)
        results: list[ActionResult] = []
        observations: list[str] = []
        for index, action in enumerate(actions):
            ended = outcomes[index]
            rejected = action.call_id in message.rejected and action.intent_id not in existing
            result, observation = self._result(action, ended, message.calls, rejected=rejected)
            observations.append(observation)
            results.append(result)
        return ActionsOutcome(
            results=tuple(results),
            observations=tuple(observations),
            written=tuple(written),
            reported_active_s=reported.seconds,
        )

    def _secret_values(self, calls: Iterable[ToolCall]) -> tuple[JSONValue, ...]:
        """The values of the secret arguments of ``calls`` (one step's), at any depth.

        Hidden in the executor's own text about each call of the step, not only about the
        call that holds them (`_finish`).
        """
        secret = self.policies.secret_arguments
        return tuple(v for call in calls for v in secret_values(call.arguments, secret(call.name)))

    def _cut(
        self,
        stop: StopReason,
        actions: list[Action],
        existing: Mapping[str, ActionIntent],
        written: list[Record],
        outcomes: dict[int, _Ended],
        began: set[int],
        step_calls: tuple[ToolCall, ...],
    ) -> ActionsOutcome:
        """The step was cut (cancelled, or by the time budget): each intent gets a late result.

        A call that returned anyway (it finished within its grace period) keeps its
        outcome; one cut while it ran, or abandoned, is UNKNOWN; one that never started
        (cut while its intent was being written) is NOT_EXECUTED. None of them is applied.
        """
        intents = {r.intent_id for r in written if isinstance(r, ActionIntent)} | set(existing)
        results: list[ActionResult] = []
        for index, action in enumerate(actions):
            if action.intent_id not in intents:
                continue
            if index in outcomes:
                ended = outcomes[index]
            elif index in began:
                ended = _Ended(self._unknown(action))
            else:
                detail = (
                    "the run was cancelled before the call started"
                    if stop is StopReason.CANCELLED
                    else "the time budget ran out before the call started"
                )
                ended = _Ended(ActionOutcome(status=ActionStatus.NOT_EXECUTED, observation=detail))
            result, _ = self._result(action, ended, step_calls)
            results.append(attrs.evolve(result, late=True))
        return ActionsOutcome(results=tuple(results), stop=stop, written=tuple(written))

    def _result(
        self,
        action: Action,
        ended: _Ended,
        step_calls: tuple[ToolCall, ...],
        *,
        rejected: bool = False,
    ) -> tuple[ActionResult, str]:
        # What the tool returned enters the log (and the history) as valid Unicode only.
        outcome, replaced = valid_unicode(ended.outcome)
        if rejected:  # already the synthetic text of a rejection
            outcome = self._within_limit(outcome)
            observation = outcome.observation
        else:
            outcome, observation = self._finish(action, outcome, step_calls)
        result = ActionResult(
            run_id=self.run_id,
            step=action.step,
            intent_id=action.intent_id,
            call_id=action.call_id,
            tool=action.tool,
            outcome=outcome,
            ts=self.clock.now_iso(),
            duration_s=round(ended.duration_s, 6),
            late=ended.late,
            reconciled=ended.reconciled,
            surrogates_replaced=replaced,
        )
        return result, observation

    def _rejected(self, action: Action, detail: str) -> ActionOutcome:
        """A call a human rejected, or whose approval wait expired: it never runs."""
        return ActionOutcome(
            status=ActionStatus.NOT_EXECUTED,
            observation=self.synthetic.rejected.format(tool=action.tool, detail=detail),
            observation_is_synthetic=True,
            detail=detail,
        )

    def _unknown(self, action: Action) -> ActionOutcome:
        return ActionOutcome(
            status=ActionStatus.UNKNOWN,
            observation=self.synthetic.unknown.format(tool=action.tool, detail=""),
            observation_is_synthetic=True,
        )

    def _action(
        self,
        step: int,
        index: int,
        call: ToolCall,
        revisions: Mapping[str, tuple[int, ...]],
        **more: Any,
    ) -> Action:
        return Action(
            run_id=self.run_id,
            step=step,
            intent_id=f"{self.run_id}/s{step}/a{index + 1}",
            call_id=call.id,
            tool=call.name,
            arguments=call.arguments,
            revisions=revisions,
            timeout_s=self._timeout_s(call.name)[0],
            generation=self.generation,
            **more,
        )

    async def _write_intent(
        self, action: Action, written: list[Record], handed: list[ActionIntent]
    ) -> None:
        intent = ActionIntent(
            run_id=self.run_id,
            step=action.step,
            intent_id=action.intent_id,
            call_id=action.call_id,
            tool=action.tool,
            arguments=action.arguments,
            ts=self.clock.now_iso(),
        )
        durable = await self.writer.send_barrier(StoreOp.INTENT, intent)
        written.append(intent)
        handed.append(intent)
        await durable.receive()

    @trio.lowlevel.enable_ki_protection  # Ctrl-C reaches the main task: decision 0097
    async def _perform(
        self,
        index: int,
        action: Action,
        replay: bool,
        outcomes: dict[int, _Ended],
        awaiting: dict[int, AwaitedChild],
        step: StepScope,
    ) -> None:
        started = trio.current_time()

        def done(outcome: ActionOutcome, reconciled: bool = False, late: bool = False) -> None:
            outcomes[index] = _Ended(outcome, trio.current_time() - started, reconciled, late)

        if replay and replay_policy_of(self.executor, action.tool) is not ReplayPolicy.SAFE:
            await self._reconcile(action, step, done)
        else:
            if action.replay is not replay:
                action = attrs.evolve(action, replay=replay)
            parked = await self._execute(action, step, done)
            if parked is not None:
                awaiting[index] = AwaitedChild(
                    intent_id=action.intent_id,
                    child_run_id=parked.run_id,
                    recheck_s=parked.recheck_s,
                )

    async def _execute(
        self,
        action: Action,
        step: StepScope,
        done: _Done,
    ) -> ChildPending | None:
        """Run the call in the host and wait for it, within its timeout and the step's scope.

        On return ``done`` got the outcome, or the call parked on a child run: then it
        returns the call's `ChildPending` and ``done`` got nothing. Cut by the step
        (`trio.Cancelled` raised): ``done`` got the outcome when the call ended within its
        grace period, else nothing (the call was abandoned: its result is UNKNOWN).
        """
        host = self.host or current_host()
        call: HostedCall[ActionOutcome] = host.start(
            functools.partial(self.executor.execute, action),
            description=f"the call {action.intent_id} ({action.tool}) of run {self.run_id!r}",
            on_late=self.writer.warn,
        )
        limit = await self._wait(call, action, step, done)
        found = call.result()
        if not call.done:
            call.abandon()
            done(
                ActionOutcome(
                    status=ActionStatus.UNKNOWN,
                    observation=(
                        f"Error: the call to {action.tool} timed out after {limit:g} s and "
                        "was abandoned while it still ran; its outcome is unknown. Check "
                        "its effect before trying again."
                    ),
                    detail="abandoned at its timeout: it did not end when cancelled",
                ),
                late=True,
            )
        elif found is None:  # it honoured the cancellation at its timeout
            done(
                ActionOutcome(
                    status=ActionStatus.EXECUTED,
                    observation=f"Error: the call to {action.tool} timed out after {limit:g} s",
                )
            )
        else:
            try:
                outcome = found.unwrap()
            except ChildPending as parked:
                if not action.can_park:
                    raise SeamViolation(
                        "action executor", parked, "an outcome (this call may not park)"
                    ) from None
                return parked
            problem = outcome_problem(outcome)
            if problem is not None:
                raise SeamViolation(
                    "action executor", outcome, f"a valid ActionOutcome ({problem})"
                )
            done(outcome, late=call.left_running)  # a thread it gave up on runs on
        return None

    async def _reconcile(self, action: Action, step: StepScope, done: _Done) -> None:
        """Ask the executor what an interrupted call did: in the host, as a call runs.

        The hook is waited for like a call (its timeout, the step's cancel and time budget),
        so one that ignores cancellation cannot hold the run (docs/concepts.md, "Tools and
        cancellation"); one abandoned, or that cannot tell, leaves the call UNKNOWN with the
        definition's synthetic text (docs/concepts.md, "Actions and observations").

        Raises:
            SeamViolation: the hook returned neither an `ActionOutcome` nor ``None``.
            Exception: what the hook raised.
        """
        host = self.host or current_host()
        call: HostedCall[ActionOutcome | None] = host.start(
            functools.partial(self.executor.reconcile, action),
            description=(
                f"the reconcile of {action.intent_id} ({action.tool}) of run {self.run_id!r}"
            ),
            on_late=self.writer.warn,
        )

        def take(found: ActionOutcome | None) -> None:
            problem = None if found is None else outcome_problem(found, "reconcile")
            if problem is not None:
                raise SeamViolation(
                    "action executor's reconcile",
                    found,
                    f"a valid ActionOutcome or None ({problem})",
                )
            if found is None or found.status is ActionStatus.UNKNOWN:
                unknown = self._unknown(action)
                if found is not None:
                    unknown = attrs.evolve(unknown, detail=found.detail or found.observation)
                done(unknown)
            else:
                done(found, True)

        await self._wait(call, action, step, take)
        found = call.result()
        if not call.done:
            call.abandon()
        take(None if found is None else found.unwrap())

    async def _wait(
        self,
        call: HostedCall[Any],
        action: Action,
        step: StepScope,
        take: Callable[[Any], None],
    ) -> float:
        """Wait for a call in the host within ``action``'s timeout and the step's scope.

        Returns the timeout (seconds); the call may still run (past its timeout and its
        grace). Cut by the step (`trio.Cancelled` raised): ``take`` got what the call returned
        when it ended within its grace period; else the call was abandoned.
        """
        limit, own = self._timeout_s(action.tool)
        try:
            # An executor that times its calls out itself (`Toolbox`) gets to answer first.
            with trio.move_on_after(limit + _TIMEOUT_GRACE_S if own else limit):
                await call.wait()
            if not call.done:
                call.cancel()
                with trio.move_on_after(_TIMEOUT_GRACE_S):
                    await call.wait()
        except trio.Cancelled:
            call.cancel()
            with trio.CancelScope(shield=True, deadline=self._grace_ends(step, limit)):
                await call.wait()
            self._settle(call, take, action)
            raise
        return limit

    def _grace_ends(self, step: StepScope, limit: float) -> float:
        """When a call cut by ``step`` stops being waited for (trio clock, seconds).

        Cancelled, the call gets its grace period (``cancel_grace_s``), which ends at the
        step's deadline (the time budget) all the same: the active time is spent, and the
        run ends on time. Cut by the time budget: no grace. A child run's call (``limit``
        ``inf``) has the cancel's grace either way, for its child to record its cancel
        (docs/child-runs.md, "Cancellation"): a child waiting on a human spends no active
        time of its own, and would otherwise be left driven by nobody's run. See
        docs/concepts.md, "Tools and cancellation".
        """
        now = trio.current_time()
        if limit == math.inf:
            return now + self.cancel_grace_s
        if not step.cancel_called:
            return now
        return min(now + self.cancel_grace_s, step.deadline)

    def _settle(self, call: HostedCall[Any], take: Callable[[Any], None], action: Action) -> None:
        """After a cut: keep what the call returned in time; abandon it otherwise."""
        if not call.done:
            call.abandon()
            return
        found = call.result()
        if found is None:
            return  # it ended by honouring the cancellation: outcome unknown
        try:
            take(found.unwrap())
        except Exception as exc:  # a seam bug surfacing late: the result stays unknown
            self.writer.warn(
                f"the cut call {action.intent_id} ({action.tool}) raised "
                f"{type(exc).__name__}: {exc}"
            )

    def _timeout_s(self, tool: str) -> tuple[float, bool]:
        """The call's timeout (the limit, or the tool's own when shorter), and more.

        The second value says whether the executor times its calls out itself (its
        ``timeout_s(tool)`` gives a number, as `Toolbox`'s does). A tool whose own timeout is
        ``inf`` (a child-run tool, `treadle.agent_tool`) has none: the step's deadline (the
        time budget) and cancellation bound it (docs/child-runs.md, "Budgets").
        """
        found = self.policies.timeout_s(tool)
        limit = self.limits.tool_timeout_s
        if found == math.inf:  # a child run: bounded by the run's budgets instead
            return math.inf, True
        if isinstance(found, int | float) and found > 0:
            return min(limit, float(found)), True
        return limit, False

    def _finish(
        self, action: Action, outcome: ActionOutcome, step_calls: tuple[ToolCall, ...]
    ) -> tuple[ActionOutcome, str]:
        """Apply synthetic observations, truncation and the template.

        The detail of a call that did not run (or failed its environment) is the executor's
        own text about the call, an argument check's quoting what it got: the values of the
        tool's secret arguments are replaced in it, and those of the other calls of the step,
        ``step_calls`` (`treadle.redaction.without_secret_values`; docs/events.md, "Secret
        arguments").
        """
        if outcome.status in (ActionStatus.NOT_EXECUTED, ActionStatus.ENV_ERROR):
            template = (
                self.synthetic.not_executed
                if outcome.status is ActionStatus.NOT_EXECUTED
                else self.synthetic.env_error
            )
            if outcome.status is ActionStatus.NOT_EXECUTED and outcome.stale_resource:
                template = self.synthetic.stale
            detail = without_secret_values(
                outcome.detail or outcome.observation,
                action.arguments,
                self.policies.secret_arguments(action.tool),
                known=self._secret_values(step_calls),
            )
            text = template.format(
                tool=action.tool, detail=detail, resource=outcome.stale_resource or ""
            )
            outcome = attrs.evolve(
                outcome,
                observation=text,
                observation_is_synthetic=True,
                observation_truncated_chars=0,
                detail=detail,
                images=(),
            )
            outcome = self._within_limit(outcome)
            return outcome, outcome.observation
        outcome = self._within_limit(outcome)
        if outcome.observation_is_synthetic:  # the executor's own words: no template
            return outcome, outcome.observation
        text = self.observation_template.format(observation=outcome.observation, tool=action.tool)
        return outcome, text

    def _within_limit(self, outcome: ActionOutcome) -> ActionOutcome:
        """``outcome`` with its observation cut to `Limits.max_observation_chars`.

        Every observation that enters history is, a synthetic one too (an executor flags its
        own text so; a definition's text holds the executor's detail): docs/context.md,
        "Truncation". As the context window cuts: never inside a character or a JSON value,
        and the model is told what happened.
        """
        limit = self.limits.max_observation_chars
        if limit is None or len(outcome.observation) <= limit:
            return outcome
        mark = f"[cut: the result is longer than {limit} characters]"
        kept = fit_text(outcome.observation, limit, mark)
        shown = len(kept) - len(mark) - 1 if kept.endswith(mark) else 0
        return attrs.evolve(
            outcome,
            observation=kept,
            observation_truncated_chars=outcome.observation_truncated_chars
            + len(outcome.observation)
            - max(0, shown),
        )


def _cancel_called(scope: StepScope) -> Callable[[], bool]:
    """``() -> bool``: whether the run's step was cancelled (a cancel of the run itself)."""
    return lambda: scope.cancel_called
