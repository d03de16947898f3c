"""The tool executor actor: intent before effect, timeouts, replay policies.

See docs/seams.md, "Action executor", and docs/crash-safety.md, "Resume".

For each action it writes the action intent (a barrier) before the action starts, runs it
under the per-call timeout inside the step's cancel scope, and turns the executor's outcome
into what enters history: NOT_EXECUTED and ENV_ERROR get the definition's synthetic text (the
executor's own text is kept as ``detail``), executed observations are cut to the limit and
rendered through the observation template.
"""

from __future__ import annotations

from collections.abc import Mapping

import attrs
import trio

from treadle._clock import Clock
from treadle._exceptions import SeamViolation
from treadle._text import valid_unicode
from treadle.actors._rpc import StepScope, reply
from treadle.actors.writer import WriterClient
from treadle.ports import ActionExecutor
from treadle.types import (
    Action,
    ActionIntent,
    ActionOutcome,
    ActionResult,
    ActionStatus,
    Limits,
    Record,
    ReplayPolicy,
    StopReason,
    StoreOp,
    SyntheticObservations,
    ToolCall,
)


@attrs.frozen(kw_only=True)
class RunActions:
    """Run the actions of ``step``.

    Attributes:
        calls: the tool calls, in the order the model gave them.
        existing: action intents already in the log for this step (resume), in call order.
        scope: the step's cancellation and active-time deadline.
        rejected: calls a human rejected (or whose approval expired), by call id, with the
            detail of their synthetic observation; they get no intent and never run.
        revisions: the revisions the run observed before this step, folded from its log
            (`treadle._state.RunView.revisions`), handed to every action of the step.
    """

    step: int
    calls: tuple[ToolCall, ...]
    existing: tuple[ActionIntent, ...]
    scope: StepScope
    reply_to: trio.MemorySendChannel[ActionsOutcome]
    rejected: Mapping[str, str] = attrs.field(factory=dict)
    revisions: Mapping[str, tuple[int, ...]] = attrs.field(factory=dict)


@attrs.frozen(kw_only=True)
class ActionsOutcome:
    """The executor actor's answer.

    Attributes:
        results: one result per call, in call order. When the step was cancelled: one
            result per action whose intent was written, marked ``late`` (never applied);
            empty when cut by the time budget.
        observations: the text each result put into history, in call order.
        stop: ``cancelled`` or ``time_budget`` when the step was cut off mid-action.
        written: the intents written, in order.
    """

    results: tuple[ActionResult, ...] = ()
    observations: tuple[str, ...] = ()
    stop: StopReason | None = None
    written: tuple[Record, ...] = ()


