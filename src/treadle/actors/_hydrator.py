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
when it starts (`read_chain`, the one place a predecessor's history is loaded), or takes the
chain the check before the run's start read (a new run's first drive), and it is then simply
part of the history it holds (docs/threads.md, "How history is inherited").

With a context window, every request is fitted into it (docs/context.md, "What stays"): when
older steps must go, the hydrator answers with a `Compaction` (a summariser request) instead
of the step's request; the coordinator has the gateway make that call durably and hands the
summary back. The hydrator still writes nothing.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence

import attrs
import trio

from treadle._budget import (
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
    summary_request,
)
from treadle._exceptions import StoreError
from treadle.actors._history import (
    Chain,
    answer_every_call,
    inherited_context,
    read_chain,
    step_messages,
)
from treadle.actors._mailbox import MailboxReceiver
from treadle.actors._messages import Compaction, Hydrate
from treadle.actors._rpc import reply
from treadle.ports import RunStore
from treadle.types import (
    ContextUsed,
    JSONValue,
    Message,
    ModelRequest,
    OutputFormat,
    RunStarted,
    StepRecord,
    SyntheticObservations,
    ToolSpec,
)


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
            refuses such a run unless given its ``chain``.
        chain: that history as read already (`read_chain`: the check before a new thread
            run or fork started read it), used once instead of reading the store again
            when it is the chain ``started`` continues; ``None``: read it from ``store``.
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
    chain: Chain | None = None
    _history: tuple[Message, ...] = attrs.field(init=False, default=())
    """The history so far; a tuple, so that a request without a window carries it as it is
    instead of a copy (one array of it a run, not two: docs/performance.md, "Memory")."""
    _groups: list[Group] = attrs.field(init=False, factory=list)
    """The history's steps, one group each, for fitting it to the context window; kept only
    when there is a window (a run's memory, docs/performance.md, "Memory")."""
    _head: tuple[Message, ...] = attrs.field(init=False, default=())
    _carried: Summary | None = attrs.field(init=False, default=None)
    """The summary an earlier run of the thread left, mapped onto the inherited history
    (docs/context.md, "Threads"); used until the run writes one of its own."""
    _meter: Meter = attrs.field(init=False, factory=Meter)
    _last: tuple[tuple[Message, ...], int] | None = attrs.field(init=False, default=None)
    _last_tokens: int | None = attrs.field(init=False, default=None)
    _ceiling: int | None = attrs.field(init=False, default=None)

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
        history like any other. A run that continues nothing inherits nothing. The history
        comes from ``chain`` when it is this run's (it is then dropped: a later start reads
        the store), else from the store: each log of the chain read once.

        Raises:
            StoreError: that history cannot be read (a missing or damaged log, a thread's
                predecessor that is not finished, a fork's run without the steps it forks
                at), or this hydrator has no store (docs/threads.md, "When a thread cannot
                go on").
        """
        started = self.started
        chain, self.chain = self.chain, None
        if started.continues is None:
            return
        if chain is None or not chain.inherited_by(started):
            chain = await self._read_chain(started)
        inherited, carried = inherited_context(
            chain, synthetic=self.synthetic, summaries=self.context_window is not None
        )
        at = 1 if self.system_prompt is not None else 0
        self._history = (*self._history[:at], *inherited, *self._history[at:])
        # the budget compacts it like the run's own steps (docs/context.md, "What stays")
        if self.context_window is not None:
            self._groups[0:0] = inherited_groups(inherited)
            self._carried = carried

    async def _read_chain(self, started: RunStarted) -> Chain:
        """The chain ``started`` continues, read from the store (`read_chain`).

        Raises:
            StoreError: as `read_chain`, or this hydrator has no store.
        """
        assert started.continues is not None
        if self.store is None:
            raise StoreError(
                f"run {started.run_id!r} continues run {started.continues!r}, but its "
                "hydrator was given no store to read that history from"
            )
        return await read_chain(
            self.store,
            started.continues,
            before_step=started.fork_step,
            successor=started.run_id,
        )

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
        """The summariser request for the oldest steps of ``compact`` that fit the window.

        The request, its output cap and `MESSAGE_ROOM` fit ``budget`` as the counter in use
        counts them (`summary_request`); only a single step too large alone is cut.
        """
        cap = summary_cap(budget)
        if previous is not None:  # one that ignored its output cap is cut to it
            previous = cut_summary(previous, cap, self._meter)
        messages, count = summary_request(
            prompt=self.summary_prompt,
            head=head,
            previous=previous,
            groups=compact.groups,
            tokens=budget - cap - MESSAGE_ROOM,
            meter=self._meter,
        )
        chosen = compact.groups[:count]
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
"""Tokens a summariser request leaves free besides its output cap: it is a few long texts,
which the calibrated counter estimates less closely than a step's (docs/context.md, "Counting
tokens")."""
