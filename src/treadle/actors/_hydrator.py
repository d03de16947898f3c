"""The context hydrator: builds each model request from the log (docs/concepts.md, "Actors").

It keeps the history incrementally: the run input once, then per step record the assistant
message and the observations exactly as they entered history. It writes nothing; resume feeds
it the stored records and gets the same requests (history is read, never recomputed).

Every tool call of an assistant message in a request is answered by a tool message before the
next other message, whatever the log holds (providers refuse a request that leaves one
unanswered). A call the log gives no observation for (a step cut by a cancel whose cancel
record a crash lost, a run input ending on a tool call) is answered with the definition's
synthetic ``unknown`` observation (docs/crash-safety.md, "Resume").

A run that continues a thread or forks a run (its run-started record names the run it
``continues``) starts from that run's recorded history: the hydrator reads it from the store
when it starts (`recorded_history`, the one place a predecessor's history is loaded), and it
is then simply part of the history it holds (docs/threads.md, "How history is inherited").

With a context window, every request is fitted into it (docs/context.md, "What stays"): when
older steps must go, the hydrator answers with a `Compaction` (a summariser request) instead
of the step's request; the coordinator has the gateway make that call durably and hands the
summary back. The hydrator still writes nothing.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Final

import attrs
import trio

from treadle._budget import (
    CHARS_PER_TOKEN,
    DEFAULT_SUMMARY_PROMPT,
    Compact,
    Fitted,
    Group,
    Meter,
    Summary,
    TokenCounter,
    cut_summary,
    estimate_messages,
    estimate_tools,
    inherited_groups,
    plan,
    summary_cap,
    summary_message,
    summary_messages,
    transcript,
)
from treadle._exceptions import StoreError, UsageError
from treadle.actors._mailbox import MailboxReceiver
from treadle.actors._messages import Compaction, Hydrate
from treadle.actors._rpc import reply
from treadle.ports import RunStore
from treadle.types import (
    ContextUsed,
    DecisionKind,
    JSONValue,
    Message,
    ModelRequest,
    ModelResult,
    OutputFormat,
    RunLog,
    RunStarted,
    StepRecord,
    SyntheticObservations,
    ToolCall,
    ToolSpec,
)

_SYNTHETIC = SyntheticObservations()


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
        context_window: the model's context window, tokens; ``None`` sends the whole
            history (docs/context.md).
        margin_tokens: tokens kept free besides the output cap.
        token_counter: counts a request's messages in tokens; ``None`` for the default
            estimate (characters / 3), calibrated either way from reported usage.
        summary_prompt: the summariser's system prompt.
        summary_model: the model name of summariser requests; ``None`` for ``model``.
        store: the run's store, read (never written) for the history of the run
            ``started.continues`` names; ``None`` for a hydrator that reads no store, which
            refuses such a run.
    """

    started: RunStarted
    system_prompt: str | None
    tools: tuple[ToolSpec, ...]
    model: str
    max_output_tokens: int | None
    params: Mapping[str, JSONValue]
    synthetic: SyntheticObservations = SyntheticObservations()
    output: OutputFormat | None = None
    context_window: int | None = None
    margin_tokens: int = 0
    token_counter: TokenCounter | None = None
    summary_prompt: str = DEFAULT_SUMMARY_PROMPT
    summary_model: str | None = None
    store: RunStore | None = None
    _history: tuple[Message, ...] = ()
    """The history so far; a tuple, so that a request without a window carries it as it is
    instead of a copy (one array of it a run, not two: docs/performance.md, "Memory")."""
    _groups: list[Group] = attrs.Factory(list)
    """The history's steps, one group each, for fitting it to the context window; kept only
    when there is a window (a run's memory, docs/performance.md, "Memory")."""
    _head: tuple[Message, ...] = ()
    _carried: Summary | None = None
    """The summary an earlier run of the thread left, mapped onto the inherited history
    (docs/context.md, "Threads"); used until the run writes one of its own."""
    _meter: Meter = attrs.Factory(Meter)
    _last: tuple[tuple[Message, ...], int] | None = None
    _last_tokens: int | None = None
    _ceiling: int | None = None

    def __attrs_post_init__(self) -> None:
        system = (
            ()
            if self.system_prompt is None
            else (Message(role="system", content=self.system_prompt),)
        )
        self._history = self._head = (
            *system,
            *answer_every_call(self.started.input, self.synthetic),
        )
        self._meter = Meter(counter=self.token_counter or estimate_messages)

    @property
    def budget(self) -> int | None:
        """Input tokens a request may use: the window less the output cap and the margin."""
        if self.context_window is None:
            return None
        return self.context_window - (self.max_output_tokens or 0) - self.margin_tokens

    @trio.lowlevel.enable_ki_protection  # Ctrl-C reaches the main task: decision 0097
    async def run(
        self,
        inbox: MailboxReceiver[Hydrate],
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Load the inherited history (`inherit`), then serve `Hydrate` requests.

        It serves until ``inbox`` ends.

        Raises:
            StoreError: as `inherit`; the run stops unfinished and resumable.
        """
        await self.inherit()
        task_status.started()
        async with inbox:
            async for message in inbox:
                reply(message.reply_to, self.answer(message))

    async def inherit(self) -> None:
        """Put the recorded history of the run ``started.continues`` names before the input.

        It goes after the system prompt and before the run's own input, as messages of the
        history like any other. A run that continues nothing inherits nothing.

        Raises:
            StoreError: that history cannot be read (a missing or damaged log, a thread's
                predecessor that is not finished, a fork's run without the steps it forks
                at), or this hydrator has no store (docs/threads.md, "When a thread cannot
                go on").
        """
        started = self.started
        if started.continues is None:
            return
        if self.store is None:
            raise StoreError(
                f"run {started.run_id!r} continues run {started.continues!r}, but its "
                "hydrator was given no store to read that history from"
            )
        inherited, carried = await inherited_context(
            self.store,
            started.continues,
            before_step=started.fork_step,
            synthetic=self.synthetic,
            successor=started.run_id,
            summaries=self.context_window is not None,
        )
        at = 1 if self.system_prompt is not None else 0
        self._history = (*self._history[:at], *inherited, *self._history[at:])
        # the budget compacts it like the run's own steps (docs/context.md, "What stays")
        if self.context_window is not None:
            self._groups[0:0] = inherited_groups(inherited)
            self._carried = carried

    def build(self, new_steps: Sequence[StepRecord]) -> ModelRequest:
        """Add ``new_steps`` to the history and return the next request (no window)."""
        self._add(new_steps)
        return self._request(self._history)

    def answer(self, message: Hydrate) -> ModelRequest | Compaction:
        """The next request, fitted to the window; or the summary it needs first.

        Without a context window this is `build`. With one, see docs/context.md, "What stays".
        """
        if self.context_window is None:
            return self.build(message.new_steps)
        self._add(message.new_steps)
        if message.force:
            self._lower_ceiling(message)
        budget = min(self.budget or 0, self._ceiling or (self.budget or 0))
        head = self._head
        if message.calibration is not None:
            self._meter.calibrate(*message.calibration)
        fixed = int(estimate_tools(self.tools) * self._meter.factor + 0.999)
        fit = functools.partial(
            plan,
            head=head,
            groups=self._groups,
            budget=budget,
            fixed_tokens=fixed,
            meter=self._meter,
            force=message.force,
        )
        summary = message.summary
        fitted = fit(summary=summary)
        carried = self._carried
        if isinstance(fitted, Compact) and summary is None and self._fits(carried, budget):
            # The thread's history does not fit whole: it starts from the summary an
            # earlier run wrote instead of summarising that history all over again.
            summary = carried
            fitted = fit(summary=summary)
        if isinstance(fitted, Compact):
            return self._compaction(head, summary, fitted, budget, message.force)
        return self._fitted(fitted, message, budget)

    def _fits(self, carried: Summary | None, budget: int) -> bool:
        """Whether ``carried`` fits the room a summary has in ``budget`` (`summary_cap`).

        A summary an earlier run wrote under a larger window may not: this run then
        summarises the inherited history itself (docs/context.md, "Threads").
        """
        if carried is None:
            return False
        return self._meter.tokens([summary_message(carried)]) <= summary_cap(budget)

    def _lower_ceiling(self, message: Hydrate) -> None:
        """Learn, for the rest of the run, that the provider's real budget is lower.

        The lower of the window its error stated (less the output cap and the margin) and
        nine tenths of the refused request's size, whichever is known (docs/context.md,
        "Context-length errors").
        """
        ceiling: int | None = None
        if message.refused_window is not None:
            ceiling = message.refused_window - (self.max_output_tokens or 0) - self.margin_tokens
        refused = message.refused_tokens or self._last_tokens
        if refused is not None:
            ceiling = min(ceiling or refused, refused * 9 // 10)
        if ceiling is None:
            ceiling = (self.budget or 0) * 9 // 10
        self._ceiling = max(1, min(self._ceiling or ceiling, ceiling))

    def _add(self, new_steps: Sequence[StepRecord]) -> None:
        added: list[Message] = []
        for step in new_steps:
            messages = answer_every_call(step_messages(step), self.synthetic)
            added.extend(messages)
            if messages and self.context_window is not None:
                self._groups.append(Group(step=step.step, messages=tuple(messages)))
        if added:  # one new tuple for all of them: a resume adds a thousand steps at once
            self._history += tuple(added)

    def _request(
        self, messages: tuple[Message, ...], context: ContextUsed | None = None
    ) -> ModelRequest:
        return ModelRequest(
            messages=messages,
            tools=self.tools,
            model=self.model,
            max_output_tokens=self.max_output_tokens,
            params=self.params,
            output=self.output,
            context=context,
        )

    def _fitted(self, fitted: Fitted, message: Hydrate, budget: int) -> ModelRequest:
        counted = self._meter.raw(fitted.messages) + estimate_tools(self.tools)
        estimate = fitted.tokens
        if self._last is not None and message.calibration is not None:
            sent, last_counted = self._last
            # The previous request's reported size is exact for its prefix: only what
            # follows it is estimated.
            if last_counted == message.calibration[0] and fitted.messages[: len(sent)] == sent:
                rest = self._meter.tokens(fitted.messages[len(sent) :])
                estimate = message.calibration[1] + rest
        self._last = (fitted.messages, counted)
        self._last_tokens = None if message.force else estimate
        summary = fitted.summary
        context = ContextUsed(
            window=self.context_window or 0,
            budget=budget,
            estimated_input_tokens=estimate,
            counted_tokens=counted,
            verbatim_from=fitted.verbatim_from,
            summary_intent_id=summary.intent_id if summary is not None else None,
            summary_through=summary.through if summary is not None else None,
            summary_run_id=summary.run_id if summary is not None else None,
            marked=fitted.marked,
            marked_from=fitted.marked_from,
            marked_to=fitted.marked_to,
            truncated=fitted.truncated,
            forced=message.force,
            unfit=fitted.unfit,
        )
        return self._request(fitted.messages, context)

    def _compaction(
        self,
        head: tuple[Message, ...],
        previous: Summary | None,
        compact: Compact,
        budget: int,
        forced: bool,
    ) -> Compaction:
        """The summariser request for the oldest steps of ``compact`` that fit the window."""
        cap = summary_cap(budget)
        framing = [Message(role="system", content=self.summary_prompt), *head]
        prompt_room = budget - cap - self._meter.tokens(framing) - MESSAGE_ROOM
        if previous is not None:  # one that ignored its output cap is cut to it
            previous = cut_summary(previous, cap, self._meter)
            prompt_room -= self._meter.tokens([Message(role="user", content=previous.text)])
        # Steps enter the summariser's request as text: whole steps, oldest first, while
        # their text fits (only a single step too large for it alone is cut).
        max_chars = max(256, int(prompt_room * CHARS_PER_TOKEN / max(self._meter.factor, 0.25)))
        chosen: list[Group] = []
        used = 0
        for group in compact.groups:
            size = len(transcript([group])) + 2
            if chosen and used + size > max_chars:
                break
            chosen.append(group)
            used += size
        messages = summary_messages(
            prompt=self.summary_prompt,
            head=head,
            previous=previous,
            groups=chosen,
            max_chars=max_chars,
        )
        tokens = self._meter.tokens(messages)
        context = ContextUsed(
            window=self.context_window or 0,
            budget=budget,
            estimated_input_tokens=tokens,
            counted_tokens=self._meter.raw(messages),
            verbatim_from=chosen[0].step,
            summary_intent_id=previous.intent_id if previous is not None else None,
            summary_through=previous.through if previous is not None else None,
            summary_run_id=previous.run_id if previous is not None else None,
            forced=forced,
            unfit=tokens + cap > budget,
        )
        request = ModelRequest(
            messages=messages,
            model=self.summary_model or self.model,
            max_output_tokens=cap,
            context=context,
        )
        self._last_tokens = tokens
        return Compaction(request=request, through=chosen[-1].step)


MESSAGE_ROOM = 64
"""Tokens reserved for the summariser request's framing (headings, the prompt's overhead)."""


def step_messages(step: StepRecord) -> list[Message]:
    """The history messages one step contributes, as stored in its step record.

    An action answering a native tool call becomes a ``tool`` message; an action without a
    call id (a text reply treated as an action) becomes a ``user`` message. Either carries
    the images the action returned (``observation_images``; docs/models.md, "Images returned
    by tools"). An invalid decision
    answers every call of the sanitised assistant message with the feedback, or else becomes a
    ``user`` message, and a final answer given by calling the final-answer tool is answered by
    `FINAL_ANSWER_ACCEPTED`, so every tool-call id is always answered.
    """
    if step.decision is None or step.history_message is None:
        return []
    calls = step.history_message.tool_calls
    # An assistant turn with neither text nor calls is refused by providers: leave it out
    # and let the feedback speak for it.
    empty = not step.history_message.content and not calls
    messages = [] if empty else [step.history_message]
    if step.decision is DecisionKind.ACTIONS:
        images = step.observation_images or ((),) * len(step.observations)
        if calls:
            for call, observation, shown in zip(calls, step.observations, images, strict=False):
                messages.append(
                    Message(
                        role="tool",
                        content=observation,
                        images=shown,
                        tool_call_id=call.id,
                        name=call.name,
                    )
                )
        else:
            messages.extend(
                Message(role="user", content=o, images=shown)
                for o, shown in zip(step.observations, images, strict=False)
            )
    elif step.decision is DecisionKind.INVALID:
        feedback = step.feedback or ""
        if calls:
            messages.extend(
                Message(role="tool", content=feedback, tool_call_id=c.id, name=c.name)
                for c in calls
            )
        else:
            messages.append(Message(role="user", content=feedback))
    elif step.decision is DecisionKind.FINAL_ANSWER:
        messages.extend(
            Message(role="tool", content=FINAL_ANSWER_ACCEPTED, tool_call_id=c.id, name=c.name)
            for c in calls
        )
    return messages


FINAL_ANSWER_ACCEPTED: Final = "Accepted: this is the run's final answer."
"""What answers the final-answer tool call of a run's last step in the history a thread's
next run inherits (docs/structured-output.md, "Native or a final-answer tool"): the call never
reaches the executor, and without an answer it would read as a call whose outcome is unknown."""


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


async def recorded_history(
    store: RunStore,
    run_id: str,
    *,
    before_step: int | None = None,
    synthetic: SyntheticObservations = _SYNTHETIC,
    successor: str | None = None,
) -> list[Message]:
    """The history run ``run_id`` holds, read from its log and those of the runs it continues.

    The one place a run's history is loaded from a store (docs/threads.md, "How history is
    inherited"): for each run of the chain, oldest first, what it inherited, its input, then
    what each step record says entered history (`step_messages`), every tool call answered
    (`answer_every_call`). Nothing is recomputed. The system prompt is not part of it (it
    belongs to the agent definition).

    Args:
        store: the store holding the runs.
        run_id: the run.
        before_step: keep only the steps before this one (a fork's prefix); ``None``: all.
        synthetic: the texts answering a call the log gives no observation for.
        successor: the run that continues ``run_id``, named in errors; ``None`` when the
            history is asked for by itself.

    Returns:
        The messages, oldest first (``role`` user, assistant or tool).

    Raises:
        UsageError: ``successor`` is ``None`` and ``run_id`` does not exist.
        StoreError: a run of the chain is missing or unreadable, a thread's predecessor is
            not finished, a fork's run has fewer steps than the fork needs, or the chain
            runs in a circle.
    """
    history, _ = await inherited_context(
        store, run_id, before_step=before_step, synthetic=synthetic, successor=successor
    )
    return history


async def inherited_context(
    store: RunStore,
    run_id: str,
    *,
    before_step: int | None = None,
    synthetic: SyntheticObservations = _SYNTHETIC,
    successor: str | None = None,
    summaries: bool = False,
) -> tuple[list[Message], Summary | None]:
    """`recorded_history`, and with ``summaries`` the latest summary the chain wrote.

    The summary is the newest one a run of the chain wrote of what it held (the newest run
    that wrote one; for a fork's run, one covering only steps before the fork), mapped onto
    the returned history as `inherited_groups` numbers it: its ``through`` is the last group
    it covers (up to 0) and its ``run_id`` the run that wrote it (docs/context.md,
    "Threads"). ``None`` without ``summaries``, when no run of the chain wrote one, or
    when what it covers does not end where a group of the history does.

    Raises:
        UsageError, StoreError: as `recorded_history`.
    """
    chain: list[tuple[RunLog, int | None]] = []
    seen: set[str] = set()
    current: str | None = run_id
    upto = before_step
    while current is not None:
        if current in seen:
            raise StoreError(f"run {run_id!r}: its history continues itself ({current!r})")
        seen.add(current)
        log = await _read_link(store, current, upto, successor)
        chain.append((log, upto))
        started = log.started
        assert started is not None  # _read_link refused it otherwise
        successor, current, upto = current, started.continues, started.fork_step
    history: list[Message] = []
    carried: tuple[Summary, int] | None = None  # the newest summary, and the messages it covers
    for log, upto in reversed(chain):
        assert log.started is not None
        inherited = len(history)
        history.extend(answer_every_call(log.started.input, synthetic))
        ends: dict[int, int] = {}
        for step in log.steps:
            if upto is not None and step.step >= upto:
                break
            history.extend(answer_every_call(step_messages(step), synthetic))
            ends[step.step] = len(history)
        own = _latest_summary(log, upto) if summaries else None
        if own is not None:
            if own.through > 0:
                covered = ends.get(own.through)
            else:
                covered = _group_end(history[:inherited], own.through)
            if covered is not None:
                carried = (own, covered)
    return history, _mapped(history, carried)


def _latest_summary(log: RunLog, before_step: int | None) -> Summary | None:
    """The newest summary ``log`` holds, or with ``before_step`` written in a step before it.

    Those the log held when a fork was made: the forked run, still unfinished, may write
    more later, and a resumed fork must find the same one.
    """
    found: Summary | None = None
    for record in log.records:
        if not isinstance(record, ModelResult) or record.reply is None:
            continue
        through = record.summary_through
        if through is not None and (before_step is None or record.step < before_step):
            found = Summary(
                intent_id=record.intent_id,
                through=through,
                text=record.reply.text or "",
                run_id=log.run_id,
            )
    return found


def _group_end(messages: Sequence[Message], through: int) -> int | None:
    """How many of ``messages`` the inherited groups up to ``through`` (<= 0) hold."""
    groups = inherited_groups(messages)
    last = len(groups) - 1 + through
    if last < 0:
        return None
    return sum(len(group.messages) for group in groups[: last + 1])


def _mapped(history: Sequence[Message], carried: tuple[Summary, int] | None) -> Summary | None:
    """The carried summary with ``through`` the group of ``history`` its coverage ends with."""
    if carried is None:
        return None
    summary, covered = carried
    held = 0
    for group in inherited_groups(history):
        held += len(group.messages)
        if held == covered:
            return attrs.evolve(summary, through=group.step)
        if held > covered:
            return None
    return None


async def _read_link(
    store: RunStore, run_id: str, before_step: int | None, successor: str | None
) -> RunLog:
    """The log of ``run_id``, checked to hold what its ``successor`` takes from it."""
    whose = f"run {successor!r} continues run {run_id!r}" if successor else f"run {run_id!r}"
    try:
        log = await store.read_log(run_id)
    except StoreError as exc:
        raise StoreError(f"{whose}, whose log cannot be read: {exc}") from exc
    if log.started is None:
        if successor is None:
            raise UsageError(f"no run {run_id!r} in the store")
        raise StoreError(f"{whose}, whose log is missing (nothing was written)")
    if successor is None:
        return log
    if before_step is None and log.finished is None:
        raise StoreError(f"{whose}, which is not finished")
    if before_step is not None and len(log.steps) < before_step - 1:
        raise StoreError(f"{whose} from step {before_step}, but it holds {len(log.steps)} steps")
    return log
