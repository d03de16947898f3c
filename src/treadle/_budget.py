"""The context budget: what of a run's history fits a model's context window (private).

Pure functions, no I/O. The context hydrator calls `plan` with the history it holds; the
plan is either a request that fits or the steps that must be summarised first
(docs/context.md, "What stays").
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, Final

import attrs

from treadle._exceptions import SeamViolation
from treadle.types import Message, ToolSpec

TokenCounter = Callable[[Sequence[Message]], int]
"""``counter(messages) -> tokens``: a user's own count of a request's messages."""

CHARS_PER_TOKEN: Final = 3.0
"""The default estimate's characters per token: low on purpose (English runs near 4), so an
uncalibrated estimate errs on the large side."""
MESSAGE_OVERHEAD: Final = 6
"""Tokens counted per message for its role and framing."""
MARK_MIN_TOKENS: Final = 64
"""An old observation is replaced by a re-fetch marker only when it is at least this large."""
SUMMARY_SHARE: Final = 4
"""A summary may take at most 1/SUMMARY_SHARE of the budget (and at most `SUMMARY_MAX`)."""
SUMMARY_MAX: Final = 2048
"""Tokens a summary may take at most."""
HEADROOM_SHARE: Final = 8
"""A compaction keeps 1/HEADROOM_SHARE of the budget free besides the summary's room, so that
a summary as long as its room leaves the next steps room to grow
(docs/decisions/0126-a-compaction-leaves-room-for-the-next-steps.md)."""
MIN_CALIBRATION, MAX_CALIBRATION = 0.25, 8.0
"""Bounds on the factor reported usage applies to the counter (a wild report is clamped)."""


_LIMITS = (
    # OpenAI and OpenAI-compatible servers (vLLM, llama.cpp ...)
    re.compile(r"maximum context length is (\d[\d,]*)", re.IGNORECASE),
    # Anthropic: "prompt is too long: 210000 tokens > 200000 maximum"
    re.compile(r"tokens? > (\d[\d,]*) maximum", re.IGNORECASE),
    re.compile(r"context (?:window|length) (?:is |of )?(\d[\d,]*) tokens", re.IGNORECASE),
)


def window_from_error(message: str) -> int | None:
    """The context window a provider's context-length error states, tokens; ``None`` if none.

    Reads the OpenAI-compatible "maximum context length is N tokens" and Anthropic's
    "N tokens > M maximum".
    """
    for pattern in _LIMITS:
        found = pattern.search(message)
        if found:
            return int(found.group(1).replace(",", ""))
    return None


def estimate_messages(messages: Sequence[Message]) -> int:
    """The default counter: characters / `CHARS_PER_TOKEN` plus `MESSAGE_OVERHEAD` each."""
    return sum(_message_tokens(m) for m in messages)


def _message_tokens(message: Message) -> int:
    chars = len(message.content or "") + len(message.reasoning or "")
    for call in message.tool_calls:
        chars += len(call.name) + len(call.id) + len(json.dumps(call.arguments))
    return MESSAGE_OVERHEAD + int(chars / CHARS_PER_TOKEN + 0.999)


def estimate_tools(tools: Sequence[ToolSpec]) -> int:
    """Tokens the declared tools take, by the default estimate."""
    chars = sum(len(t.name) + len(t.description) + len(json.dumps(t.parameters)) for t in tools)
    return int(chars / CHARS_PER_TOKEN + 0.999)


@attrs.frozen(kw_only=True)
class Group:
    """The history messages of one step: an assistant turn and the results answering it.

    A group is kept or dropped whole, so a call and its result are never split.
    """

    step: int
    messages: tuple[Message, ...]


@attrs.frozen(kw_only=True)
class Summary:
    """A durable summary of steps 1 to ``through`` (the text of a compaction's reply).

    Attributes:
        intent_id: the intent of the model call that wrote it.
        through: the last step it covers; up to 0 for a part of the history inherited from
            a thread's earlier runs (`inherited_groups`).
        text: the summary.
        run_id: the earlier run of the thread whose log holds it, when it was carried over
            from there (docs/context.md, "Threads"); ``None``: this run's own.
    """

    intent_id: str
    through: int
    text: str
    run_id: str | None = None


@attrs.frozen(kw_only=True)
class Fitted:
    """A request that fits: its messages and what the budget did (`ContextUsed` fields)."""

    messages: tuple[Message, ...]
    tokens: int
    verbatim_from: int | None
    summary: Summary | None
    marked: int = 0
    marked_from: int | None = None
    marked_to: int | None = None
    truncated: int = 0
    unfit: bool = False


@attrs.frozen(kw_only=True)
class Compact:
    """Steps after ``after`` up to ``through`` must be summarised before a request fits.

    Attributes:
        after: the last step the current summary covers (``None`` for none).
        through: the last step the new summary must cover.
        groups: the steps to summarise, whole (no markers: the summary keeps their facts).
    """

    after: int | None
    through: int
    groups: tuple[Group, ...]


@attrs.define(eq=False)
class Meter:
    """Counts tokens with the counter, scaled by the calibration factor reported usage set."""

    counter: TokenCounter = estimate_messages
    factor: float = 1.0

    def calibrate(self, counted: int, reported: int) -> None:
        """Learn from a request the counter put at ``counted`` and the provider at ``reported``."""
        if counted > 0 and reported > 0:
            self.factor = min(MAX_CALIBRATION, max(MIN_CALIBRATION, reported / counted))

    def raw(self, messages: Sequence[Message]) -> int:
        """The counter's count of ``messages``, tokens.

        Raises:
            SeamViolation: the counter returned no finite number of at least 0 (a bool, NaN,
                ``None``, text); the run is interrupted, resumable (docs/context.md,
                "The budget").
        """
        counted = self.counter(messages)
        if (
            isinstance(counted, bool)
            or not isinstance(counted, int | float)
            or not math.isfinite(counted)
            or counted < 0
        ):
            raise SeamViolation("token counter", counted, "a number of tokens (0 or more)")
        return int(counted)

    def tokens(self, messages: Sequence[Message]) -> int:
        return int(self.raw(messages) * self.factor + 0.999)


def marker(step: int, message: Message, tokens: int) -> str:
    """The re-fetch marker that replaces a large old observation (docs/context.md).

    An observation of the run's own step is named by the step (``at step 7``); one of the
    history the run continues (``step`` up to 0: a thread's earlier runs, or the steps of a
    forked run before the fork, whose numbers are another run's) as ``in the history this
    run continues``.
    """
    tool = message.name or "a tool"
    call = f" (call {message.tool_call_id})" if message.tool_call_id else ""
    where = f"at step {step}" if step > 0 else "in the history this run continues"
    return (
        f"[elided: the result of {tool}{call} {where}, about {tokens} tokens, left "
        "out to fit the context window; call the tool again if it is needed]"
    )


def with_markers(group: Group, meter: Meter) -> tuple[Group, int]:
    """``group`` with each large tool result replaced by a marker, and how many were.

    Steps up to 0 are the history inherited from the runs before it: a thread's earlier runs,
    a forked run's steps before the fork (docs/threads.md).
    """
    out: list[Message] = []
    count = 0
    for message in group.messages:
        size = meter.tokens([message])
        if message.role == "tool" and size >= MARK_MIN_TOKENS:
            text = marker(group.step, message, size)
            out.append(attrs.evolve(message, content=text, images=()))  # re-fetched too
            count += 1
        else:
            out.append(message)
    return Group(step=group.step, messages=tuple(out)), count


def summary_message(summary: Summary) -> Message:
    """The message a summary enters the request as (after the run input)."""
    covers = _covers(summary.through)
    written = "earlier in this run" if summary.run_id is None else "by an earlier run"
    return Message(
        role="user",
        content=(
            f"[Summary of {covers}, written {written}; what follows it is verbatim]\n{summary.text}"
        ),
    )


def _covers(through: int | None) -> str:
    """What a summary through step ``through`` covers, in words."""
    if through is None:
        return "nothing yet"
    if through > 0:
        return f"steps 1-{through}"
    if through == 0:
        return "the history this run continues"
    return "the first part of the history this run continues"


def summary_cap(budget: int) -> int:
    """Tokens a summary may take within ``budget``."""
    return max(64, min(SUMMARY_MAX, budget // SUMMARY_SHARE))


def plan(
    *,
    head: Sequence[Message],
    groups: Sequence[Group],
    summary: Summary | None,
    budget: int,
    fixed_tokens: int,
    meter: Meter,
    force: bool = False,
) -> Fitted | Compact:
    """Fit the history into ``budget`` tokens, in the order of docs/context.md, "What stays".

    Args:
        head: the fixed instructions and the run input (always sent).
        groups: every step's messages, oldest first; steps up to 0 hold the history
            inherited from a thread's earlier runs (`inherited_groups`), compacted like any.
        summary: the latest durable summary, or ``None``; one longer than the room a
            summary has (`summary_cap`) is cut to it (`cut_summary`) before anything is
            measured, as it is sent (docs/context.md, "Limits").
        budget: input tokens the request may use.
        fixed_tokens: tokens outside the messages (the declared tools).
        meter: the calibrated counter.
        force: the provider refused the last request for its length: summarise every step
            but the newest.

    Returns:
        `Fitted` when the history fits (markers and truncation applied as needed), else
        `Compact` naming the steps to summarise first.
    """
    after = summary.through if summary is not None else None
    live = [g for g in groups if after is None or g.step > after]
    if summary is not None:  # measured as it is sent: cut to its room when longer
        summary = cut_summary(summary, summary_cap(budget), meter)
    summary_msgs = [summary_message(summary)] if summary is not None else []
    base = fixed_tokens + meter.tokens(head)
    whole = [m for g in live for m in g.messages]
    total = base + meter.tokens([*summary_msgs, *whole])
    if not force and total <= budget:
        return _fitted(head, summary_msgs, live, summary, total)
    # Re-fetchable material goes first: large old observations become markers, oldest first.
    marked_groups, marked, steps, total = _marked(live, meter, base, summary_msgs, budget, force)
    if not force and total <= budget:
        return _fitted(head, summary_msgs, marked_groups, summary, total, marked, steps)
    # Then the summary: keep the newest steps verbatim, summarise the ones before them, and
    # leave room for the steps that follow, which a summary as long as its room takes none of.
    room = budget - base - summary_cap(budget) - budget // HEADROOM_SHARE
    keep = _newest_that_fit(marked_groups, room, meter, at_most=1 if force else None)
    # The summariser reads the steps as they were, not their markers: it keeps the facts.
    older = live[: len(live) - keep]
    if older:
        return Compact(after=after, through=older[-1].step, groups=tuple(older))
    # Only the newest steps remain and they still do not fit: truncate their observations.
    return _truncated(head, summary, marked_groups, budget, fixed_tokens, meter, marked, steps)


def _fitted(
    head: Sequence[Message],
    summary_msgs: list[Message],
    groups: Sequence[Group],
    summary: Summary | None,
    tokens: int,
    marked: int = 0,
    steps: tuple[int, int] | None = None,
    truncated: int = 0,
    unfit: bool = False,
) -> Fitted:
    return Fitted(
        messages=assemble(head, summary_msgs, groups, summary),
        tokens=tokens,
        verbatim_from=groups[0].step if groups else None,
        summary=summary,
        marked=marked,
        marked_from=steps[0] if steps else None,
        marked_to=steps[1] if steps else None,
        truncated=truncated,
        unfit=unfit,
    )


def inherited_groups(messages: Sequence[Message]) -> list[Group]:
    """A thread's inherited history as groups numbered up to 0 (the newest is step 0).

    Each message but a tool result starts a group; a tool result joins the group of the call
    it answers, so a call and its result are never split.
    """
    parts: list[list[Message]] = []
    for message in messages:
        if message.role == "tool" and parts:
            parts[-1].append(message)
        else:
            parts.append([message])
    return [Group(step=i - len(parts) + 1, messages=tuple(p)) for i, p in enumerate(parts)]


def assemble(
    head: Sequence[Message],
    summary_msgs: Sequence[Message],
    groups: Sequence[Group],
    summary: Summary | None,
) -> tuple[Message, ...]:
    """A request's messages in history order.

    The order is the instructions, then the history inherited from earlier runs of a thread
    (steps up to 0, after the summary covering their first part), then the run's input, then
    the summary of the run's own steps, then the steps sent verbatim.
    """
    cut = next((i for i, m in enumerate(head) if m.role != "system"), len(head))
    system, inputs = head[:cut], head[cut:]
    early = [m for g in groups if g.step <= 0 for m in g.messages]
    late = [m for g in groups if g.step > 0 for m in g.messages]
    if summary is not None and summary.through <= 0:
        return (*system, *summary_msgs, *early, *inputs, *late)
    return (*system, *early, *inputs, *summary_msgs, *late)


def _marked(
    groups: Sequence[Group],
    meter: Meter,
    base: int,
    summary_msgs: list[Message],
    budget: int,
    every: bool,
) -> tuple[list[Group], int, tuple[int, int] | None, int]:
    """Mark large observations, oldest step first, until the groups fit ``budget``.

    With ``every``, every group but the newest is marked. Returns the groups, the marker
    count, the step range marked and the new total.
    """
    out = list(groups)
    sizes = [meter.tokens(g.messages) for g in out]
    total = base + meter.tokens(summary_msgs) + sum(sizes)
    count = 0
    first = last = None
    for index in range(len(out) - 1):  # the newest step stays whole
        if total <= budget and not every:
            break
        changed, n = with_markers(out[index], meter)
        if not n:
            continue
        size = meter.tokens(changed.messages)
        total += size - sizes[index]
        out[index], sizes[index] = changed, size
        count += n
        first = out[index].step if first is None else first
        last = out[index].step
    steps = (first, last) if first is not None and last is not None else None
    return out, count, steps, total


def _newest_that_fit(
    groups: Sequence[Group], room: int, meter: Meter, *, at_most: int | None
) -> int:
    """How many of the newest groups fit ``room`` tokens (at least one: the newest stays)."""
    used = 0
    kept = 0
    for group in reversed(groups):
        size = meter.tokens(group.messages)
        if kept and (used + size > room or (at_most is not None and kept >= at_most)):
            break
        used += size
        kept += 1
    return kept


def _truncated(
    head: Sequence[Message],
    summary: Summary | None,
    groups: Sequence[Group],
    budget: int,
    fixed_tokens: int,
    meter: Meter,
    marked: int,
    steps: tuple[int, int] | None,
) -> Fitted:
    """The newest groups with their largest observations cut until the request fits."""
    room = budget - fixed_tokens - meter.tokens(head)
    summary_msgs: list[Message] = []
    if summary is not None:
        summary_msgs = [summary_message(cut_summary(summary, summary_cap(max(room, 0)), meter))]
    room -= meter.tokens(summary_msgs)
    messages = [m for g in groups for m in g.messages]
    truncated = 0
    while meter.tokens(messages) > room:
        index = _largest_observation(messages)
        if index is None:
            break
        cut = _cut_to_fit(messages, index, room, meter)
        if cut.content == messages[index].content:
            break
        messages[index] = cut
        truncated += 1
    regrouped: list[Group] = []
    at = 0
    for group in groups:  # the same groups, with their cut messages
        regrouped.append(
            Group(step=group.step, messages=tuple(messages[at : at + len(group.messages)]))
        )
        at += len(group.messages)
    tokens = fixed_tokens + meter.tokens([*head, *summary_msgs, *messages])
    return _fitted(
        head,
        summary_msgs,
        regrouped,
        summary,
        tokens,
        marked,
        steps,
        truncated=truncated,
        unfit=tokens > budget,
    )


def _cut_to_fit(messages: Sequence[Message], index: int, room: int, meter: Meter) -> Message:
    """``messages[index]`` cut to the longest head with which ``messages`` fit ``room`` tokens.

    The cut is `fit_text`'s, with the re-fetch hint as its marker, and each one tried is
    measured with ``meter``: the counter in use, calibrated, whatever characters it puts in
    a token (docs/context.md, "Truncation"). When not even an empty observation lets
    ``messages`` fit, the observation is cut to nothing, and the next largest is cut next.
    """
    message = messages[index]
    before, after = messages[:index], messages[index + 1 :]

    def fits(text: str) -> bool:
        return meter.tokens([*before, attrs.evolve(message, content=text), *after]) <= room

    text = _longest_cut(message.content or "", _cut_marker(message), fits)
    return attrs.evolve(message, content=text)


def cut_summary(summary: Summary, tokens: int, meter: Meter) -> Summary:
    """``summary`` with its text cut so that ``meter`` puts it, as a message, at ``tokens``.

    A summary longer than the room a summary has (`summary_cap`; a summariser may ignore
    its output cap) is cut like an observation (`fit_text`), with the marker "[summary cut
    to fit]", in the step's request and in the summariser's next request alike
    (docs/context.md, "Limits"). The log keeps it whole.
    """

    def fits(text: str) -> bool:
        return meter.tokens([Message(role="user", content=text)]) <= tokens

    text = _longest_cut(summary.text, "[summary cut to fit]", fits)
    return summary if text == summary.text else attrs.evolve(summary, text=text)


def _longest_cut(text: str, mark: str, fits: Callable[[str], bool]) -> str:
    """``text`` itself when it ``fits``, else its longest cut that does; ``""`` when none does.

    A cut is `fit_text`'s with ``mark``. The search is a binary one over the cut's length in
    characters, so ``fits`` (a count by the counter in use) is asked about 1 + log2(len(text))
    cuts: no fixed ratio of characters to tokens is assumed.
    """
    if fits(text):
        return text
    low, high = 0, len(text) - 1
    while low < high:  # the longest cut that fits, or 0 characters
        middle = (low + high + 1) // 2
        if fits(fit_text(text, middle, mark)):
            low = middle
        else:
            high = middle - 1
    return fit_text(text, low, mark)


def _largest_observation(messages: Sequence[Message]) -> int | None:
    """The index of the longest tool result or user message (an observation), if any."""
    best: tuple[int, int] | None = None
    for index, message in enumerate(messages):
        if message.role != "tool" and message.role != "user":
            continue
        size = len(message.content or "")
        if size and (best is None or size > best[0]):
            best = (size, index)
    return best[1] if best is not None else None


def _cut_marker(message: Message) -> str:
    tool = message.name or "the tool"
    return f"[cut to fit the context window; call {tool} again for the rest]"


def fit_text(text: str, max_chars: int, mark: str) -> str:
    """``text`` cut to at most ``max_chars`` characters, ``mark`` included (docs/context.md).

    The cut never falls inside a character (a string is cut by code points, and a
    surrogate pair is never split) nor inside a JSON value: text that is a JSON array or
    object keeps its first whole elements and stays valid JSON, followed by the marker on
    its own line. Room for the marker is reserved first; when not even the marker fits,
    the marker alone is cut. ``text`` that fits is returned unchanged.
    """
    if len(text) <= max_chars:
        return text
    room = max_chars - len(mark) - 1
    if room <= 0:
        return mark[: max(0, max_chars)]
    head = _json_prefix(text, room)
    if head is None:
        head = text[:room]
        if head and "\ud800" <= head[-1] <= "\udbff":  # never split a surrogate pair
            head = head[:-1]
        cut = head.rfind("\n")
        if cut >= room // 2:  # prefer a line boundary when one is near
            head = head[:cut]
    return f"{head}\n{mark}"


_DECODER: Final = json.JSONDecoder()


def _json_prefix(text: str, room: int) -> str | None:
    """A valid JSON text of the head of ``text`` within ``room`` chars (`_cut_value`)."""
    stripped = text.strip()
    if not stripped or stripped[0] not in "[{":
        return None
    try:
        # The leading value: text after it (the marker of an earlier cut, such as
        # `Limits.max_observation_chars`'s) gives way to this cut's marker.
        value, end = _DECODER.raw_decode(stripped)
        rest = stripped[end:].strip()
        if rest and not (rest.startswith("[") and rest.endswith("]") and "\n" not in rest):
            return None  # more than a marker after it: the text is not one JSON value
        if isinstance(value, list | dict):
            return _cut_value(value, room) or ("[]" if isinstance(value, list) else "{}")
    except (ValueError, RecursionError):  # not JSON, or too deep to follow: cut as text
        return None
    return None


def _dumped(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def _cut_value(value: Any, room: int) -> str | None:
    """The JSON text of the head of ``value`` within ``room`` chars; ``None`` if none fits.

    An array or object keeps its whole leading elements; when not even its first element
    fits whole, it keeps the head of that one (an array, object or string cut the same way,
    within the room left), so a large first element does not leave an empty ``[]`` or ``{}``.
    Every value shown but the last one's innermost head is whole. A number, boolean or null
    fits whole or not at all. Each level reads about ``room`` characters of its value
    (`_fitting`), never the whole of a large one.
    """
    whole = _fitting(value, room)
    if whole is not None:
        return whole
    if isinstance(value, str):
        return _cut_string(value, room)
    if not isinstance(value, list | dict) or room < 2:
        return None
    opening, closing = _brackets(value)
    return opening + ", ".join(_leading(_elements(value), room - 2)) + closing


def _fitting(value: Any, room: int) -> str | None:
    """``value``'s JSON text when it fits ``room`` chars, else ``None``.

    It stops as soon as the text outgrows the room: a large value costs about ``room``
    characters of work, not its size.
    """
    if isinstance(value, str):
        if len(value) + 2 > room:
            return None
    elif isinstance(value, list | dict):
        return _fitting_elements(value, room)
    text = _dumped(value)
    return text if len(text) <= room else None


def _elements(value: list[Any] | dict[str, Any]) -> Iterator[tuple[Any, str]]:
    """``(element, what precedes it in the JSON text)``: an object's ``"key": ``."""
    if isinstance(value, list):
        return ((item, "") for item in value)
    return ((item, f"{_dumped(key)}: ") for key, item in value.items())


def _brackets(value: list[Any] | dict[str, Any]) -> tuple[str, str]:
    return ("[", "]") if isinstance(value, list) else ("{", "}")


def _fitting_elements(value: list[Any] | dict[str, Any], room: int) -> str | None:
    if room < 2:  # not even the brackets
        return None
    kept, left = _whole_leading(_elements(value), room - 2)
    if left is not None:
        return None
    opening, closing = _brackets(value)
    return opening + ", ".join(kept) + closing


def _leading(items: Iterable[tuple[Any, str]], room: int) -> list[str]:
    """The leading elements whose join with ``", "`` fits ``room`` chars, or the first's head.

    ``items``: ``(the element's value, what precedes it in the text: an object's key)``.
    """
    kept, left = _whole_leading(items, room)
    if left is not None and not kept:
        value, label = left
        head = _cut_value(value, room - len(label))
        if head is not None:
            kept.append(label + head)
    return kept


def _whole_leading(
    items: Iterable[tuple[Any, str]], room: int
) -> tuple[list[str], tuple[Any, str] | None]:
    """The leading ``items`` that fit ``room`` chars whole, and the first that does not.

    Returns:
        The texts kept (their join with ``", "`` fits), and the first item left out
        (``None`` when every item fits).
    """
    kept: list[str] = []
    used = 0
    for value, label in items:
        gap = 2 if kept else 0
        part = _fitting(value, room - used - gap - len(label))
        if part is None:
            return kept, (value, label)
        kept.append(label + part)
        used += gap + len(label) + len(part)
    return kept, None


def _cut_string(value: str, room: int) -> str | None:
    """The JSON string of the longest head of ``value`` within ``room`` chars.

    Escapes count; a surrogate pair is never split; ``None`` if not even ``""`` fits.
    """
    low, high = 0, min(len(value), room)
    while low < high:  # the longest head whose JSON text fits
        middle = (low + high + 1) // 2
        if len(_dumped(value[:middle])) <= room:
            low = middle
        else:
            high = middle - 1
    if low and "\ud800" <= value[low - 1] <= "\udbff":
        low -= 1
    head = _dumped(value[:low])
    return head if len(head) <= room else None


DEFAULT_SUMMARY_PROMPT: Final = """\
You are compacting the history of an agent run so that it can go on within its context \
window. The earlier summary (if any) and the steps below will be replaced by what you write, \
so keep everything the agent still needs and nothing else. Write plain text with these \
sections, each line citing the step it comes from as (step N):

Goal and acceptance criteria: what the user asked for and how success is judged.
Constraints: every explicit constraint or preference the user stated, word for word \
where short.
Decisions: approvals, rejections and edits by a human reviewer, and choices the agent \
committed to.
Facts: what the tools returned that later steps may rely on (names, numbers, ids, paths, \
results of checks); prefer the newest value when one changed.
Open questions: what is still unknown, failing or pending.

Carry over every line of the earlier summary that still holds, with its step. Do not \
invent facts, do not answer the task, and do not call tools."""
"""The default summariser prompt (docs/context.md, "Summaries")."""


def transcript(groups: Sequence[Group]) -> str:
    """The steps as plain text for the summariser, one block per step."""
    blocks: list[str] = []
    for group in groups:
        title = f"Step {group.step}" if group.step > 0 else "From the history this run continues"
        lines = [f"## {title}"]
        for message in group.messages:
            if message.role == "assistant":
                if message.content:
                    lines.append(f"assistant: {message.content}")
                for call in message.tool_calls:
                    arguments = json.dumps(call.arguments, ensure_ascii=False)
                    lines.append(f"assistant called {call.name}({arguments}) [call {call.id}]")
            elif message.role == "tool":
                lines.append(f"result of {message.name} [call {message.tool_call_id}]: ")
                lines[-1] += message.content or ""
            else:
                lines.append(f"{message.role}: {message.content or ''}")
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks)


