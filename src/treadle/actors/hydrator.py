"""The context hydrator: builds each model request from the log (docs/concepts.md, "Actors").

It keeps the history incrementally: the run input once, then per step record the assistant
message and the observations exactly as they entered history. It writes nothing; resume feeds
it the stored records and gets the same requests (history is read, never recomputed).

Every tool call of an assistant message in a request is answered by a tool message before the
next other message, whatever the log holds (providers refuse a request that leaves one
unanswered). A call the log gives no observation for (a step cut by a cancel whose cancel
record a crash lost, a run input ending on a tool call) is answered with the definition's
synthetic ``unknown`` observation (docs/crash-safety.md, "Resume").
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
    OutputFormat,
    RunStarted,
    StepRecord,
    SyntheticObservations,
    ToolCall,
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
        synthetic: the definition's synthetic observations; ``unknown`` answers a tool call
            the log holds no observation for.
        output: the native structured output every request asks for, ``None`` for none
            (docs/structured-output.md).
    """

    started: RunStarted
    system_prompt: str | None
    tools: tuple[ToolSpec, ...]
    model: str
    max_output_tokens: int | None
    params: Mapping[str, JSONValue]
    synthetic: SyntheticObservations = SyntheticObservations()
    output: OutputFormat | None = None
    _history: list[Message] = attrs.Factory(list)

    def __attrs_post_init__(self) -> None:
        if self.system_prompt is not None:
            self._history.append(Message(role="system", content=self.system_prompt))
        self._history.extend(answer_every_call(self.started.input, self.synthetic))

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
            self._history.extend(answer_every_call(step_messages(step), self.synthetic))
        return ModelRequest(
            messages=tuple(self._history),
            tools=self.tools,
            model=self.model,
            max_output_tokens=self.max_output_tokens,
            params=self.params,
            output=self.output,
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


def answer_every_call(
    messages: Sequence[Message], synthetic: SyntheticObservations
) -> list[Message]:
    """``messages`` with every tool call of an assistant message answered by a tool message.

    A call that no ``tool`` message answers before the next message of another role (or the
    end) gets one there, whose text is ``synthetic.unknown`` for its tool: the history never
    claims an outcome the log does not hold. ``messages`` that answer every call are returned
    unchanged (as a new list).
    """
    out: list[Message] = []
    waiting: list[ToolCall] = []
    answered: set[str] = set()

    def close() -> None:
        for call in waiting:
            if call.id not in answered:
                text = synthetic.unknown.format(tool=call.name, detail="")
                out.append(Message(role="tool", content=text, tool_call_id=call.id, name=call.name))
        waiting.clear()
        answered.clear()

    for message in messages:
        if message.role == "tool" and message.tool_call_id is not None:
            answered.add(message.tool_call_id)
            out.append(message)
            continue
        close()
        out.append(message)
        if message.role == "assistant":
            waiting.extend(message.tool_calls)
    close()
    return out
