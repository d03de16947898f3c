"""What a seam's answer must look like, checked where it enters a run.

A model client's `ModelReply`, usage reports and `ModelCallError` usage and an action executor's
`ActionOutcome` are checked by the actors that receive them (a breach is a
`treadle.SeamViolation`: the run is interrupted and left resumable) and by the contract suites
in `treadle.testing.seams`, with the same rules (docs/seams.md). Each function returns why the
value breaks its contract, or ``None``.

What the checks catch would otherwise surface later and elsewhere: a negative token count that
unbinds the token budget, a string ``task_completed`` that ends a run as succeeded, arguments
a durable store cannot encode although the memory store keeps them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final

import attrs

from treadle.types import ActionOutcome, ActionStatus, ImageRef, ModelReply, ToolCall, Usage

_MAX_DEPTH: Final = 80
"""Levels of arguments walked for their types; deeper ones are the parser's to refuse
(`treadle.parsers.MAX_ARGUMENT_DEPTH`, 64), and a value that holds itself stops here."""

_TEXT_FIELDS: Final = (
    "text",
    "reasoning",
    "reasoning_signature",
    "finish_reason",
    "response_id",
    "refusal",
    "provider_finish_reason",
)


def usage_problem(usage: object) -> str | None:
    """Why ``usage`` is no `Usage` of token counts (each ``None`` or an int >= 0), or ``None``."""
    if not isinstance(usage, Usage):
        return f"usage must be a Usage record, not {type(usage).__name__}"
    for field in attrs.fields(Usage):  # every field of Usage is a count of tokens
        count = getattr(usage, field.name)
        if count is None:
            continue
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            return f"usage.{field.name} must be None or a count of tokens >= 0, not {count!r}"
    return None


def reply_problem(reply: object) -> str | None:
    """Why ``reply`` breaks the model client's contract (docs/seams.md), or ``None``.

    Text fields are ``str`` or ``None``; tool calls are `ToolCall` records with a non-empty
    id, a name and an object of JSON values as arguments; usage is `usage_problem`'s.
    """
    if not isinstance(reply, ModelReply):
        return f"complete returned {type(reply).__name__}, not a ModelReply"
    for name in _TEXT_FIELDS:
        value = getattr(reply, name)
        if value is not None and not isinstance(value, str):
            return f"reply.{name} must be text or None, not {type(value).__name__}"
    if not isinstance(reply.tool_calls, tuple):
        return f"reply.tool_calls must be a tuple, not {type(reply.tool_calls).__name__}"
    for call in reply.tool_calls:
        problem = _call_problem(call)
        if problem is not None:
            return problem
    return usage_problem(reply.usage)


def outcome_problem(outcome: object, method: str = "execute") -> str | None:
    """Why ``outcome`` breaks the action executor's contract (docs/seams.md), or ``None``.

    ``method`` names what returned it (``execute``, ``reconcile``). (The contract suite adds
    that a fresh call is never ``UNKNOWN``: at run time a call abandoned while it still ran
    is.)
    """
    if not isinstance(outcome, ActionOutcome):
        return f"{method} returned {type(outcome).__name__}, not an ActionOutcome"
    if not isinstance(outcome.status, ActionStatus):
        return f"status must be an ActionStatus, not {outcome.status!r}"
    if not isinstance(outcome.observation, str):
        return f"observation must be text, not {type(outcome.observation).__name__}"
    if not isinstance(outcome.task_completed, bool):
        return f"task_completed must be a bool, not {outcome.task_completed!r}"
    truncated = outcome.observation_truncated_chars
    if isinstance(truncated, bool) or not isinstance(truncated, int) or truncated < 0:
        return f"observation_truncated_chars must be an int >= 0, not {truncated!r}"
    if not isinstance(outcome.images, tuple):
        return "images must be a tuple of ImageRef"
    for image in outcome.images:
        problem = image_problem(image)
        if problem is not None:
            return problem
    unknown = outcome.unknown_usage_attempts
    if isinstance(unknown, bool) or not isinstance(unknown, int) or unknown < 0:
        return f"unknown_usage_attempts must be an int >= 0, not {unknown!r}"
    if outcome.usage is not None:
        return usage_problem(outcome.usage)
    return None


def image_problem(image: object) -> str | None:
    """Why ``image`` is no image reference the log may keep, or ``None``.

    An `ImageRef` whose ``url`` is an ``http(s)`` URL or a ``ref:<name>`` key: never the
    bytes themselves (a ``data:`` URL), nor a local path (docs/concepts.md, "Data that
    stays in"; docs/models.md, "Images").
    """
    if not isinstance(image, ImageRef):
        return f"an image must be an ImageRef reference, never bytes; got {image!r:.80}"
    url = image.url
    if not isinstance(url, str):
        return f"an image's url must be text, not {type(url).__name__}"
    if not url.lower().startswith(("http://", "https://", "ref:")):
        return f"an image's url must be an http(s) URL or a ref:<name> key, not {url!r:.60}"
    return None


def _call_problem(call: object) -> str | None:
    if not isinstance(call, ToolCall):
        return f"a tool call must be a ToolCall, not {type(call).__name__}"
    if not isinstance(call.id, str) or not call.id:
        return f"every tool call needs an id (text), not {call.id!r}"
    if not isinstance(call.name, str):
        return f"a tool call's name must be text, not {call.name!r}"
    if not isinstance(call.arguments, Mapping):
        return f"tool call arguments must be an object, not {type(call.arguments).__name__}"
    problem = _json_problem(call.arguments)
    return None if problem is None else f"tool call {call.name!r}: arguments {problem}"


def _json_problem(value: object) -> str | None:
    """Why ``value`` holds what JSON has no form for (walked level by level), or ``None``."""
    level: list[object] = [value]
    depth = 0
    while level and depth < _MAX_DEPTH:
        below: list[object] = []
        for item in level:
            if isinstance(item, Mapping):
                for key, inner in item.items():
                    if not isinstance(key, str):
                        return f"hold a key that is no text: {key!r}"
                    below.append(inner)
            elif isinstance(item, list | tuple):
                below.extend(item)
            elif item is not None and not isinstance(item, str | int | float):
                return f"hold a {type(item).__name__}, which JSON has no form for"
        level = below
        depth += 1
    return None