@attrs.define(eq=False)
class ToolExecutor:
    """The tool executor actor of one run."""

    run_id: str
    executor: ActionExecutor
    writer: WriterClient
    clock: Clock
    limits: Limits
    synthetic: SyntheticObservations
    observation_template: str = "{observation}"

    async def run(
        self,
        inbox: trio.MemoryReceiveChannel[RunActions],
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
        actions = [
            self._action(message.step, i, call, message.revisions)
            for i, call in enumerate(message.calls)
        ]
        existing = {intent.intent_id: intent for intent in message.existing}
        written: list[Record] = []
        outcomes: dict[int, tuple[ActionOutcome, float, bool]] = {}
        for index, action in enumerate(actions):
            detail = message.rejected.get(action.call_id)
            if detail is not None and action.intent_id not in existing:
                outcomes[index] = (self._rejected(action, detail), 0.0, False)
        began: set[int] = set()
        with message.scope.open():
            fresh = [
                a
                for i, a in enumerate(actions)
                if a.intent_id not in existing and i not in outcomes
            ]
            for action in fresh:
                await self._write_intent(action, written)
            async with trio.open_nursery() as nursery:
                for index, action in enumerate(actions):
                    if index in outcomes:
                        continue
                    replay = action.intent_id in existing
                    began.add(index)
                    nursery.start_soon(self._perform, index, action, replay, outcomes)
        if message.scope.cancel_called:
            return self._cancelled(actions, existing, written, outcomes, began)
        if len(outcomes) < len(actions):
            return ActionsOutcome(stop=StopReason.TIME_BUDGET, written=tuple(written))
        results: list[ActionResult] = []
        observations: list[str] = []
        for index, action in enumerate(actions):
            outcome, duration, reconciled = outcomes[index]
            rejected = action.call_id in message.rejected and action.intent_id not in existing
            result, observation = self._result(
                action, outcome, duration, rejected=rejected, reconciled=reconciled
            )
            observations.append(observation)
            results.append(result)
        return ActionsOutcome(
            results=tuple(results), observations=tuple(observations), written=tuple(written)
        )

    def _cancelled(
        self,
        actions: list[Action],
        existing: Mapping[str, ActionIntent],
        written: list[Record],
        outcomes: dict[int, tuple[ActionOutcome, float, bool]],
        began: set[int],
    ) -> ActionsOutcome:
        """The step was cancelled: every action with an intent gets a result marked late.

        A call that returned anyway (it finished within its grace period) keeps its
        outcome; one cut by the cancellation is UNKNOWN; one that never started (cancelled
        while its intent was being written) is NOT_EXECUTED. None of them is applied.
        """
        intents = {r.intent_id for r in written if isinstance(r, ActionIntent)} | set(existing)
        results: list[ActionResult] = []
        for index, action in enumerate(actions):
            if action.intent_id not in intents:
                continue
            reconciled = False
            if index in outcomes:
                outcome, duration, reconciled = outcomes[index]
            elif index in began:
                outcome, duration = self._unknown(action), 0.0
            else:
                detail = "the run was cancelled before the call started"
                outcome, duration = (
                    ActionOutcome(status=ActionStatus.NOT_EXECUTED, observation=detail),
                    0.0,
                )
            result, _ = self._result(action, outcome, duration, reconciled=reconciled)
            results.append(attrs.evolve(result, late=True))
        return ActionsOutcome(
            results=tuple(results), stop=StopReason.CANCELLED, written=tuple(written)
        )

    def _result(
        self,
        action: Action,
        outcome: ActionOutcome,
        duration: float,
        *,
        rejected: bool = False,
        reconciled: bool = False,
    ) -> tuple[ActionResult, str]:
        # What the tool returned enters the log (and the history) as valid Unicode only.
        outcome, replaced = valid_unicode(outcome)
        if rejected:  # already the synthetic text of a rejection
            observation = outcome.observation
        else:
            outcome, observation = self._finish(action, outcome)
        result = ActionResult(
            run_id=self.run_id,
            step=action.step,
            intent_id=action.intent_id,
            call_id=action.call_id,
            tool=action.tool,
            outcome=outcome,
            ts=self.clock.now_iso(),
            duration_s=round(duration, 6),
            reconciled=reconciled,
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
        self, step: int, index: int, call: ToolCall, revisions: Mapping[str, tuple[int, ...]]
    ) -> Action:
        return Action(
            run_id=self.run_id,
            step=step,
            intent_id=f"{self.run_id}/s{step}/a{index + 1}",
            call_id=call.id,
            tool=call.name,
            arguments=call.arguments,
            revisions=revisions,
        )

    async def _write_intent(self, action: Action, written: list[Record]) -> None:
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
        with durable:
            await durable.receive()

    async def _perform(
        self,
        index: int,
        action: Action,
        replay: bool,
        outcomes: dict[int, tuple[ActionOutcome, float, bool]],
    ) -> None:
        started = trio.current_time()
        reconciled = False
        if replay and self.executor.replay_policy(action.tool) is not ReplayPolicy.SAFE:
            found = await self.executor.reconcile(action)
            if found is not None and not _is_outcome(found):
                raise SeamViolation(
                    "action executor's reconcile", found, "an ActionOutcome or None"
                )
            reconciled = found is not None
            outcome = found if found is not None else self._unknown(action)
        else:
            outcome = await self._execute(attrs.evolve(action, replay=replay))
        outcomes[index] = (outcome, trio.current_time() - started, reconciled)

    async def _execute(self, action: Action) -> ActionOutcome:
        with trio.move_on_after(self.limits.tool_timeout_s) as timeout:
            outcome = await self.executor.execute(action)
            if not _is_outcome(outcome):
                raise SeamViolation("action executor", outcome, "an ActionOutcome")
            return outcome
        assert timeout.cancelled_caught
        return ActionOutcome(
            status=ActionStatus.EXECUTED,
            observation=(
                f"Error: the call to {action.tool} timed out after {self.limits.tool_timeout_s:g} s"
            ),
        )

    def _finish(self, action: Action, outcome: ActionOutcome) -> tuple[ActionOutcome, str]:
        """Apply synthetic observations, truncation and the template."""
        if outcome.status in (ActionStatus.NOT_EXECUTED, ActionStatus.ENV_ERROR):
            template = (
                self.synthetic.not_executed
                if outcome.status is ActionStatus.NOT_EXECUTED
                else self.synthetic.env_error
            )
            if outcome.status is ActionStatus.NOT_EXECUTED and outcome.stale_resource:
                template = self.synthetic.stale
            detail = outcome.detail or outcome.observation
            text = template.format(
                tool=action.tool, detail=detail, resource=outcome.stale_resource or ""
            )
            outcome = attrs.evolve(
                outcome,
                observation=text,
                observation_is_synthetic=True,
                observation_truncated_chars=0,
                detail=detail,
            )
            return outcome, text
        if outcome.observation_is_synthetic:
            return outcome, outcome.observation
        limit = self.limits.max_observation_chars
        if limit is not None and len(outcome.observation) > limit:
            cut = len(outcome.observation) - limit
            outcome = attrs.evolve(
                outcome,
                observation=outcome.observation[:limit],
                observation_truncated_chars=outcome.observation_truncated_chars + cut,
            )
        text = self.observation_template.format(observation=outcome.observation, tool=action.tool)
        return outcome, text


def _is_outcome(value: object) -> bool:
    """An `ActionOutcome` with a status of `ActionStatus` (what the seam may return)."""
    return isinstance(value, ActionOutcome) and isinstance(value.status, ActionStatus)
