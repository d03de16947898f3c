from __future__ import annotations

from collections.abc import Sequence

import attrs
import trio

from treadle.types import (
    Action,
    ActionOutcome,
    ActionStatus,
    DecisionKind,
    Message,
    ModelReply,
    ParsedReply,
    ReplayPolicy,
    ToolSpec,
)


@attrs.define(eq=False)
class SimpleParser:
    """Native tool calls -> actions, text -> final answer, nothing -> invalid."""

    def parse(self, reply: ModelReply, tools: Sequence[ToolSpec]) -> ParsedReply:
        history = Message(role="assistant", content=reply.text, tool_calls=reply.tool_calls)
        if reply.tool_calls:
            return ParsedReply(
                kind=DecisionKind.ACTIONS, actions=reply.tool_calls, history_message=history
            )
        if reply.text:
            return ParsedReply(
                kind=DecisionKind.FINAL_ANSWER, text=reply.text, history_message=history
            )
        return ParsedReply(
            kind=DecisionKind.INVALID,
            feedback="Reply with text or a tool call.",
            reason="empty_reply",
            history_message=history,
        )


@attrs.define(eq=False)
class LedgerTools:
    """Tools: add(a, b) executed; done() completes; boom() env error; sleep(s); others unknown."""

    executed: list[Action] = attrs.Factory(list)
    safe: frozenset[str] = frozenset()

    def tool_specs(self) -> tuple[ToolSpec, ...]:
        return tuple(ToolSpec(name=n) for n in ("add", "done", "boom", "sleep"))

    def replay_policy(self, tool: str) -> ReplayPolicy:
        return ReplayPolicy.SAFE if tool in self.safe else ReplayPolicy.NEVER

    async def execute(self, action: Action) -> ActionOutcome:
        await trio.lowlevel.checkpoint()
        if action.tool == "add":
            self.executed.append(action)
            total = action.arguments["a"] + action.arguments["b"]
            return ActionOutcome(status=ActionStatus.EXECUTED, observation=str(total))
        if action.tool == "done":
            self.executed.append(action)
            return ActionOutcome(
                status=ActionStatus.EXECUTED, observation="ok", task_completed=True
            )
        if action.tool == "boom":
            return ActionOutcome(status=ActionStatus.ENV_ERROR, observation="db connection lost")
        if action.tool == "sleep":
            self.executed.append(action)
            await trio.sleep(action.arguments["s"])
            return ActionOutcome(status=ActionStatus.EXECUTED, observation="slept")
        return ActionOutcome(
            status=ActionStatus.NOT_EXECUTED, observation=f"unknown tool {action.tool}"
        )

    async def reconcile(self, action: Action) -> ActionOutcome | None:
        await trio.lowlevel.checkpoint()
        return None