STEPS_CUT_MARK: Final = "[later steps left out of this summary]"
"""The marker after the steps' text of a summariser request that had to be cut."""
MIN_STEPS_CHARS: Final = 256
"""Characters of the steps' text a summariser request keeps however little room it has."""


def summary_messages(
    *,
    prompt: str,
    head: Sequence[Message],
    previous: Summary | None,
    groups: Sequence[Group],
    max_chars: int,
) -> tuple[Message, ...]:
    """The summariser's request: its prompt, the run's goal, the earlier summary, the steps.

    The steps' text is cut to ``max_chars`` (never inside a character or a JSON value).
    """
    steps = fit_text(transcript(groups), max_chars, STEPS_CUT_MARK)
    return _summary_request(prompt, head, previous, steps)


def summary_request(
    *,
    prompt: str,
    head: Sequence[Message],
    previous: Summary | None,
    groups: Sequence[Group],
    tokens: int,
    meter: Meter,
) -> tuple[tuple[Message, ...], int]:
    """The summariser's request for the oldest of ``groups`` that fit, and how many it covers.

    It holds whole steps, oldest first, as many as let ``meter`` (the counter in use,
    calibrated) put the whole request at ``tokens`` or fewer, and at least the oldest: one
    too large alone has its text cut to fit, to no fewer than `MIN_STEPS_CHARS` characters
    (docs/context.md, "Summaries"). Each count is of a request as it would be sent, so no
    fixed ratio of characters to tokens is assumed.

    Returns:
        ``(messages, count)``: the request's messages and the number of leading ``groups``
        they cover (1 or more; ``groups`` is not empty).
    """

    def fits(steps: str) -> bool:
        return meter.tokens(_summary_request(prompt, head, previous, steps)) <= tokens

    count = _most_that_fit(len(groups), lambda n: fits(transcript(groups[:n])))
    steps = transcript(groups[:count])
    if count == 1 and not fits(steps):
        steps = _longest_cut(steps, STEPS_CUT_MARK, fits)
        if len(steps) < MIN_STEPS_CHARS:  # the floor, however little room there is
            steps = fit_text(transcript(groups[:1]), MIN_STEPS_CHARS, STEPS_CUT_MARK)
    return _summary_request(prompt, head, previous, steps), count


