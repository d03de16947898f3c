"""The context hydrator: builds each model request from the log (docs/concepts.md, "Actors").

It keeps the history incrementally: the run input once, then per step record the assistant
message and the observations exactly as they entered history. It writes nothing; resume feeds
it the stored records and gets the same requests (history is read, never recomputed).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import attrs
import trio

from treadle.actors._rpc import reply
from treadle.types import (
    DecisionKind,
    JSONValue,
    Message,
    ModelRequest,
    RunStarted,
    StepRecord,
    ToolSpec,
)


@attrs.frozen(kw_only=True)
class Hydrate:
    """Ask for the next model request, after adding ``new_steps`` to the history."""

    new_steps: tuple[StepRecord, ...]
    reply_to: trio.MemorySendChannel[ModelRequest]


@attrs.define(eq=False)
class ContextHydrator:
    """The context hydrator actor of one run.

    Args:
        started: the run-started record (input messages).
        system_prompt: element 0 of every request, when not ``None``.
        tools: the declared tools.
        model: provider model name.
        max_output_tokens: the definition's cap, always sent.
        params: other sampling parameters.
    """

    started: RunStarted
    system_prompt: str | None
    tools: tuple[ToolSpec, ...]
    model: str
    max_output_tokens: int | None
    params: Mapping[str, JSONValue]
    _history: list[Message] = attrs.Factory(list)

    def __attrs_post_init__(self) -> None:
        if self.system_prompt is not None:
            self._history.append(Message(role="system", content=self.system_prompt))
        self._history.extend(self.started.input)

    async def run(
        self,
        inbox: trio.MemoryReceiveChannel[Hydrate],
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Serve `Hydrate` requests until ``inbox`` ends."""
        task_status.started()
        async with inbox:
            async for message in inbox:
                reply(message.reply_to, self.build(message.new_steps))

    def build(self, new_steps: Sequence[StepRecord]) -> ModelRequest:
        """Add ``new_steps`` to the history and return the next request."""
        for step in new_steps:
            self._history.extend(step_messages(step))
        return ModelRequest(
            messages=tuple(self._history),
            tools=self.tools,
            model=self.model,
            max_output_tokens=self.max_output_tokens,
            params=self.params,
        )


def step_messages(step: StepRecord) -> list[Message]:
    """The history messages one step contributes, as stored in its step record.

    An action answering a native tool call becomes a ``tool`` message; an action without a
    call id (a text reply treated as an action) becomes a ``user`` message. An invalid decision
    answers every call of the sanitised assistant message with the feedback, or else becomes a
    ``user`` message, so every tool-call id is always answered.
    """
    if step.decision is None or step.history_message is None:
        return []
    calls = step.history_message.tool_calls
    # An assistant turn with neither text nor calls is refused by providers: leave it out
    # and let the feedback speak for it.
    empty = not step.history_message.content and not calls
    messages = [] if empty else [step.history_message]
    if step.decision is DecisionKind.ACTIONS:
        if calls:
            for call, observation in zip(calls, step.observations, strict=False):
                messages.append(
                    Message(role="tool", content=observation, tool_call_id=call.id, name=call.name)
                )
        else:
            messages.extend(Message(role="user", content=o) for o in step.observations)
    elif step.decision is DecisionKind.INVALID:
        feedback = step.feedback or ""
        if calls:
            messages.extend(
                Message(role="tool", content=feedback, tool_call_id=c.id, name=c.name)
                for c in calls
            )
        else:
            messages.append(Message(role="user", content=feedback))
    return messages
