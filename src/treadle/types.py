"""Immutable records and enums shared by every part of treadle.

This module depends on nothing else in the package (docs/design.md). It holds:

* the enums of the run state machine, stop reasons and action statuses;
* the model-visible request and reply shapes (messages, tool specs, tool calls, usage);
* what a decision parser returns (`ParsedReply`) and what an executor returns (`ActionOutcome`);
* the agent-definition settings that are plain data (budgets, limits, synthetic observations);
* the **log records** (`RunStarted` … `RunFinished`) that every store persists, and `RunLog`,
  the whole log of one run as read back;
* the ordered `Event` delivered to sinks and subscribers.

All records are `attrs.frozen(kw_only=True)`; change them with `attrs.evolve`. Durations are
seconds (`_s` suffix); instants are UTC wall-clock ISO-8601 strings from the injected clock,
never trio time.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Mapping
from typing import Any, ClassVar, Final, NoReturn, TypeAlias

import attrs

SCHEMA_VERSION = 3
"""Version of the persisted log record schema. A log written by a newer version is refused.

2: run-started records the agent's name and version (docs/fleet.md).
3: run totals count ``other_tokens`` and an action outcome its ``unknown_usage_attempts``
(a child run's), which a version-2 reader's decoder refuses. Raised with the stores'
versions whenever the records' wire shape changes (docs/crash-safety.md, "Versions")."""

JSONValue: TypeAlias = Any
"""A value made only of dict, list, str, int, float, bool and None."""


class StopReason(enum.StrEnum):
    """Why a run ended, checked in this order at the top of every step.

    See docs/concepts.md, "Stop reasons".
    """

    CANCELLED = "cancelled"
    ENV_ERROR = "env_error"
    TASK_COMPLETED = "task_completed"
    FINAL_ANSWER = "final_answer"
    INVALID_DECISIONS = "invalid_decisions"
    MODEL_ERROR = "model_error"
    MAX_STEPS = "max_steps"
    MAX_MODEL_ATTEMPTS = "max_model_attempts"
    TOKEN_BUDGET = "token_budget"
    TIME_BUDGET = "time_budget"


SUCCESS_STOP_REASONS = frozenset({StopReason.TASK_COMPLETED, StopReason.FINAL_ANSWER})
"""Stop reasons that end a run as `succeeded`; every other one ends it as `failed` or
`cancelled`. An unknown stop reason is never success (docs/concepts.md, "Stop reasons")."""


class RunState(enum.StrEnum):
    """The run state machine of docs/concepts.md, "Stop reasons".

    ``queued → running ⇄ awaiting_approval → succeeded | failed | interrupted`` and
    ``queued | running | awaiting_approval → cancelling → cancelled``. Terminal states never
    change. ``running ⇄ awaiting_child``: in a fleet, a run whose tool call waits on a child
    run it queued is parked until the child ends (docs/child-runs.md, "In a fleet").
    """

    QUEUED = "queued"
    RUNNING = "running"
    AWAITING_APPROVAL = "awaiting_approval"
    AWAITING_CHILD = "awaiting_child"
    CANCELLING = "cancelling"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    INTERRUPTED = "interrupted"
    CANCELLED = "cancelled"

    @property
    def is_terminal(self) -> bool:
        """True for succeeded, failed and cancelled; an interrupted run is resumable."""
        return self in (RunState.SUCCEEDED, RunState.FAILED, RunState.CANCELLED)


def final_state(reason: StopReason) -> RunState:
    """The state a run ends in for ``reason`` (docs/concepts.md, "Stop reasons").

    `succeeded` for `SUCCESS_STOP_REASONS`, `cancelled` for `cancelled`, `failed` for every
    other.
    """
    if reason in SUCCESS_STOP_REASONS:
        return RunState.SUCCEEDED
    if reason is StopReason.CANCELLED:
        return RunState.CANCELLED
    return RunState.FAILED


class ActionStatus(enum.StrEnum):
    """What happened to an action (docs/seams.md, "Action executor").

    EXECUTED: it ran in the environment, whatever its result (a tool that raised included).
    NOT_EXECUTED: it never started (unknown tool, invalid arguments, refused, rejected).
    ENV_ERROR: the environment cannot serve any more; ends the run with ``env_error``.
    UNKNOWN: found on resume with an intent but no result, replay policy ``never`` and no
    reconcile check able to tell what happened.
    """

    EXECUTED = "executed"
    NOT_EXECUTED = "not_executed"
    ENV_ERROR = "env_error"
    UNKNOWN = "unknown"


class ReplayPolicy(enum.StrEnum):
    """What resume does with an action whose intent is stored but whose result is not."""

    SAFE = "safe"
    """Read-only or idempotent: re-executed under the same intent id (idempotency key)."""
    NEVER = "never"
    """The default: never re-executed; recorded as UNKNOWN unless a reconcile check decides."""


class DecisionKind(enum.StrEnum):
    """The three things a decision parser can return (docs/seams.md, "Decision parser")."""

    ACTIONS = "actions"
    FINAL_ANSWER = "final_answer"
    INVALID = "invalid"


class StoreOp(enum.Enum):
    """The six write operations of the run store seam (docs/seams.md, "Run store").

    Whether an operation is a barrier is decided here and nowhere else
    (docs/crash-safety.md, "The write protocol").
    """

    RUN_STARTED = "run_started"
    INTENT = "intent"
    MODEL_RESULT = "model_result"
    STEP = "step"
    CONTROL = "control"
    RUN_FINISHED = "run_finished"

    @property
    def barrier(self) -> bool:
        """True when the operation returns only once durable, with everything before it."""
        return self._value_ in _BARRIER_OPS


_BARRIER_OPS = frozenset(op.value for op in (StoreOp.INTENT, StoreOp.CONTROL, StoreOp.RUN_FINISHED))


# --------------------------------------------------------------------------- model shapes


@attrs.frozen(kw_only=True)
class ImageRef:
    """An image given to the model, kept in the log by reference only.

    See docs/concepts.md, "Data that stays in".

    Attributes:
        url: an ``http(s)`` URL the provider fetches itself, or a caller-side key
            (``ref:<name>``) resolved to bytes at request time through the run's image source.
        digest: ``sha256:<hex>`` of the bytes, when the caller supplied bytes; ``None`` for URLs.
        media_type: e.g. ``image/png``; ``None`` when unknown.
    """

    url: str
    digest: str | None = None
    media_type: str | None = None


@attrs.frozen(kw_only=True)
class ToolCall:
    """One tool call requested by the model.

    Attributes:
        id: the provider's call id, or a synthesised stable one when the provider sent none.
        name: the tool name as the model wrote it (not yet checked against declared tools).
        arguments: the decoded JSON object of arguments.
    """

    id: str
    name: str
    arguments: Mapping[str, JSONValue] = attrs.field(factory=dict)


@attrs.frozen(kw_only=True)
class InvalidToolCall:
    """A tool call the gateway could not assemble into a callable one.

    Attributes:
        id: call id (provider's, or synthesised).
        name: tool name, possibly empty.
        raw_arguments: the argument text exactly as received.
        reason: ``truncated`` (cut by the output-token limit), ``unparseable``, or a refusal
            of `treadle.parsers.strict_arguments` (``non_finite_number``,
            ``nested_too_deep``).
    """

    id: str
    name: str
    raw_arguments: str
    reason: str


# No weak-reference slot: a run keeps two messages a step in its history, and without the slot
# each takes 96 bytes instead of 112 (docs/performance.md, "Memory").
@attrs.frozen(kw_only=True, weakref_slot=False)
class Message:
    """One chat message of the model-visible history (OpenAI chat shape, provider-neutral).

    Attributes:
        role: ``system``, ``user``, ``assistant`` or ``tool``.
        content: the text; ``None`` for a tool-only assistant turn (kept as null, never "").
        images: images attached to a ``user`` message, or returned by the tool call a
            ``tool`` message answers (docs/models.md, "Images"), in order after the text.
        tool_calls: the calls of an assistant turn, in the order the model gave them.
        tool_call_id: for ``tool`` messages, the call this answers.
        name: for ``tool`` messages, the tool name.
        reasoning: reasoning text of an assistant turn, sent back where the provider needs it.
        reasoning_signature: the provider's signature over that reasoning (Anthropic's
            thinking block), sent back unchanged with it; ``None`` when there is none.
    """

    role: str
    content: str | None = None
    images: tuple[ImageRef, ...] = ()
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str | None = None
    name: str | None = None
    reasoning: str | None = None
    reasoning_signature: str | None = None


@attrs.frozen(kw_only=True)
class ToolSpec:
    """A tool as the model sees it: name, description and JSON-schema of its arguments."""

    name: str
    description: str = ""
    parameters: Mapping[str, JSONValue] = attrs.field(
        factory=lambda: {"type": "object", "properties": {}}
    )


@attrs.frozen(kw_only=True)
class OutputFormat:
    """The shape a reply's text must have, asked for with the provider's native structured output.

    Set on a request only when the agent's output is asked for natively
    (docs/structured-output.md, "Native or a final-answer tool"); the OpenAI-compatible
    client sends it as ``response_format: {"type": "json_schema", "json_schema": {...}}``.

    Attributes:
        name: the schema's name (``[A-Za-z0-9_-]``, at most 64 characters).
        schema: the JSON schema (2020-12) of the output; its top level is an object.
        strict: ask the provider to follow the schema exactly (OpenAI ``strict``).
        description: what the output is, shown to the model; ``""`` for none.
    """

    name: str
    schema: Mapping[str, JSONValue]
    strict: bool = False
    description: str = ""


@attrs.frozen(kw_only=True)
class ModelRequest:
    """The model-visible request built by the context hydrator.

    Attributes:
        messages: history, oldest first; the system prompt (if any) is element 0.
        tools: the declared tools, in declaration order (with the final-answer tool last
            when the output is asked for by a tool, docs/structured-output.md).
        model: the provider's model name.
        max_output_tokens: the definition's output cap; always sent, never raised by a request.
        params: other sampling parameters in the provider's own form (temperature,
            ``reasoning_effort``, ...), already merged from the definition.
        output: the native structured output asked for, ``None`` for free text.
        context: what the context budget did to build this request (never sent to the
            provider; the gateway copies it into the attempt's `ModelResult`), ``None``
            when the agent declares no context window (docs/context.md).
    """

    messages: tuple[Message, ...]
    tools: tuple[ToolSpec, ...] = ()
    model: str = ""
    max_output_tokens: int | None = None
    params: Mapping[str, JSONValue] = attrs.field(factory=dict)
    output: OutputFormat | None = None
    context: ContextUsed | None = None


@attrs.frozen(kw_only=True)
class ContextUsed:
    """The context one model request was given, as ranges and ids (docs/context.md, "The record").

    Its size does not grow with the run's length: steps are named by ranges, the summary by
    its intent id, elided observations by a count and a step range.

    Attributes:
        window: the agent's context window, tokens.
        budget: the input tokens the request may use: the window less the output cap and
            the safety margin.
        estimated_input_tokens: the request's size as the budget counted it, tokens
            (calibrated from reported usage; the exact reported size of the previous
            request's prefix when it is one).
        counted_tokens: the token counter's own count of the request, before calibration.
        verbatim_from: the first step sent verbatim (every later step is too); ``None``
            when no step is sent.
        summary_intent_id: the intent id of the summary sent in place of earlier steps,
            ``None`` for none.
        summary_through: the last step that summary covers.
        marked: old observations replaced by a re-fetch marker.
        marked_from / marked_to: the steps those observations belong to.
        truncated: observations of the newest steps cut to fit (with a marker).
        forced: built by a compaction after the provider refused the previous attempt
            for its context length.
        unfit: what cannot be cut (the instructions, the input, the summariser's prompt)
            alone exceeds the budget: the request was sent over it.
        summary_run_id: the earlier run of the thread whose log holds that summary, when
            it was carried over from there (docs/context.md, "Threads"); its
            ``summary_through`` then counts the inherited history (up to 0). ``None``:
            this run's own summary, or none.
    """

    window: int
    budget: int
    estimated_input_tokens: int
    counted_tokens: int = 0
    verbatim_from: int | None = None
    summary_intent_id: str | None = None
    summary_through: int | None = None
    marked: int = 0
    marked_from: int | None = None
    marked_to: int | None = None
    truncated: int = 0
    forced: bool = False
    unfit: bool = False
    summary_run_id: str | None = None


@attrs.frozen(kw_only=True)
class Usage:
    """Token usage as reported by the provider; every count is ``None`` when not reported.

    Unknown usage is never a made-up 0 (docs/seams.md, "Model client"). Units are tokens.
    docs/models.md, "Usage" maps each provider's fields onto these.

    Attributes:
        input_tokens: the whole prompt, cached parts included, for every provider (Anthropic
            reports uncached, cache-read and cache-write tokens apart; they are summed here).
        output_tokens: generated tokens, reasoning included.
        reasoning_tokens: of ``output_tokens``, those spent on reasoning.
        total_tokens: the provider's own total.
        cached_input_tokens: of ``input_tokens``, those read from the provider's prompt cache
            (OpenAI ``prompt_tokens_details.cached_tokens``, DeepSeek
            ``prompt_cache_hit_tokens``, Anthropic ``cache_read_input_tokens``).
        cache_creation_input_tokens: of ``input_tokens``, those written to the cache
            (Anthropic ``cache_creation_input_tokens``).
    """

    input_tokens: int | None = None
    output_tokens: int | None = None
    reasoning_tokens: int | None = None
    total_tokens: int | None = None
    cached_input_tokens: int | None = None
    cache_creation_input_tokens: int | None = None

    @property
    def known_total(self) -> int | None:
        """The tokens this usage accounts for, as the token budget counts them.

        ``input_tokens + output_tokens`` as far as they are reported, or ``total_tokens`` when
        that is larger: all of a total a server reports alone, and what a total counts beyond
        its parts; ``None`` when none of the three is reported (docs/concepts.md, "Budgets";
        docs/decisions/0105-reported-totals-count.md).
        """
        parts = None
        if self.input_tokens is not None or self.output_tokens is not None:
            parts = (self.input_tokens or 0) + (self.output_tokens or 0)
        if self.total_tokens is None or (parts is not None and parts >= self.total_tokens):
            return parts
        return self.total_tokens


@attrs.frozen(kw_only=True)
class ModelReply:
    """The assembled reply of one successful model call.

    Attributes:
        text: visible text; ``None`` when the model sent none (a tool-only turn).
        reasoning: reasoning text, kept apart from the visible text; ``None`` when absent.
        reasoning_signature: the provider's signature over the reasoning (Anthropic thinking),
            to be sent back with it on the next turn; ``None`` when there is none.
        tool_calls: complete tool calls, ordered by the provider's index.
        invalid_tool_calls: calls that could not be assembled (e.g. cut by ``length``).
        finish_reason: the finish reason in the standard set ``stop``, ``length``,
            ``tool_calls``, ``content_filter`` (docs/models.md, "Replies, finish reasons,
            reasoning"), ``None`` when the server sent none.
        usage: as reported; all ``None`` when the server did not say.
        response_id: the provider's response id, when given.
        refusal: the model's refusal text (OpenAI ``delta.refusal``, the ``explanation`` of
            Anthropic's ``stop_details``), kept apart from the visible text as the official
            SDK keeps it; ``None`` when none came (a reply the provider stopped,
            ``content_filter``, is a refusal without one too).
        provider_finish_reason: the server's own finish reason when it is not the standard
            value ``finish_reason`` holds (``end_turn``, ``MAX_TOKENS``, ``eos`` ...); ``None``
            when the server sent a standard one.
    """

    text: str | None = None
    reasoning: str | None = None
    reasoning_signature: str | None = None
    tool_calls: tuple[ToolCall, ...] = ()
    invalid_tool_calls: tuple[InvalidToolCall, ...] = ()
    finish_reason: str | None = None
    usage: Usage = Usage()
    response_id: str | None = None
    refusal: str | None = None
    provider_finish_reason: str | None = None


@attrs.frozen(kw_only=True)
class ModelErrorInfo:
    """A classified failure of one model call attempt (persisted in the model-call result).

    Attributes:
        kind: ``rate_limited``, ``server_error``, ``upstream_error``, ``context_length_exceeded``,
            ``auth``, ``bad_request``, ``not_found``, ``incomplete_stream``, ``timeout``,
            ``connection`` or ``invalid_response`` (from clients); ``cancelled``,
            ``time_budget`` or ``token_budget`` (the gateway cut the attempt);
            ``empty_summary`` (a summariser's reply without text, docs/context.md,
            "Summaries").
        message: provider's message, with any credential removed.
        retryable: whether the same request may be sent again.
        retry_after_s: server-directed wait in seconds (Retry-After), ``None`` when not given.
        status: HTTP status, ``None`` for transport failures.
    """

    kind: str
    message: str = ""
    retryable: bool = False
    retry_after_s: float | None = None
    status: int | None = None


ImageSource: TypeAlias = Callable[[ImageRef], bytes]
"""Resolves a ``ref:<name>`` image to its bytes; raises `LookupError` or `OSError` if missing."""

UsageObserver: TypeAlias = Callable[[Usage], None]
"""Receives the usage the server has reported so far in one attempt (running counts, tokens).

It may raise `treadle.ModelCallError` to end the attempt (the model gateway's does so, with
kind ``token_budget``, when the reported usage crosses the run's remaining token budget); the
client lets that error propagate unchanged."""


def _ignore_usage(usage: Usage) -> None:
    """The usage observer of an attempt made outside a run: reports go nowhere."""


@attrs.frozen(kw_only=True)
class Attempt:
    """What the model gateway hands one model call attempt (`treadle.ports.ModelClient`).

    The gateway builds one for every attempt from the agent's `Limits` and the run's state and
    passes it as ``complete(..., attempt=...)``; a client reads everything it needs about the
    attempt from it (docs/seams.md, "Model client"; docs/models.md, "Writing a model
    client"). A call made outside a run gets `Attempt.STANDALONE`: no deadline beyond the
    client's own, usage reported to no one, no image source besides the client's.

    Attributes:
        connect_s: seconds the TCP/TLS connect may take (`Limits.model_connect_s`).
        first_byte_s: seconds from sending the request to the first data event
            (`Limits.model_first_byte_s`).
        idle_s: seconds of silence allowed between two reads once the first event came
            (`Limits.model_idle_s`). A client applies, for each of the three, the smaller of
            this value and its own setting; ``math.inf`` leaves its own. A deadline that
            passes ends the attempt with a retryable `ModelErrorInfo` of kind ``timeout``
            (docs/models.md, "Deadlines inside every attempt").
        report_usage: a client calls it with the usage the server has reported so far (a
            `Usage`, in tokens) each time the server reports usage, running or final, before
            it goes on reading; it may raise `treadle.ModelCallError` (kind
            ``token_budget``) to end the attempt, which the client lets propagate unchanged
            after closing the response (docs/models.md, "Budgets during a call"). The reply
            it returns then holds the last usage reported: the run records the reply's
            (docs/models.md, "Usage").
        image_source: the run's own source of ``ref:`` images (its executor's
            ``image_source``, `treadle.ports.ToolPolicies`), asked after the client's own
            source when that has none or raises `LookupError`; ``None`` when the run has none
            (docs/models.md, "Images").
    """

    STANDALONE: ClassVar[Attempt]
    """An attempt made outside a run: no extra deadline, no usage observer, no run images."""

    connect_s: float = math.inf
    first_byte_s: float = math.inf
    idle_s: float = math.inf
    report_usage: UsageObserver = _ignore_usage
    image_source: ImageSource | None = None


Attempt.STANDALONE = Attempt()


@attrs.frozen(kw_only=True)
class ParsedReply:
    """What a decision parser returns; exactly one of three kinds.

    See docs/seams.md, "Decision parser".

    Attributes:
        kind: actions, final answer, or invalid decision.
        actions: the tool calls to run (non-empty for ``ACTIONS``), in order.
        text: the final answer (``FINAL_ANSWER``), or visible text alongside actions.
        feedback: for ``INVALID``: the text fed back to the model.
        reason: for ``INVALID``: a short machine-readable reason (``multiple_json_values``...);
            for a ``FINAL_ANSWER`` that is the model's refusal: ``refusal``.
        repairs: names of the repairs applied to get here (``python_literal`` ...).
        history_message: the assistant message as it enters history (sanitised: never a
            merged or truncated argument string).
    """

    kind: DecisionKind
    actions: tuple[ToolCall, ...] = ()
    text: str | None = None
    feedback: str | None = None
    reason: str | None = None
    repairs: tuple[str, ...] = ()
    history_message: Message = Message(role="assistant")


@attrs.frozen(kw_only=True)
class ActionOutcome:
    """What the action executor returns for one action (docs/seams.md, "Action executor").

    Attributes:
        status: EXECUTED, NOT_EXECUTED, ENV_ERROR, or UNKNOWN (from resume, or for a call
            abandoned while it still ran: docs/concepts.md, "Tools and cancellation").
        observation: the text that enters history. For NOT_EXECUTED, ENV_ERROR and UNKNOWN it
            is the definition's synthetic observation.
        observation_is_synthetic: true when ``observation`` is a synthetic observation.
        task_completed: the environment's completion signal (never "unknown").
        observation_truncated_chars: characters cut from the observation as it was recorded
            (`Limits.max_observation_chars`; a synthetic one is cut too).
        detail: the executor's own text for a non-executed action (diagnostics and events only,
            never history).
        revisions: the revisions of resources the observation shows, by resource key (an
            ``int``; 0 is a revision); the run's table of observed revisions is folded from
            these (docs/concepts.md, "Stale writes"). Empty (and left out of the log) for
            tools that report none.
        stale_resource: for NOT_EXECUTED: the resource key the tool found changed since
            the revision the model saw (`treadle.revisions.StaleWrite`); the observation is
            then the definition's ``stale`` text. ``None`` otherwise.
        child_run_id: the run the call started (or re-attached to) as a child run, if
            any (docs/child-runs.md).
        usage: model tokens the call spent on the run's behalf (a child run's totals);
            counted in the run's token budget. ``None`` (and left out of the log) for
            calls that report none.
        unknown_usage_attempts: model attempts made on the run's behalf whose usage was not
            reported (a child run's `Totals.unknown_usage_attempts`): added to the run's own,
            so that unknown usage stays unknown, never a 0 (docs/child-runs.md, "Budgets").
            0 (and left out of the log) for calls that made none.
        images: images the call returned, in order, sent to the model with the observation
            (docs/models.md, "Images returned by tools"); references only, never bytes.
            Only an EXECUTED outcome's images enter history. Empty (and left out of the
            log) for a result without images.
    """

    status: ActionStatus
    observation: str
    observation_is_synthetic: bool = False
    task_completed: bool = False
    observation_truncated_chars: int = 0
    detail: str | None = None
    revisions: Mapping[str, int] = attrs.field(factory=dict)
    stale_resource: str | None = None
    child_run_id: str | None = None
    usage: Usage | None = None
    images: tuple[ImageRef, ...] = ()
    unknown_usage_attempts: int = 0


@attrs.frozen(kw_only=True)
class Action:
    """One action handed to an action executor.

    Attributes:
        run_id: the run it belongs to.
        step: the step index.
        intent_id: the id of its durable action intent; also the idempotency key a tool may
            use to make its effect happen at most once.
        call_id: the model's tool-call id this answers.
        tool: the tool name.
        arguments: the decoded argument object (not yet validated).
        replay: true when resume re-executes a ``safe`` action whose intent was already
            written (its effect may have happened once before, under the same intent id).
        revisions: the revisions the run observed before this step, by resource key, each
            key's distinct revisions with the latest observed last (docs/concepts.md,
            "Stale writes"); what a writing tool's call is checked against.
        tokens_left: this call's share of the run's token budget: what the run has left
            before this step, divided evenly among the step's calls that run (they run at
            once, and together stay within it; ``None``: no token budget).
        deadline: the trio time (`trio.current_time`) at which the run's time budget ends
            during this step (``inf``: no time budget).
        forward: hands an event of another run (a child run) to this run's live
            subscribers, never to its log (docs/child-runs.md, "Events"); ``None`` when
            nobody can receive them.
        cancelled: ``cancelled()`` tells whether the run itself was cancelled (a cancel
            request), as opposed to its drive stopping in this process (a drain, a lost
            lease), which leaves it resumable; ``None`` when nobody can tell.
        report_active_s: ``report_active_s(seconds)`` reports active seconds the call spent
            on the run's behalf as another log records them (a child run's
            `Totals.active_s`), which may include time a process that died spent on it: the
            step counts at least its model attempts' time plus the most any of its calls
            reported (docs/child-runs.md, "Budgets"); ``None`` when nobody counts them.
        can_park: the call may park its run instead of answering (every call of the step
            is ``safe`` to replay, so none of their outcomes is lost when the step is run
            again): a child-run tool in a fleet does (docs/child-runs.md, "In a fleet").
        timeout_s: seconds the call may run, as the run applies it: `Limits.tool_timeout_s`,
            or the executor's own timeout of the tool when shorter (``inf``: none). An
            executor that times its calls out itself, as `treadle.Toolbox` does, ends the
            call by then, so that it reports the timeout before the run stops waiting
            (docs/concepts.md, "Tools and cancellation").
        generation: the fencing generation of the run's lease held by the drive that makes
            this call (or reconciles it): the generation its action intent was written
            under; for a ``safe`` call run again on resume, or a ``reconcile`` of a call an
            earlier driver made, the resuming drive's, newer than that of any driver that
            may still be making the call. 0 when the run has no lease (a store without
            leases). A tool hands it to the system it acts on as a fencing token, which
            refuses a token older than one it has seen (docs/crash-safety.md, "A paused
            driver").
    """

    run_id: str
    step: int
    intent_id: str
    call_id: str
    tool: str
    arguments: Mapping[str, JSONValue] = attrs.field(factory=dict)
    replay: bool = False
    revisions: Mapping[str, tuple[int, ...]] = attrs.field(factory=dict)
    tokens_left: int | None = None
    deadline: float = float("inf")
    forward: Callable[[Event], None] | None = attrs.field(default=None, eq=False, repr=False)
    cancelled: Callable[[], bool] | None = attrs.field(default=None, eq=False, repr=False)
    report_active_s: Callable[[float], None] | None = attrs.field(
        default=None, eq=False, repr=False
    )
    can_park: bool = False
    timeout_s: float = float("inf")
    generation: int = 0


# --------------------------------------------------------------------------- definition data


@attrs.frozen(kw_only=True)
class Budgets:
    """The four run budgets of docs/concepts.md, "Stop reasons"; ``None`` means unlimited.

    Attributes:
        max_steps: steps (one model call + its action(s)).
        max_model_attempts: every HTTP attempt, retries and abandoned attempts included.
        token_budget: ``input_tokens + output_tokens`` as reported (cached input tokens are
            part of ``input_tokens`` and count in full; reasoning tokens are part of
            ``output_tokens``), or the reported ``total_tokens`` of an attempt when larger
            (`Usage.known_total`); unknown usage never counts as 0: a reply whose usage is
            unknown ends the run with ``token_budget``, not acted on
            (docs/decisions/0114-a-token-budget-ends-at-a-reply-of-unknown-usage.md).
        time_budget_s: active seconds (running time, excluding waits for human approval).
    """

    max_steps: int | None = 50
    max_model_attempts: int | None = 200
    token_budget: int | None = None
    time_budget_s: float | None = None

    def __attrs_post_init__(self) -> None:
        """Refuse a budget that is not ``None`` or a number of the right kind, 0 or more.

        Raises:
            treadle.UsageError: names the budget and the value (a 0 budget is allowed: it
                stops the run before its first step).
        """
        counts = ("max_steps", "max_model_attempts", "token_budget")
        seconds = ("time_budget_s",)
        _check_amounts(self, counts=counts, seconds=seconds, unlimited=counts + seconds)

    def capped(self, caps: BudgetCaps | None) -> Budgets:
        """These budgets, each cut to its cap in ``caps`` (``None``: unchanged)."""
        if caps is None:
            return self
        tokens, seconds = self.token_budget, self.time_budget_s
        if caps.token_budget is not None:
            tokens = caps.token_budget if tokens is None else min(tokens, caps.token_budget)
        if caps.time_budget_s is not None:
            seconds = caps.time_budget_s if seconds is None else min(seconds, caps.time_budget_s)
        if (tokens, seconds) == (self.token_budget, self.time_budget_s):
            return self
        return attrs.evolve(self, token_budget=tokens, time_budget_s=seconds)


@attrs.frozen(kw_only=True)
class BudgetCaps:
    """Upper bounds a parent run puts on a child run's budgets (docs/child-runs.md, "Budgets").

    Attributes:
        token_budget: the parent's token budget minus what it had spent when it started the
            child (``None``: no bound).
        time_budget_s: the parent's active seconds left when it started the child (``None``:
            no bound).
    """

    token_budget: int | None = None
    time_budget_s: float | None = None


@attrs.frozen(kw_only=True)
class Limits:
    """Per-call limits (docs/concepts.md, "Stop reasons"), seconds unless named otherwise.

    Attributes:
        tool_timeout_s: default per tool call.
        approval_timeout_s: how long a human approval may be awaited.
        model_connect_s / model_first_byte_s / model_idle_s / model_attempt_s: model-call
            deadlines: TCP connect, first byte of the response, silence inside a stream, and one
            whole attempt.
        max_model_retries: retries of one model call after its first attempt.
        retry_initial_s / retry_max_s: exponential backoff bounds (jitter added).
        retry_after_max_s: the longest server-directed wait (``Retry-After``) slept before a
            retry; a server asking for longer ends the model call with its error at once
            (docs/models.md, "Errors and retryability"). ``None``: any wait the time budget
            allows.
        invalid_decisions: consecutive unparseable replies that end the run.
        max_observation_chars: observations longer than this are cut, as the context
            window cuts (never inside a character or a JSON value) and followed by a
            marker line that says so (``None``: never cut; docs/context.md, "Truncation").
    """

    tool_timeout_s: float = 10.0
    approval_timeout_s: float = 900.0
    model_connect_s: float = 10.0
    model_first_byte_s: float = 60.0
    model_idle_s: float = 60.0
    model_attempt_s: float = 300.0
    max_model_retries: int = 4
    retry_initial_s: float = 0.5
    retry_max_s: float = 30.0
    retry_after_max_s: float | None = 600.0
    invalid_decisions: int = 3
    max_observation_chars: int | None = 20_000

    def __attrs_post_init__(self) -> None:
        """Refuse a limit that is not a number of the right kind, or out of its range.

        Every limit is 0 or more, and seconds at most `MAX_SECONDS`; a wait that can never
        be met is refused too: the deadlines of a tool call, a model call and an approval
        are more than 0, and ``invalid_decisions`` is 1 or more.

        Raises:
            treadle.UsageError: names the limit and the value.
        """
        _check_amounts(
            self,
            counts=("max_model_retries", "invalid_decisions", "max_observation_chars"),
            seconds=_LIMIT_SECONDS,
            unlimited=("max_observation_chars", "retry_after_max_s"),
        )
        for name in _LIMIT_DEADLINES:
            if getattr(self, name) == 0:
                _refuse(self, name, "a number of seconds of more than 0")
        if self.invalid_decisions == 0:
            _refuse(self, "invalid_decisions", "a whole number of 1 or more")


_LIMIT_SECONDS: Final = tuple(f.name for f in attrs.fields(Limits) if f.name.endswith("_s"))
"""The fields of `Limits` in seconds (their names end in ``_s``)."""
_LIMIT_DEADLINES: Final = tuple(n for n in _LIMIT_SECONDS if not n.startswith("retry_"))
"""The fields of `Limits` that bound a wait (all seconds but the retry backoff's)."""

MAX_SECONDS: Final = 10 * 365 * 86_400
"""The most seconds a budget or limit may hold (ten years): a deadline stamped into a
record as an ISO-8601 instant must be one (``inf`` or ``1e12`` is not)."""


def _refuse(value: object, name: str, wanted: str) -> NoReturn:
    from treadle._exceptions import UsageError  # (the exceptions module imports this one)

    amount = getattr(value, name)
    raise UsageError(f"{type(value).__name__}.{name} must be {wanted}, not {amount!r}")


def _check_amounts(
    value: object,
    *,
    counts: tuple[str, ...],
    seconds: tuple[str, ...],
    unlimited: tuple[str, ...],
) -> None:
    """Check that ``value``'s ``counts`` are ints >= 0 and its ``seconds`` in [0, `MAX_SECONDS`].

    The fields named in ``unlimited`` may also be ``None`` (no limit).

    Raises:
        treadle.UsageError: the first field that does not fit, with its value.
    """
    for name in (*counts, *seconds):
        amount = getattr(value, name)
        if amount is None and name in unlimited:
            continue
        if name in counts:
            fits = isinstance(amount, int) and not isinstance(amount, bool)
            wanted = "a whole number of 0 or more"
        else:
            fits = isinstance(amount, int | float) and not isinstance(amount, bool)
            fits = fits and not math.isnan(amount) and amount <= MAX_SECONDS
            wanted = f"a number of seconds from 0 to {MAX_SECONDS:,}"
        if not fits or amount < 0:
            allowed = "None (unlimited) or " if name in unlimited else ""
            _refuse(value, name, allowed + wanted)


@attrs.frozen(kw_only=True)
class SyntheticObservations:
    """The observation texts the library puts into history when an action did not run.

    They are part of the agent definition and of its parameter snapshot, so a replay
    reproduces them (docs/seams.md, "Action executor"). ``{tool}`` and ``{detail}`` are substituted.

    ``stale`` is the text for a write refused because its resource changed since the model
    read it (docs/concepts.md, "Stale writes"); ``{resource}`` is substituted too. It is in
    the snapshot only when the executor has a tool that writes a resource, so the snapshot
    of an agent without one is what it was before the text existed.
    """

    not_executed: str = "Error: the call to {tool} was not executed: {detail}"
    env_error: str = "Error: the environment failed while running {tool}; the run ends."
    unknown: str = (
        "Error: the outcome of the call to {tool} is unknown (the run was interrupted while it "
        "ran); it was not repeated. Check its effect before trying again."
    )
    rejected: str = "The call to {tool} was rejected by a human reviewer: {detail}"
    stale: str = (
        "Error: the call to {tool} was not executed: {resource} changed since you read it "
        "({detail}). Read it again, then decide again from what you read."
    )


# --------------------------------------------------------------------------- log records


@attrs.frozen(kw_only=True)
class RunStarted:
    """First record of a run: its input and the parameter snapshot.

    Attributes:
        run_id: the run's id.
        ts: UTC instant, ISO-8601.
        input: the run input as messages (text and image references), oldest first.
        snapshot: the merged model-visible agent definition; compared on resume.
        schema_version: `SCHEMA_VERSION` of the writer.
        agent: the name the run's agent is served under by a fleet (``None`` for a run
            started directly with `treadle.run`).
        agent_version: the agent definition's version (`treadle.Agent.version`, by default
            derived from the snapshot); a fleet worker claims only runs of versions it
            serves (docs/fleet.md, "Deploys").
        surrogates_replaced: surrogate code points replaced (a lone one by U+FFFD) in
            the input, so the log holds valid Unicode only
            (docs/crash-safety.md, "Text that is not Unicode").
        parent_run_id: for a child run, the run whose tool call started it
            (docs/child-runs.md); ``None`` otherwise.
        parent_intent_id: for a child run, the parent's action intent it serves (its run
            id is derived from it, `treadle.child_run_id`); ``None`` otherwise.
        thread: for a run that continues a thread, the thread's id (the id of its first
            run); ``None`` otherwise (docs/threads.md, "Threads").
        continues: the run whose recorded history this run starts from: the thread's
            previous run, or the run a fork forks; ``None`` for a run that starts afresh.
            Only the id is recorded: the history is read from that run's log, never copied
            (docs/threads.md, "How history is inherited").
        fork_step: for a fork, the step of ``continues`` it tries again: the run starts from
            that run's history before this step (docs/threads.md, "Forks"); ``None`` for a
            thread's run, which starts from the whole history its predecessor ended with.
        caps: for a child run queued in a fleet, the bounds its parent's remaining budgets
            put on its own (docs/child-runs.md, "Budgets"); every drive of the run applies
            them. ``None`` otherwise.
    """

    run_id: str
    ts: str
    input: tuple[Message, ...]
    snapshot: Mapping[str, JSONValue]
    schema_version: int = SCHEMA_VERSION
    agent: str | None = None
    agent_version: str | None = None
    surrogates_replaced: int = 0
    parent_run_id: str | None = None
    parent_intent_id: str | None = None
    thread: str | None = None
    continues: str | None = None
    fork_step: int | None = None
    caps: BudgetCaps | None = None


@attrs.frozen(kw_only=True)
class ModelIntent:
    """Written (barrier) before a model request leaves. ``attempt`` counts from 1 per step.

    Attributes:
        compaction: the request asks for a summary of earlier steps (a compaction inside
            the step, docs/context.md, "Summaries"), not for the step's reply.
    """

    run_id: str
    step: int
    intent_id: str
    attempt: int
    ts: str
    compaction: bool = False


@attrs.frozen(kw_only=True)
class ModelResult:
    """The result of one model call attempt (no barrier).

    What of the reply entered the history is on the step's record
    (`StepRecord.history_message`, `StepRecord.model_output_text`), not here.

    Attributes:
        intent_id: the `ModelIntent` this answers.
        reply: the assembled reply; ``None`` when the attempt failed or was abandoned.
        error: the classified failure; ``None`` on success.
        abandoned: true when written on resume for an intent without result.
        latency_s: wall seconds from request to last byte; ``None`` when not measured.
        usage: as reported for this attempt, including failed attempts.
        surrogates_replaced: surrogate code points replaced (a lone one by U+FFFD) in
            the reply or error the model client returned, so the log holds valid Unicode only
            (docs/crash-safety.md, "Text that is not Unicode").
        context: the context the request was given (docs/context.md, "The record"); ``None``
            without a context window.
        summary_through: set on the result of a compaction: the last step its summary
            (the reply's text) covers; ``None`` on a step's own attempts.
    """

    run_id: str
    step: int
    intent_id: str
    ts: str
    reply: ModelReply | None = None
    error: ModelErrorInfo | None = None
    abandoned: bool = False
    latency_s: float | None = None
    usage: Usage = Usage()
    surrogates_replaced: int = 0
    context: ContextUsed | None = None
    summary_through: int | None = None

    @property
    def unmetered(self) -> bool:
        """Whether this is a reply whose usage reports no count of tokens.

        Under a token budget the run ends at such a reply, not acting on it
        (docs/decisions/0114-a-token-budget-ends-at-a-reply-of-unknown-usage.md). A failed
        attempt is never unmetered: its usage is only unknown.
        """
        return self.reply is not None and self.usage.known_total is None


@attrs.frozen(kw_only=True)
class ActionIntent:
    """Written (barrier) before an action starts; ``intent_id`` is its idempotency key."""

    run_id: str
    step: int
    intent_id: str
    call_id: str
    tool: str
    arguments: Mapping[str, JSONValue]
    ts: str


@attrs.frozen(kw_only=True)
class ActionResult:
    """The outcome of one action, written together with its step record.

    Attributes:
        late: the call was still running when the run stopped waiting for it: the step was
            cancelled or cut by the time budget (the outcome is not applied: the run ends),
            or the call was abandoned at its timeout, or left a worker thread running
            (UNKNOWN; the model is told so, and the run goes on). A call that ended with an
            UNKNOWN outcome of its own (a process that died, an executor's answer) is not
            late. What the call returns afterwards is a diagnostic only, never a second
            result (docs/concepts.md, "Tools and cancellation";
            docs/decisions/0137-late-is-the-runs-wait-not-a-verdict.md).
        reconciled: the outcome was established after a crash by the tool's ``reconcile``
            hook (docs/crash-safety.md, "Resume"), not by running the call here.
        surrogates_replaced: surrogate code points replaced (a lone one by U+FFFD) in
            the outcome the executor returned, so the log holds valid Unicode only
            (docs/crash-safety.md, "Text that is not Unicode").
    """

    run_id: str
    step: int
    intent_id: str
    call_id: str
    tool: str
    outcome: ActionOutcome
    ts: str
    duration_s: float | None = None
    late: bool = False
    reconciled: bool = False

    @classmethod
    def unknown(
        cls,
        intent: ActionIntent,
        *,
        observation: str,
        detail: str,
        ts: str,
        synthetic: bool = False,
        late: bool = False,
    ) -> ActionResult:
        """The UNKNOWN result of ``intent``: nobody can tell whether its call had an effect.

        Every intent of a finished log has exactly one result (docs/crash-safety.md); this is
        the one written when the call's outcome cannot be established.

        Args:
            intent: the action intent answered.
            observation: what the model is told.
            detail: why the outcome is unknown (diagnostics).
            ts: UTC instant, ISO-8601.
            synthetic: the observation is the definition's synthetic ``unknown`` text.
            late: the run stopped waiting for the call (it may still be running).
        """
        return cls(
            run_id=intent.run_id,
            step=intent.step,
            intent_id=intent.intent_id,
            call_id=intent.call_id,
            tool=intent.tool,
            outcome=ActionOutcome(
                status=ActionStatus.UNKNOWN,
                observation=observation,
                observation_is_synthetic=synthetic,
                detail=detail,
            ),
            ts=ts,
            late=late,
        )

    surrogates_replaced: int = 0


@attrs.frozen(kw_only=True)
class StepRecord:
    """One completed step; written atomically with its action results.

    See docs/crash-safety.md, "The write protocol".

    Attributes:
        step: 1-based step index, contiguous.
        model_intent_id: the model call whose reply this step acted on (``None`` when the
            model call failed for good).
        decision: what the parser decided: ``actions``, ``final_answer`` or ``invalid``;
            ``None`` when the model call failed.
        history_message: the assistant message that entered history.
        feedback: for an invalid decision, the feedback text that entered history.
        model_output_text: the visible text that entered history.
        visible_output_chars: the full length of the visible output, in characters.
        observations: per action, the observation text that entered history, in call order.
        observation_images: per action, the images that entered history with its
            observation, in call order (references only); empty (and left out of the log)
            when no action of the step returned an image.
        observation_truncated_chars: characters cut from the observations, summed.
        task_completed: the completion signal of this step.
        action_result_ids: intent ids of the step's action results (empty: no action).
        env_error: an action of this step ended with ENV_ERROR.
        active_s: active seconds this step took (approval waits excluded).
        output: for a final answer of an agent with an output type, the validated output
            as JSON data (an object); ``None`` otherwise (docs/structured-output.md).
        repairs: the repairs the parser applied to the reply to reach the decision
            (`treadle.types.ParsedReply.repairs`, e.g. ``null_arguments_as_empty_object``;
            docs/models.md, "Repairs"); empty when the reply was used as sent.
    """

    run_id: str
    step: int
    ts: str
    model_intent_id: str | None
    decision: DecisionKind | None
    history_message: Message | None = None
    feedback: str | None = None
    model_output_text: str | None = None
    visible_output_chars: int = 0
    observations: tuple[str, ...] = ()
    observation_images: tuple[tuple[ImageRef, ...], ...] = ()
    observation_truncated_chars: int = 0
    task_completed: bool = False
    action_result_ids: tuple[str, ...] = ()
    env_error: bool = False
    active_s: float = 0.0
    output: JSONValue = None
    repairs: tuple[str, ...] = ()


@attrs.frozen(kw_only=True)
class Totals:
    """Run totals, derived from the log.

    Attributes:
        steps: completed steps.
        model_attempts: every attempt (abandoned and failed included).
        input_tokens / output_tokens: sums of reported usage; ``None`` when no attempt
            reported it.
        unknown_usage_attempts: attempts that reported no count of tokens (neither input,
            output nor a total; a child run's included, docs/child-runs.md "Budgets").
        active_s: active seconds (excluding approval waits).
        other_tokens: tokens reported in totals beyond their input and output tokens (all of
            a total a server reports without its parts, `Usage.known_total`); ``None`` when
            no attempt reported such a total. The token budget counts
            ``input_tokens + output_tokens + other_tokens``.
    """

    steps: int = 0
    model_attempts: int = 0
    input_tokens: int | None = None
    output_tokens: int | None = None
    unknown_usage_attempts: int = 0
    active_s: float = 0.0
    other_tokens: int | None = None


@attrs.frozen(kw_only=True)
class RunFinished:
    """Last record of a run (barrier before the caller is answered).

    Attributes:
        state: succeeded, failed or cancelled.
        stop_reason: which rule of docs/concepts.md, "Stop reasons" ended it.
        final_answer: the model's final answer, when it gave one.
        error: the kind of failure for failed runs (a model error's kind, e.g.
            ``rate_limited``), else ``None``.
        model_error: the model call's failure in full when a model error ended the run: kind,
            provider message (credentials removed), HTTP status, retryability.
        output: the validated structured output as JSON data (an object) when the run's
            agent has an output type and the run ended with a final answer, else ``None``
            (docs/structured-output.md).
        sink_drops: events the finishing process dropped for sinks that fell behind.
        sink_failures: sink deliveries that raised in the finishing process.
        subscriber_drops: live subscribers cut off for falling behind.

    The three delivery counters cover the process that finished the run, up to this record
    (docs/concepts.md, "Actors": a slow or failing sink never stalls a run, it is counted instead).
    """

    run_id: str
    ts: str
    state: RunState
    stop_reason: StopReason
    totals: Totals
    final_answer: str | None = None
    error: str | None = None
    model_error: ModelErrorInfo | None = None
    output: JSONValue = None
    sink_drops: int = 0
    sink_failures: int = 0
    subscriber_drops: int = 0


@attrs.frozen(kw_only=True)
class CancelRequested:
    """A durable cancel request.

    In a run's log it is written by the run's driver (the lease holder). Another process
    appends it to the run's control stream instead (`treadle.ports.ControlStream`), and the
    driver copies it into the log.

    Attributes:
        surrogates_replaced: surrogate code points replaced (a lone one by U+FFFD) in
            the reason and the canceller, so the log holds valid Unicode only
            (docs/crash-safety.md, "Text that is not Unicode").
    """

    run_id: str
    ts: str
    reason: str = ""
    canceller: str = ""
    surrogates_replaced: int = 0


@attrs.frozen(kw_only=True)
class ApprovalRequested:
    """A tool call waits for a human decision.

    Attributes:
        arguments_digest: `treadle.approvals.arguments_digest` of the model's arguments,
            keyed with a random key kept nowhere when some are secret
            (`treadle.approvals.request_digest`); a decision must name it.
        deadline_ts: when the wait ends without a decision (ISO-8601).
        arguments: the arguments the call would run with, as the model sent them; secret
            ones are redacted on every path out of the log (docs/events.md, "Secret
            arguments"). ``None`` in logs written before requests carried them.
    """

    run_id: str
    step: int
    call_id: str
    tool: str
    arguments_digest: str
    ts: str
    deadline_ts: str
    arguments: Mapping[str, JSONValue] | None = None


@attrs.frozen(kw_only=True)
class ChildrenAwaited:
    """The run parks while tool calls of its step wait on child runs queued in a fleet.

    Written (a barrier) by a run driven by a fleet worker when every call still running in
    its step waits on a queued child run and every call of the step is ``safe`` to replay:
    the worker then releases the run's lease and frees its slot. The run is claimable again
    when one of the children finishes (the child's driver wakes it) or at ``recheck_ts``,
    whichever comes first; its resume replays the step's calls, which find their children
    (docs/child-runs.md, "In a fleet").

    Attributes:
        step: the step whose calls wait.
        intent_ids: the action intents of the waiting calls.
        children: the child run of each, in the same order.
        active_s: active seconds of the step when it parked; the step's active time goes on
            while the run is parked (the children's time is the parent's).
        recheck_ts: when the run is claimable again even if no child woke it (ISO-8601).
    """

    run_id: str
    step: int
    ts: str
    intent_ids: tuple[str, ...]
    children: tuple[str, ...]
    active_s: float
    recheck_ts: str


@attrs.frozen(kw_only=True)
class ApprovalDecided:
    """A human decision on a pending tool call; ``decision`` is approve, reject or edit.

    Attributes:
        arguments_digest: the digest of the request it answers (of the model's arguments).
        message: a rejection's message (shown to the model).
        edited_arguments: an edit's arguments: they replace the model's whole argument
            object (docs/events.md, "Human approval").
        tool: the tool of the call (``""`` in logs written before decisions carried it, and
            in JSONL files begun in format 1 or 2: docs/crash-safety.md, "Versions").
        surrogates_replaced: surrogate code points replaced (a lone one by U+FFFD) in
            the message and the edited arguments, so the log holds valid Unicode only
            (docs/crash-safety.md, "Text that is not Unicode").
    """

    run_id: str
    step: int
    call_id: str
    arguments_digest: str
    decision: str
    ts: str
    message: str = ""
    edited_arguments: Mapping[str, JSONValue] | None = None
    tool: str = ""
    surrogates_replaced: int = 0


@attrs.frozen(kw_only=True)
class DefinitionAccepted:
    """The run goes on under a changed agent definition, accepted deliberately.

    Written (a barrier) when a run is resumed with ``accept_definition_change=True`` (``treadle
    resume --accept-changed-definition``) and the definition's snapshot differs from the one
    the run was started (or last accepted) under; without the flag the resume is refused
    (`treadle.SnapshotMismatch`). Later resumes compare with this snapshot (docs/fleet.md,
    "Deploys").

    Attributes:
        run_id: the run.
        ts: UTC instant, ISO-8601.
        changed: the snapshot keys that differ, sorted.
        snapshot: the accepted snapshot, in full.
        agent_version: the accepted definition's version label.
        accepted_by: who accepted it (the lease owner id of the driver that wrote it).
    """

    run_id: str
    ts: str
    changed: tuple[str, ...]
    snapshot: Mapping[str, JSONValue]
    agent_version: str | None = None
    accepted_by: str = ""


Record: TypeAlias = (
    RunStarted
    | ModelIntent
    | ModelResult
    | ActionIntent
    | ActionResult
    | StepRecord
    | RunFinished
    | CancelRequested
    | ApprovalRequested
    | ApprovalDecided
    | DefinitionAccepted
    | ChildrenAwaited
)
"""Every log record, a closed union (serialised with a ``kind`` tag)."""

ControlRecord: TypeAlias = (
    CancelRequested | ApprovalRequested | ApprovalDecided | DefinitionAccepted | ChildrenAwaited
)
"""The records of `treadle.ports.RunStore.write_control` (barriers outside the step pattern)."""


@attrs.frozen(kw_only=True)
class RunLog:
    """The whole log of one run, as read back from a store.

    A run that does not exist reads as ``RunLog(run_id=...)`` with ``started is None``.

    Attributes:
        records: every record in write order (seq order); ``records[i]`` has seq ``i + 1``.
    """

    run_id: str
    records: tuple[Record, ...] = ()

    @property
    def started(self) -> RunStarted | None:
        """The run-started record, or ``None`` for a run that does not exist."""
        first = self.records[0] if self.records else None
        return first if isinstance(first, RunStarted) else None

    @property
    def finished(self) -> RunFinished | None:
        """The run-finished record, or ``None`` while the run is unfinished."""
        for record in reversed(self.records):
            if isinstance(record, RunFinished):
                return record
        return None

    @property
    def steps(self) -> tuple[StepRecord, ...]:
        """The step records, in step order."""
        return tuple(r for r in self.records if isinstance(r, StepRecord))


# --------------------------------------------------------------------------- leases, control, index


@attrs.frozen(kw_only=True)
class Lease:
    """The lease on one run: who may write its log now (docs/fleet.md, "Leases").

    Instants are seconds since the Unix epoch on the store's clock (PostgreSQL's ``now()``;
    the machine's wall clock for SQLite and JSONL), never trio time.

    Attributes:
        run_id: the run.
        owner: the holder: ``host:pid:random`` (`treadle.stores.lease_owner`).
        generation: the fencing generation: 1 for the first holder, one more at every
            takeover by another owner. Every write of the run carries it; the store refuses
            a write whose generation is not the current one.
        expires_at: when the lease lapses unless renewed (epoch seconds, store clock).
        heartbeat_at: when it was last acquired or renewed (epoch seconds, store clock).
    """

    run_id: str
    owner: str
    generation: int
    expires_at: float
    heartbeat_at: float


@attrs.frozen(kw_only=True)
class ControlEntry:
    """One record of a run's control stream (cancel requests and approval decisions).

    Attributes:
        run_id: the run.
        position: 1-based position in the run's control stream (gapless, in write order).
        record: the request or decision.
    """

    run_id: str
    position: int
    record: CancelRequested | ApprovalDecided


class Liveness(enum.StrEnum):
    """Who drives a run, as a run index reports it (docs/fleet.md, "Liveness").

    DRIVEN: a live lease holder drives it. PARKED: it waits for an approval, or on child
    runs, with nobody holding its lease (a decision or its deadline makes it claimable; a
    child's end or the recheck instant, docs/child-runs.md "In a fleet"). QUEUED: submitted,
    never started. ORPHANED: unfinished, and its driver's lease expired or was released
    without finishing it. QUARANTINED: its drivers kept dying; only an explicit release
    makes it claimable again. FINISHED: it has its run-finished record.
    """

    DRIVEN = "driven"
    PARKED = "parked"
    QUEUED = "queued"
    ORPHANED = "orphaned"
    QUARANTINED = "quarantined"
    FINISHED = "finished"


@attrs.frozen(kw_only=True)
class RunSummary:
    """One run as a run index lists it, without reading its log in full.

    Attributes:
        run_id: the run.
        state: the state its log (or queue entry) shows; ``None`` when unreadable.
        liveness: who drives it (judged at ``observed_at``).
        observed_at: the store clock's instant the listing was taken (epoch seconds).
        lease: the lease, when one was ever taken (a released one has ``owner == ""``).
        agent: the agent name (fleet runs), else ``None``.
        agent_version: the agent definition's version, when recorded.
        steps: step records written so far.
        stop_reason: why it ended, once finished.
        started_at: the run-started instant (ISO-8601 UTC), ``None`` while queued.
        submitted_at: when it was submitted to a fleet's queue (epoch seconds), else ``None``.
        claims: how often a fleet worker claimed it.
        takeovers: claims of it after its driver died (the lease expired unreleased).
        quarantined: why it was quarantined, or ``None``.
        awaiting_until: approval deadline while it waits on a human (ISO-8601), else ``None``.
        error: why the run cannot be read (a damaged or too-new log), else ``None``.
        where: the file or table holding it, for error reports.
        records: the records its log holds (the last seq), when the index knows that without
            reading the log; else ``None`` (an unreadable run). A reader polling a run reads
            its log again only when this moves (docs/ui.md, "A run's page").
    """

    run_id: str
    state: RunState | None
    liveness: Liveness
    observed_at: float
    lease: Lease | None = None
    agent: str | None = None
    agent_version: str | None = None
    steps: int = 0
    stop_reason: StopReason | None = None
    started_at: str | None = None
    submitted_at: float | None = None
    claims: int = 0
    takeovers: int = 0
    quarantined: str | None = None
    awaiting_until: str | None = None
    error: str | None = None
    where: str | None = None
    records: int | None = None

    @property
    def heartbeat_age_s(self) -> float | None:
        """Seconds since the lease holder last renewed, or ``None`` without a holder."""
        if self.lease is None or not self.lease.owner:
            return None
        return max(0.0, self.observed_at - self.lease.heartbeat_at)


@attrs.frozen(kw_only=True)
class Submission:
    """A run submitted to a fleet's queue, kept apart from the run's log.

    Attributes:
        run_id: the run's id.
        agent: the name of the agent (a factory every serving worker registers).
        input: the run input as messages.
        submitted_at: epoch seconds on the store's clock.
        caps: for a child run, the bounds its parent's remaining budgets put on its own;
            the run's run-started record keeps them (docs/child-runs.md, "Budgets").
        parent_run_id: for a child run, the run whose tool call queued it.
        parent_intent_id: for a child run, the parent's action intent it serves.
    """

    run_id: str
    agent: str
    input: tuple[Message, ...]
    submitted_at: float
    caps: BudgetCaps | None = None
    parent_run_id: str | None = None
    parent_intent_id: str | None = None


@attrs.frozen(kw_only=True)
class Claim:
    """A run a worker claimed from a fleet's queue: it now holds the run's lease.

    Attributes:
        lease: the lease the claim took (a takeover has the previous generation + 1).
        agent: the name of the run's agent.
        submission: the queue entry of a run never started, else ``None``.
        takeover: the previous holder's lease expired without release (its driver died).
    """

    lease: Lease
    agent: str
    submission: Submission | None = None
    takeover: bool = False


# --------------------------------------------------------------------------- events


class EventKind(enum.StrEnum):
    """Kinds of run events.

    Durable kinds mirror log records. ``step_started`` is derived from the log (it precedes
    the first model intent of each step), so it is there after a restart too. Deltas are
    ephemeral (docs/decisions/0008). ``run_left`` goes to sinks only, once, when this process
    stops feeding them a run it did not finish (docs/events.md, "Sinks and subscribers never
    stall a run").
    """

    RUN_STARTED = "run_started"
    STEP_STARTED = "step_started"
    MODEL_CALL_STARTED = "model_call_started"
    MODEL_CALL_FINISHED = "model_call_finished"
    ACTION_REQUESTED = "action_requested"
    ACTION_FINISHED = "action_finished"
    STEP_COMPLETED = "step_completed"
    APPROVAL_REQUESTED = "approval_requested"
    APPROVAL_DECIDED = "approval_decided"
    CHILDREN_AWAITED = "children_awaited"
    CANCEL_REQUESTED = "cancel_requested"
    DEFINITION_ACCEPTED = "definition_accepted"
    RUN_FINISHED = "run_finished"
    TEXT_DELTA = "text_delta"
    REASONING_DELTA = "reasoning_delta"
    WARNING = "warning"
    RUN_LEFT = "run_left"


@attrs.frozen(kw_only=True)
class Event:
    """One run event.

    Attributes:
        run_id: the run.
        seq: for durable events, the gapless per-run sequence number (1, 2, 3 ...), equal to
            the record's position in the log. A step-started event or an ephemeral delta
            carries the seq of the durable event it follows and its own ``ordinal``.
        kind: the event kind.
        record: the log record for durable events; ``None`` for step-started events, deltas,
            warnings and run-left events.
        text: delta or warning text; for a run-left event, why the drive here stopped
            (``drained``, ``parked``, ``interrupted``, ``finished_elsewhere``), or
            ``cut_off`` for a sink cut off before the end of its buffer.
        ordinal: 0 for durable events; 1, 2, ... for the events after the same durable seq
            (a step-started event is always 1: it directly follows the previous step's
            record).
        step: the step a step-started event opens; ``None`` for the other kinds.
    """

    run_id: str
    seq: int
    kind: EventKind
    record: Record | None = None
    text: str | None = None
    ordinal: int = 0
    step: int | None = None

    @property
    def durable(self) -> bool:
        """True for events that mirror a log record."""
        return self.record is not None


@attrs.frozen(kw_only=True)
class RunResult:
    """What a finished run returns to its caller.

    Attributes:
        run_id: the run.
        state: succeeded, failed or cancelled.
        stop_reason: the rule of docs/concepts.md, "Stop reasons" that ended the run.
        final_answer: the model's final answer text, when it gave one.
        totals: steps, attempts, tokens and active time, derived from the log.
        error: the kind of failure for failed runs (e.g. ``connection``), else ``None``.
        model_error: when a model error ended the run, the failure in full: ``kind``,
            ``message`` (the provider's, credentials removed), ``status`` (HTTP, ``None`` for
            transport failures) and ``retryable``.
        output: the structured output of a run whose agent has an output type and that
            ended with a final answer: an instance of the attrs class when the result was
            built knowing the class (`treadle.run`, `treadle.open_run`), else its JSON data
            (a dict, e.g. read back from a store by `treadle.wait_result`); ``None``
            otherwise (docs/structured-output.md, "Where the type is known").
    """

    run_id: str
    state: RunState
    stop_reason: StopReason
    totals: Totals
    final_answer: str | None = None
    error: str | None = None
    model_error: ModelErrorInfo | None = None
    output: Any = None

    @classmethod
    def from_finished(cls, record: RunFinished, *, output_type: Any = None) -> RunResult:
        """Build the result from a stored run-finished record.

        Args:
            record: the run-finished record.
            output_type: the agent's output type; when it is an attrs class, the stored
                output is structured into an instance of it. Anything else (a JSON schema,
                ``None``) leaves the output as its JSON data.

        Raises:
            UsageError: the stored output does not fit ``output_type`` (the message lists
                each error with its path).
        """
        output = record.output
        if output is not None and isinstance(output_type, type) and attrs.has(output_type):
            # Loaded here: this module depends on nothing else in the package at import.
            from treadle._output import structure_output

            output = structure_output(output_type, output, run_id=record.run_id)
        return cls(
            run_id=record.run_id,
            state=record.state,
            stop_reason=record.stop_reason,
            totals=record.totals,
            final_answer=record.final_answer,
            error=record.error,
            model_error=record.model_error,
            output=output,
        )
