"""The model gateway: one model call at a time per run, with attempts, retries and deadlines.

Every HTTP attempt gets its own durable intent (a barrier written before the request leaves)
and its own result record, failed attempts included (docs/crash-safety.md, "The write protocol";
docs/concepts.md, "Budgets"). Retries wait with exponential backoff and jitter, or exactly the
server's Retry-After; a wait that would outlast the active-time budget, a server-directed
wait longer than `Limits.retry_after_max_s`, or a wait after which the attempt or token budget
allows no attempt, is not slept.

Each attempt runs under the agent's `Limits`: the connect, first-byte and stream-idle deadlines
are handed to the client in the attempt's `treadle.types.Attempt` (it applies the tighter of
those and its own), and the attempt total is a cancel scope here.

Budgets hold during a call. The step's cancel scope cancels the stream in flight when the run
is cancelled or its active time runs out. Each attempt observes the usage the server reports
while it streams (`treadle.types.Attempt.report_usage`): once the reported usage crosses the run's
remaining token budget the stream is cut there; a server that reports usage only at the end
is checked when the call ends. Either way the run ends with ``token_budget`` and the reply is
not acted on; so does a reply that reports no usage at all under a token budget (its spending
cannot be checked, docs/decisions/0114). Every attempt's result records the usage the server
reported, failed, cancelled and cut attempts included.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import attrs
import trio

from treadle._clock import Clock
from treadle._exceptions import ModelCallError, SeamViolation
from treadle._shapes import reply_problem, usage_problem
from treadle._state import EMPTY_SUMMARY, holds_summary, seconds_between
from treadle._text import repaired
from treadle.actors._mailbox import MailboxReceiver
from treadle.actors._messages import CallModel, ModelOutcome
from treadle.actors._retries import backoff_s, ends_the_call
from treadle.actors._rpc import StepScope, reply
from treadle.actors._writer import WriterClient
from treadle.parsers import strict_arguments
from treadle.ports import ModelClient
from treadle.types import (
    Attempt,
    Budgets,
    ImageSource,
    Limits,
    ModelErrorInfo,
    ModelIntent,
    ModelReply,
    ModelRequest,
    ModelResult,
    Record,
    StopReason,
    StoreOp,
    Usage,
)

DELTA_FLUSH_CHARS = 1024
"""Coalesced deltas are flushed at about 1 KiB ..."""
DELTA_FLUSH_S = 0.03
"""... or after 30 ms (trio clock), whichever comes first."""


@attrs.define(eq=False)
class ModelGateway:
    """The model gateway actor of one run.

    Args:
        summariser: the client of compaction calls (docs/context.md, "Summaries"); ``None``
            makes them on ``client``.
        image_source: the run's own image source, which the client consults for every
            attempt after its own: the executor's ``image_source`` (docs/models.md, "Images
            returned by tools"); ``None`` when it has none.
    """

    run_id: str
    client: ModelClient
    writer: WriterClient
    clock: Clock
    limits: Limits
    budgets: Budgets
    rng: random.Random = attrs.Factory(random.Random)
    summariser: ModelClient | None = None
    image_source: ImageSource | None = None
    _coalescer: _Coalescer = attrs.field(
        init=False, default=attrs.Factory(lambda self: _Coalescer(self.writer), takes_self=True)
    )
    _nursery: trio.Nursery | None = attrs.field(init=False, default=None)
    _flushing: bool = attrs.field(init=False, default=False)

    @trio.lowlevel.enable_ki_protection  # Ctrl-C reaches the main task: decision 0097
    async def run(
        self,
        inbox: MailboxReceiver[CallModel],
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Serve `CallModel` requests, one at a time, until ``inbox`` ends."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            task_status.started()
            async with inbox:
                async for message in inbox:
                    reply(message.reply_to, await self.call(message))
            nursery.cancel_scope.cancel()

    def _on_delta(self) -> Callable[[str, str], None]:
        """The delta callback for an attempt: it coalesces fragments and hands them to the writer.

        The writer drops a delta nobody listens to, and asks per delta, so a subscriber that
        joins during an attempt (a browser reconnecting) gets the rest of that attempt's
        deltas. On the first fragment a task starts that flushes a coalesced delta once its
        first fragment is `DELTA_FLUSH_S` old, also when the stream pauses.
        """
        return self._offer

    def _offer(self, channel: str, text: str) -> None:
        if not self._flushing and self._nursery is not None:
            self._flushing = True
            self._nursery.start_soon(self._coalescer.flush_late)
        self._coalescer.offer(channel, text)

    async def call(self, message: CallModel) -> ModelOutcome:
        """Make attempts until one succeeds, the error is final, or a budget ends the call.

        The attempt and token budgets are checked before each wait for a retry (a resumed
        step's rest of a server-directed wait included), so a wait no attempt may follow is
        never slept: the call ends at once with that budget (docs/models.md, "Budgets during
        a call").
        """
        written: list[Record] = []
        attempt = message.step_attempts
        failures = message.step_failures
        run_attempts = message.run_attempts
        tokens = message.tokens
        wait = self._left_of_earlier_wait(message)
        while True:
            stop = self._budget_stop(run_attempts, tokens)
            if stop is not None:
                return ModelOutcome(stop=stop, written=tuple(written))
            waited = await self._wait(message, wait, written)
            if waited is not None:
                return waited
            attempt += 1
            run_attempts += 1
            meter = _Meter(limit=self._remaining_tokens(tokens))
            result = await self._attempt(message, attempt, written, meter)
            if result is None:  # cancelled or cut by the time budget
                return ModelOutcome(stop=self._cut_reason(message.scope), written=tuple(written))
            tokens += _tokens(result.usage)
            if meter.cut or _over(meter.limit, result):
                return ModelOutcome(stop=StopReason.TOKEN_BUDGET, written=tuple(written))
            if result.reply is not None:
                return ModelOutcome(
                    reply=result.reply, intent_id=result.intent_id, written=tuple(written)
                )
            assert result.error is not None
            failures += 1
            if ends_the_call(result.error, failures, self.limits):
                return ModelOutcome(error=result.error, written=tuple(written))
            asked = result.error.retry_after_s
            wait = asked if asked is not None else backoff_s(failures, self.limits, self.rng)

    async def _wait(
        self, message: CallModel, wait: float, written: list[Record]
    ) -> ModelOutcome | None:
        """Sleep ``wait`` seconds before the next attempt; the outcome if the step ends first."""
        if wait <= 0:
            return None
        if trio.current_time() + wait >= message.scope.deadline:
            return ModelOutcome(stop=StopReason.TIME_BUDGET, written=tuple(written))
        with message.scope.open() as scope:
            await trio.sleep(wait)
        if scope.cancelled_caught:
            return ModelOutcome(stop=self._cut_reason(message.scope), written=tuple(written))
        return None

    def _left_of_earlier_wait(self, message: CallModel) -> float:
        """Seconds left of the server-directed wait after the step's last failed attempt.

        A run resumed after an attempt answered with ``Retry-After`` waits out what is left of
        it, counted from the failed attempt's result record on the wall clock (docs/models.md,
        "Errors and retryability"); 0 without one.
        """
        failed = message.last_failure
        if failed is None or failed.error is None or failed.error.retry_after_s is None:
            return 0.0
        wait = failed.error.retry_after_s
        if self.limits.retry_after_max_s is not None:
            wait = min(wait, self.limits.retry_after_max_s)
        return wait - seconds_between(failed.ts, self.clock.now_iso())

    def _budget_stop(self, run_attempts: int, tokens: int) -> StopReason | None:
        budgets = self.budgets
        if budgets.max_model_attempts is not None and run_attempts >= budgets.max_model_attempts:
            return StopReason.MAX_MODEL_ATTEMPTS
        if budgets.token_budget is not None and tokens >= budgets.token_budget:
            return StopReason.TOKEN_BUDGET
        return None

    def _remaining_tokens(self, tokens: int) -> int | None:
        budget = self.budgets.token_budget
        return None if budget is None else budget - tokens

    @staticmethod
    def _cut_reason(scope: StepScope) -> StopReason:
        return StopReason.CANCELLED if scope.cancel_called else StopReason.TIME_BUDGET

    async def _attempt(
        self, message: CallModel, attempt: int, written: list[Record], meter: _Meter
    ) -> ModelResult | None:
        """One HTTP attempt: intent (barrier), call, result. ``None`` when cut off."""
        intent = ModelIntent(
            run_id=self.run_id,
            step=message.step,
            intent_id=f"{self.run_id}/s{message.step}/m{attempt}",
            attempt=attempt,
            ts=self.clock.now_iso(),
            compaction=message.summary_through is not None,
        )
        client = self.client
        if intent.compaction and self.summariser is not None:
            client = self.summariser
        started = trio.current_time()
        outcome: ModelReply | ModelCallError | None = None
        on_delta = None if intent.compaction else self._on_delta()
        # One scope for the step and the attempt's limit (`Limits.model_attempt_s`).
        bound = message.scope.open(limit_s=self.limits.model_attempt_s)
        with bound:
            durable = await self.writer.send_barrier(StoreOp.INTENT, intent)
            written.append(intent)
            await durable.receive()
            outcome = await self._complete(client, message.request, on_delta, meter)
        if outcome is None and bound.limit_expired and written and written[-1] is intent:
            outcome = ModelCallError(
                ModelErrorInfo(
                    kind="timeout",
                    message=f"attempt exceeded {self.limits.model_attempt_s} s",
                    retryable=True,
                ),
                usage=meter.last,
            )
        self._coalescer.flush()
        if intent.compaction and isinstance(outcome, ModelReply):
            outcome = _checked_summary(outcome)
        if outcome is None:
            if written and written[-1] is intent:
                info = ModelErrorInfo(kind=self._cut_reason(message.scope).value)
                await self._write_result(
                    intent, written, message, error=info, usage=meter.last, started=started
                )
            return None
        if isinstance(outcome, ModelCallError):
            usage = outcome.usage if _known(outcome.usage) else meter.last
            return await self._write_result(
                intent, written, message, error=outcome.info, usage=usage, started=started
            )
        return await self._write_result(intent, written, message, reply_=outcome, started=started)

    async def _complete(
        self,
        client: ModelClient,
        request: ModelRequest,
        on_delta: Callable[[str, str], None] | None,
        meter: _Meter,
    ) -> ModelReply | ModelCallError:
        limits = self.limits
        attempt = Attempt(
            connect_s=limits.model_connect_s,
            first_byte_s=limits.model_first_byte_s,
            idle_s=limits.model_idle_s,
            report_usage=meter,
            image_source=self.image_source,
        )
        try:
            reply_ = await client.complete(request, on_delta=on_delta, attempt=attempt)
        except ModelCallError as exc:
            if meter.cut and meter.error is not None:
                return meter.error
            return _checked_error(exc)
        problem = reply_problem(reply_)
        if problem is not None:
            # A bug in the client, not a result of the call: nothing is recorded for the
            # attempt and the run is interrupted (its intent is abandoned on resume).
            raise SeamViolation("model client", reply_, f"a valid ModelReply ({problem})")
        assert isinstance(reply_, ModelReply)
        return reply_

    async def _write_result(
        self,
        intent: ModelIntent,
        written: list[Record],
        message: CallModel,
        *,
        started: float,
        reply_: ModelReply | None = None,
        error: ModelErrorInfo | None = None,
        usage: Usage | None = None,
    ) -> ModelResult:
        # What the client returned enters the log (and the history) as valid Unicode only,
        # and with tool arguments that are strict JSON (stored as they were validated).
        if reply_ is not None:
            reply_ = strict_arguments(reply_)
        result = repaired(
            ModelResult(
                run_id=self.run_id,
                step=intent.step,
                intent_id=intent.intent_id,
                ts=self.clock.now_iso(),
                reply=reply_,
                error=error,
                latency_s=round(trio.current_time() - started, 6),
                usage=reply_.usage if reply_ is not None else (usage or Usage()),
                context=message.request.context,
                summary_through=message.summary_through,
            )
        )
        written.append(result)
        await self.writer.write(StoreOp.MODEL_RESULT, result)
        return result


def _checked_summary(reply_: ModelReply) -> ModelReply | ModelCallError:
    """A summariser's reply, or the failed attempt it is when it holds no summary.

    The summary is the reply's text (docs/context.md, "Summaries"): a reply without any
    (empty, blank, or tool calls only) is a retryable ``empty_summary`` error that keeps the
    reply's usage, retried like any failed attempt, never an empty summary in place of the
    steps it was to cover.
    """
    if holds_summary(reply_):
        return reply_
    what = f"{len(reply_.tool_calls)} tool calls" if reply_.tool_calls else "no text"
    info = ModelErrorInfo(
        kind=EMPTY_SUMMARY, message=f"the summariser's reply has {what}", retryable=True
    )
    return ModelCallError(info, usage=reply_.usage)


def _checked_error(error: ModelCallError) -> ModelCallError:
    """``error`` when the usage it carries keeps the model client's contract.

    Each count is ``None`` or an int >= 0, as in a reply (docs/seams.md, "Model client").

    Raises:
        SeamViolation: a count of another type or below 0 (which would make the log
            undecodable or unbind the token budget); nothing is recorded for the attempt and
            the run is interrupted (its intent is abandoned on resume).
    """
    problem = usage_problem(error.usage)
    if problem is not None:
        expected = f"a ModelCallError with a valid usage ({problem})"
        raise SeamViolation("model client", error.usage, expected) from error
    return error


def _tokens(usage: Usage) -> int:
    """The tokens ``usage`` counts against the token budget (`Usage.known_total`; 0 unknown)."""
    return usage.known_total or 0


def _over(limit: int | None, result: ModelResult) -> bool:
    """Whether the attempt's result ends the run on its token budget (``limit`` tokens left).

    Its usage crossed the budget; or it is a reply whose usage reports no count of tokens:
    what it spent cannot be checked, so it is not acted on (docs/decisions/0114). A failed
    attempt of unknown usage counts as unknown and does not end the run.
    """
    if limit is None:
        return False
    counted = result.usage.known_total
    return result.unmetered or (counted is not None and counted > limit)


def _known(usage: Usage) -> bool:
    return any(
        count is not None
        for count in (
            usage.input_tokens,
            usage.output_tokens,
            usage.reasoning_tokens,
            usage.total_tokens,
        )
    )


@attrs.define(eq=False)
class _Meter:
    """Observes the usage one attempt reports and cuts it when it crosses ``limit`` tokens.

    Attributes:
        limit: tokens the attempt may use as the token budget counts them (the run's
            remaining token budget, `treadle.types.Usage.known_total`); ``None`` for no limit.
        last: the latest usage the server reported in this attempt.
        cut: the attempt was ended because its reported usage crossed ``limit``.
        error: the error raised to end it.
    """

    limit: int | None
    last: Usage = Usage()
    cut: bool = False
    error: ModelCallError | None = None

    def __call__(self, usage: Usage) -> None:
        problem = usage_problem(usage)
        if problem is not None:  # a bug in the client: raised out of its call
            raise SeamViolation("model client", usage, f"a valid usage report ({problem})")
        self.last = usage
        if self.limit is None or _tokens(usage) <= self.limit:
            return
        self.cut = True
        message = (
            f"reported usage of {_tokens(usage)} tokens crosses the remaining token budget "
            f"of {self.limit}; the stream was cut"
        )
        self.error = ModelCallError(
            ModelErrorInfo(kind="token_budget", message=message), usage=usage
        )
        raise self.error


@attrs.define(eq=False)
class _Coalescer:
    """Coalesces streamed fragments into deltas of about 1 KiB or 30 ms."""

    writer: WriterClient
    _channel: str = ""
    _parts: list[str] = attrs.Factory(list)
    _size: int = 0
    _since: float = 0.0
    _pending: trio.Event = attrs.Factory(trio.Event)

    def offer(self, channel: str, text: str) -> None:
        if channel != self._channel:
            self.flush()
            self._channel = channel
        now = trio.current_time()
        if not self._parts:
            self._since = now
        self._parts.append(text)
        self._size += len(text)
        if self._size >= DELTA_FLUSH_CHARS or now - self._since >= DELTA_FLUSH_S:
            self.flush()
        elif not self._pending.is_set():
            self._pending.set()  # wake `flush_late` only for fragments that stay behind

    def flush(self) -> None:
        if self._parts:
            self.writer.delta(self._channel, "".join(self._parts))
            self._parts.clear()
            self._size = 0

    @trio.lowlevel.enable_ki_protection  # Ctrl-C reaches the main task: decision 0097
    async def flush_late(self) -> None:
        """Flush each coalesced delta `DELTA_FLUSH_S` after its first fragment, forever.

        Without it, the last fragments before a pause in the stream would wait for the
        next fragment.
        """
        while True:
            await self._pending.wait()
            self._pending = trio.Event()
            due = self._since + DELTA_FLUSH_S
            await trio.sleep_until(due)
            if self._parts and self._since + DELTA_FLUSH_S <= trio.current_time():
                self.flush()