def _most_that_fit(total: int, fits: Callable[[int], bool]) -> int:
    """The largest ``n`` of 1 to ``total`` that ``fits``; 1 when none does.

    ``fits`` is called about 2 x log2(n) times (doubling, then halving), so a long history
    costs counts of about the size that fits, not of the whole.
    """
    low, step = 1, 1
    while low < total and fits(min(low + step, total)):
        low = min(low + step, total)
        step *= 2
    high = min(low + step, total) - 1 if low < total else low  # low + step does not fit
    while low < high:
        middle = (low + high + 1) // 2
        if fits(middle):
            low = middle
        else:
            high = middle - 1
    return low


def _summary_request(
    prompt: str, head: Sequence[Message], previous: Summary | None, steps: str
) -> tuple[Message, ...]:
    """The summariser's messages around ``steps``, the steps' text as it is sent."""
    goal = "\n".join(m.content or "" for m in head if m.role != "system")
    earlier = previous.text if previous is not None else "(none)"
    covered = _covers(previous.through if previous is not None else None)
    text = (
        f"# The run's input\n{goal}\n\n# Earlier summary (of {covered})\n{earlier}\n\n"
        f"# Steps to summarise\n{steps}"
    )
    return (Message(role="system", content=prompt), Message(role="user", content=text))
