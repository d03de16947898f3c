"""Scoring an airline conversation, and replaying a recording's tool calls.

A conversation scores 1.0 when all hold, else 0.0:

* it completed: the customer ended it (a message containing ``###STOP###``) or the agent
  transferred the customer to a human agent. A conversation cut off before that (the
  benchmark's step limit) is not scored and gets 0.0, as in the benchmark;
* its final database has the same data content as a fresh database to which the task's
  ground-truth actions were applied (the ``applied_actions`` bookkeeping is not data);
* every expected output string of the task appears in some assistant reply, ignoring case
  and the thousands separators (commas) of the reply, as the benchmark did ("$23,553"
  contains "23553").

Data content is compared through `AirlineDatabase.data_hash`, the benchmark's own content
hash: dict key order does not count, list order does, and ``1`` differs from ``1.0``.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

from treadle.demo.airline.data import AirlineTask, Recording
from treadle.demo.airline.db import AirlineDatabase
from treadle.demo.airline.tools import TERMINAL_TOOLS, AirlineToolError, run_tool
from treadle.types import JSONValue


@attrs.frozen(kw_only=True)
class Score:
    """The score of one conversation and why.

    Attributes:
        reward: 1.0 or 0.0.
        completed: whether the conversation reached its end (see `conversation_completed`).
        data_matches: whether the final data equals the ground-truth data.
        outputs_found: expected output -> whether some assistant reply contains it.
        data_hash: content hash of the conversation's final database.
        expected_data_hash: content hash of the ground-truth database.
    """

    reward: float
    completed: bool
    data_matches: bool
    outputs_found: Mapping[str, bool]
    data_hash: str
    expected_data_hash: str


@attrs.frozen(kw_only=True)
class ReplayedCall:
    """One recorded tool call run again, with the recorded and the reproduced output.

    Attributes:
        index: position of the call among the recording's tool calls (0-based).
        call_id: the recorded tool-call id.
        tool: the tool name.
        arguments: the decoded arguments.
        recorded: the recorded tool message content.
        output: what the tool returned now, or ``None`` when it raised.
        error: the exception text when it raised, else ``None``.
    """

    index: int
    call_id: str
    tool: str
    arguments: JSONValue
    recorded: str
    output: str | None
    error: str | None = None

    @property
    def matches(self) -> bool:
        """True when the reproduced output equals the recorded one exactly."""
        return self.output == self.recorded


def assistant_replies(messages: Sequence[Mapping[str, Any]]) -> tuple[str, ...]:
    """Return the texts the assistant said to the customer, in order.

    A reply is an assistant message with text and no tool calls; the text of an assistant
    message that also calls tools is not a reply.
    """
    return tuple(
        m["content"]
        for m in messages
        if m.get("role") == "assistant" and not m.get("tool_calls") and m.get("content")
    )


STOP_MARKER = "###STOP###"
"""A customer message containing this ends the conversation."""


def conversation_completed(messages: Sequence[Mapping[str, Any]]) -> bool:
    """Whether a conversation reached its end.

    True when a customer message contains `STOP_MARKER`, or a tool message answers a
    ``transfer_to_human_agents`` call; false for a conversation cut off before either.
    """
    for m in messages:
        if m.get("role") == "user" and STOP_MARKER in (m.get("content") or ""):
            return True
        if m.get("role") == "tool" and m.get("name") in TERMINAL_TOOLS:
            return True
    return False


def apply_actions(db: AirlineDatabase, task: AirlineTask, *, key_prefix: str = "gt") -> None:
    """Apply the task's ground-truth actions to ``db``, in order.

    Args:
        db: a database (normally a fresh copy).
        task: the task.
        key_prefix: idempotency keys are ``<key_prefix>-<index>``.

    Raises:
        treadle.demo.airline.tools.AirlineToolError: when an action is not a valid call.
    """
    for i, action in enumerate(task.actions):
        run_tool(db, action.name, dict(action.kwargs), f"{key_prefix}-{i}")


def expected_data_hash(task: AirlineTask, fresh: AirlineDatabase) -> str:
    """Return the content hash of ``fresh`` after the task's ground-truth actions.

    ``fresh`` itself is not changed: the actions run on a temporary copy.

    Args:
        task: the task.
        fresh: a database as every conversation starts from.
    """
    with tempfile.TemporaryDirectory(prefix="treadle-airline-") as tmp:
        expected = fresh.copy_to(Path(tmp) / "expected.sqlite3")
        apply_actions(expected, task)
        return expected.data_hash()


def outputs_found(task: AirlineTask, replies: Sequence[str]) -> dict[str, bool]:
    """Return, for each expected output, whether some reply contains it.

    The match ignores case, and commas in the reply.
    """
    normalised = [reply.lower().replace(",", "") for reply in replies]
    return {output: any(output.lower() in reply for reply in normalised) for output in task.outputs}


def score(
    db: AirlineDatabase,
    task: AirlineTask,
    replies: Sequence[str],
    *,
    completed: bool,
    fresh: AirlineDatabase,
    expected_hash: str | None = None,
) -> Score:
    """Score a conversation.

    Args:
        db: the conversation's database after the conversation.
        task: the task it is scored against.
        replies: the assistant's replies to the customer (see `assistant_replies`).
        completed: whether the conversation reached its end (`conversation_completed`, or
            the run's own completion signal); an incomplete one scores 0.0.
        fresh: a database as the conversation started from (not changed).
        expected_hash: the ground-truth content hash when already known (e.g. cached per
            task); computed from ``fresh`` otherwise.

    Returns:
        The score with its parts.
    """
    expected = expected_hash if expected_hash is not None else expected_data_hash(task, fresh)
    actual = db.data_hash()
    found = outputs_found(task, replies)
    matches = actual == expected
    return Score(
        reward=1.0 if completed and matches and all(found.values()) else 0.0,
        completed=completed,
        data_matches=matches,
        outputs_found=found,
        data_hash=actual,
        expected_data_hash=expected,
    )


def recorded_tool_calls(
    recording: Recording,
) -> list[tuple[str, str, str, str]]:
    """Return the recording's tool calls in order as ``(call id, tool, arguments, output)``.

    ``arguments`` is the JSON text the model wrote; ``output`` is the recorded tool message
    answering the call.

    Raises:
        ValueError: when a tool message answers no earlier call.
    """
    pending: dict[str, tuple[str, str]] = {}
    calls = []
    for message in recording.messages:
        for call in message.get("tool_calls") or ():
            pending[call["id"]] = (call["function"]["name"], call["function"]["arguments"])
        if message.get("role") == "tool":
            call_id = message["tool_call_id"]
            if call_id not in pending:
                raise ValueError(f"{recording.name}: tool message answers unknown call {call_id}")
            tool, arguments = pending.pop(call_id)
            calls.append((call_id, tool, arguments, message["content"]))
    return calls


def score_recording(
    recording: Recording,
    db: AirlineDatabase,
    *,
    fresh: AirlineDatabase,
    expected_hash: str | None = None,
) -> Score:
    """Score a recorded conversation whose tool calls were replayed into ``db``.

    Completion and replies are read from the recording's messages (see `score`).
    """
    return score(
        db,
        recording.task,
        assistant_replies(recording.messages),
        completed=conversation_completed(recording.messages),
        fresh=fresh,
        expected_hash=expected_hash,
    )


def replay_tool_calls(recording: Recording, db: AirlineDatabase) -> tuple[ReplayedCall, ...]:
    """Run every recorded tool call of a recording, in order, against ``db``.

    Each call's idempotency key is ``<recording name>-<index>``. A call whose arguments are
    not JSON, or that the environment refuses to run (unknown tool, invalid arguments), is
    reported with its error and changes nothing.

    Args:
        recording: the recording.
        db: a fresh database (it is changed by the write calls).

    Returns:
        One entry per recorded call, in order.
    """
    replayed = []
    for index, (call_id, tool, raw, recorded) in enumerate(recorded_tool_calls(recording)):
        arguments: JSONValue = None
        output: str | None = None
        error: str | None = None
        try:
            arguments = json.loads(raw)
            output = run_tool(db, tool, arguments, f"{recording.name}-{index}")
        except (json.JSONDecodeError, AirlineToolError) as exc:
            error = f"{type(exc).__name__}: {exc}"
        replayed.append(
            ReplayedCall(
                index=index,
                call_id=call_id,
                tool=tool,
                arguments=arguments,
                recorded=recorded,
                output=output,
                error=error,
            )
        )
    return tuple(replayed)
