"""The agent definition: everything that assembles a run (docs/concepts.md).

`Agent` holds the five seams' implementations plus plain settings. Its parameter snapshot
(`Agent.snapshot`) is the merged, model-visible part of it; it is stored in run-started and
compared on resume (docs/crash-safety.md, "Resume").
"""

from __future__ import annotations

import hashlib
import inspect
import json
from collections.abc import Mapping, Sequence
from typing import Any, Final

import attrs
import cattrs

from treadle._budget import DEFAULT_SUMMARY_PROMPT, TokenCounter
from treadle._exceptions import SnapshotMismatch, UsageError
from treadle._output import OutputMode, OutputSpec
from treadle._output import resolve as resolve_output
from treadle.approvals import ApprovalPolicy, policy_name
from treadle.policies import ExecutorPolicies, policies_of
from treadle.ports import ActionExecutor, DecisionParser, ModelClient
from treadle.redaction import SNAPSHOT_KEY, secrets_of_tools
from treadle.types import (
    Budgets,
    ImageRef,
    JSONValue,
    Limits,
    Message,
    RunStarted,
    SyntheticObservations,
    ToolSpec,
)

_PLAIN = cattrs.Converter()

_SEAM_METHODS: dict[str, tuple[str, ...]] = {
    "model": ("complete",),
    "executor": ("tool_specs", "execute"),
    "parser": ("parse",),
    "summariser": ("complete",),
}
"""The methods an agent's seams are checked for when it is built (the whole Protocols are
in docs/seams.md; `treadle.testing.contracts` checks what they do)."""

_TEXT_FIELDS: tuple[str, ...] = (
    "model_name",
    "system_prompt",
    "observation_template",
    "version",
    "summary_model",
    "summary_prompt",
)
_OPTIONAL_TEXT: frozenset[str] = frozenset(
    {"system_prompt", "version", "summary_model", "summary_prompt"}
)


@attrs.frozen(kw_only=True)
class Agent:
    """An agent definition.

    Attributes:
        model: the model client (seam 1); one call is one HTTP attempt.
        executor: the action executor (seam 3), e.g. a `treadle.tools.Toolbox`, or several
            executors' tools as one with `treadle.combine_tools` (docs/concepts.md,
            "Several tool sources").
        parser: the decision parser (seam 2).
        model_name: the provider's model name, sent with every request.
        system_prompt: the system message, element 0 of every request; ``None`` for none.
        max_output_tokens: the output-token cap sent with every request (never raised by a
            request); ``None`` leaves it to the provider.
        params: other sampling parameters in the provider's own form (``temperature``,
            ``reasoning_effort`` ...).
        budgets: the four run budgets (docs/concepts.md, "Stop reasons").
        limits: per-call limits, seconds.
        synthetic: the synthetic observation texts (part of the snapshot).
        observation_template: how an executed action's observation enters history;
            ``{observation}`` and ``{tool}`` are substituted.
        version: the definition's version label, recorded in run-started; ``None`` derives
            one from the snapshot (`version_label`). A fleet worker claims only runs of the
            versions it serves (docs/fleet.md, "Deploys").
        output_type: the shape of the final answer: an attrs class (whose fields use the
            types tool arguments may use), or a JSON schema (a mapping, 2020-12) whose top
            level is an object; ``None`` (the default) for a free-text answer. The final
            answer is validated against it, and `treadle.RunResult.output` holds it
            (docs/structured-output.md).
        output_mode: how the output is asked for: ``"native"`` (the provider's structured
            output, e.g. OpenAI ``response_format``), ``"tool"`` (a declared ``final_answer``
            tool whose arguments are the output), or ``"auto"`` (the default: native when
            the model client declares ``native_output = True``, as `treadle.OpenAIChatClient`
            does, else the tool). Ignored without ``output_type``.
        approval_policy: ``policy(tool, arguments) -> bool``: the calls it selects wait for a
            human decision, as do those of tools declared ``requires_approval=True``
            (docs/events.md, "Human approval"); ``None`` selects none. A part of the
            definition: its name (`treadle.approvals.policy_name`) is in the parameter
            snapshot, so a resume, ``treadle resume`` and a fleet's worker go on under it,
            and a definition without it is refused (`SnapshotMismatch`).

    Raises:
        UsageError: a part of the wrong kind (a seam without its methods, budgets or limits
            that are not `Budgets` or `Limits`, params that are not JSON data, a text field
            that is not a ``str``), params the model client refuses (its optional
            ``check_params``: a param that would replace a key the client sets itself, such
            as ``stream``, or one the client cannot send, such as an Anthropic ``max_tokens``
            that is no positive integer; docs/models.md, "What goes on the wire", "Output
            cap"), an ``output_type`` or ``output_mode`` that cannot be used (see
            docs/structured-output.md, "Output types"), or a parser's ``text_reply_tool``
            whose call the executor refuses (`_check_text_reply_tool`).
    """

    model: ModelClient
    executor: ActionExecutor
    parser: DecisionParser
    model_name: str = ""
    system_prompt: str | None = None
    max_output_tokens: int | None = None
    params: Mapping[str, JSONValue] = attrs.field(factory=dict)
    budgets: Budgets = Budgets()
    limits: Limits = Limits()
    synthetic: SyntheticObservations = SyntheticObservations()
    observation_template: str = "{observation}"
    version: str | None = None
    output_type: type[Any] | Mapping[str, JSONValue] | None = None
    output_mode: OutputMode = "auto"
    context_window: int | None = None
    context_margin: int | None = None
    summariser: ModelClient | None = None
    summary_model: str | None = None
    summary_prompt: str | None = None
    token_counter: TokenCounter | None = None
    approval_policy: ApprovalPolicy | None = None
    _output: OutputSpec | None = attrs.field(
        init=False,
        repr=False,
        eq=False,
        default=attrs.Factory(lambda self: self._resolve_output(), takes_self=True),
    )
    _policies: ExecutorPolicies = attrs.field(
        init=False,
        repr=False,
        eq=False,
        default=attrs.Factory(lambda self: policies_of(self.executor), takes_self=True),
    )

    def __attrs_post_init__(self) -> None:
        _check_takes_attempt("model", self.model)
        _check_text_reply_tool(self.parser, self._policies)
        native = self._output is not None and self._output.mode == "native"
        _check_params(self.model, self.params, output=native)
        if self.summariser is not None:
            _check_takes_attempt("summariser", self.summariser)
        for name, least in (("max_output_tokens", 1), ("context_window", 1), ("context_margin", 0)):
            value = getattr(self, name)
            if value is not None and (
                not isinstance(value, int) or isinstance(value, bool) or value < least
            ):
                raise UsageError(
                    f"Agent.{name} must be None or a whole number of tokens of {least} or "
                    f"more, not {value!r}"
                )
        if self.context_window is None:
            return
        if self.input_budget <= 0:
            raise UsageError(
                f"context_window={self.context_window} leaves no room for input once "
                f"max_output_tokens={self.max_output_tokens} and a margin of "
                f"{self.margin_tokens} tokens are set aside"
            )

    def _check_parts(self) -> None:
        """Refuse a part of the wrong kind when the agent is built, not inside its first run.

        A run of an agent with ``model=None`` or ``budgets={...}`` was started, written to the
        store, and interrupted by an `AttributeError` at its first step, at every resume.

        Raises:
            UsageError: names the part and what it must be.
        """
        for name, methods in _SEAM_METHODS.items():
            part = getattr(self, name)
            if part is None and name == "summariser":
                continue
            missing = [m for m in methods if not callable(getattr(part, m, None))]
            if missing:
                raise UsageError(
                    f"Agent.{name} must have {' and '.join(f'{m}()' for m in methods)} "
                    f"(docs/seams.md), not {type(part).__name__} {part!r:.80}"
                )
        for name, kind in (
            ("budgets", Budgets),
            ("limits", Limits),
            ("synthetic", SyntheticObservations),
        ):
            if not isinstance(getattr(self, name), kind):
                raise UsageError(
                    f"Agent.{name} must be a treadle.{kind.__name__}, "
                    f"not {type(getattr(self, name)).__name__}"
                )
        for name in _TEXT_FIELDS:
            value = getattr(self, name)
            if not (isinstance(value, str) or (value is None and name in _OPTIONAL_TEXT)):
                wanted = "a str or None" if name in _OPTIONAL_TEXT else "a str"
                raise UsageError(f"Agent.{name} must be {wanted}, not {value!r:.80}")
        if self.approval_policy is not None and not callable(self.approval_policy):
            raise UsageError(
                "Agent.approval_policy must be None or a function of (tool, arguments) "
                f"returning a bool, not {self.approval_policy!r:.80}"
            )
        if not isinstance(self.params, Mapping):
            raise UsageError(f"Agent.params must be a mapping, not {type(self.params).__name__}")
        try:
            json.dumps(self.params, allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise UsageError(f"Agent.params must be JSON data: {exc}") from None

    @property
    def margin_tokens(self) -> int:
        """The safety margin in tokens (0 without a context window)."""
        if self.context_window is None:
            return 0
        if self.context_margin is not None:
            return self.context_margin
        return max(64, self.context_window // 32)

    @property
    def input_budget(self) -> int:
        """Input tokens a request may use: window less output cap and margin (docs/context.md)."""
        if self.context_window is None:
            return 0
        return self.context_window - (self.max_output_tokens or 0) - self.margin_tokens

    def _resolve_output(self) -> OutputSpec | None:
        self._check_parts()  # the first thing __init__ computes from the parts
        if self.output_type is None:
            return None
        native = getattr(self.model, "native_output", None)
        return resolve_output(
            self.output_type,
            self.output_mode,
            native_client=None if native is None else bool(native),
            tool_names=frozenset(spec.name for spec in self.executor.tool_specs()),
            text_reply_tool=getattr(self.parser, "text_reply_tool", None),
        )

    @property
    def tool_policies(self) -> ExecutorPolicies:
        """The executor's `treadle.ports.ToolPolicies`, looked up once (`policies_of`).

        What the run's actors, its supervisor and the snapshot ask about the tools: approval,
        secret arguments, argument checks, timeouts, written resources, images
        (docs/seams.md, "Action executor").
        """
        return self._policies

    @property
    def output(self) -> OutputSpec | None:
        """The resolved output type (mode, schema, validator), ``None`` without one."""
        return self._output

    def model_tools(self) -> tuple[ToolSpec, ...]:
        """The tools the model sees: the executor's, then the final-answer tool in ``tool`` mode."""
        tools = tuple(self.executor.tool_specs())
        answer = self._output.tool_spec() if self._output is not None else None
        return tools if answer is None else (*tools, answer)

    @property
    def version_label(self) -> str:
        """``version``, or ``snap-`` and 12 hex digits of the snapshot's SHA-256."""
        if self.version is not None:
            return self.version
        canonical = json.dumps(self.snapshot(), sort_keys=True, separators=(",", ":"))
        return "snap-" + hashlib.sha256(canonical.encode("utf-8", "surrogatepass")).hexdigest()[:12]

    def snapshot(self) -> dict[str, JSONValue]:
        """The parameter snapshot: the model-visible settings, as plain JSON data.

        Keys: ``model``, ``system_prompt``, ``max_output_tokens``, ``params``, ``tools``,
        ``parser``, ``synthetic``, ``observation_template``; ``output`` (mode, name, schema,
        strict, description) only when ``output_type`` is set, so the snapshot of an agent
        without one is what it always was; ``context`` (window, margin, summary model and
        prompt) only when ``context_window`` is set; ``approval_policy`` (its name,
        `treadle.approvals.policy_name`) only when one is set; and ``secret_arguments`` when
        a tool has secret arguments (`treadle.redaction`; an executor declares them with an
        optional ``secret_arguments(tool)`` method, as `treadle.Toolbox` does; both are
        read from `tool_policies`). The
        ``stale`` synthetic text is in ``synthetic`` only when a tool writes a resource (an
        executor tells with an optional ``writes(tool)`` method returning the tool's key
        template or ``None``, as `treadle.Toolbox` does), so agents without one keep the
        snapshot they had before that text existed (docs/concepts.md, "Stale writes"). Budgets and
        limits are not model-visible and are left out, so a run can be resumed with other
        budgets. Credentials never appear here (clients hold them, and clients are not
        snapshotted).
        """
        specs = self.executor.tool_specs()
        snapshot: dict[str, JSONValue] = {
            "model": self.model_name,
            "system_prompt": self.system_prompt,
            "max_output_tokens": self.max_output_tokens,
            "params": dict(self.params),
            "tools": [_PLAIN.unstructure(spec) for spec in specs],
            "parser": type(self.parser).__qualname__,
            "synthetic": _synthetic(self.synthetic, self._policies, specs),
            "observation_template": self.observation_template,
        }
        if self._output is not None:
            snapshot["output"] = self._output.snapshot()
        if self.context_window is not None:
            snapshot["context"] = {
                "window": self.context_window,
                "margin": self.margin_tokens,
                "summary_model": self.summary_model,
                "summary_prompt": self.summary_prompt or DEFAULT_SUMMARY_PROMPT,
            }
        if self.approval_policy is not None:
            snapshot["approval_policy"] = policy_name(self.approval_policy)
        secrets = _secret_arguments(self._policies, specs)
        if secrets:
            snapshot[SNAPSHOT_KEY] = secrets
        return snapshot


def _synthetic(
    synthetic: SyntheticObservations, policies: ExecutorPolicies, specs: Sequence[ToolSpec]
) -> dict[str, JSONValue]:
    """The synthetic texts as snapshotted: ``stale`` only when a tool writes a resource."""
    texts: dict[str, JSONValue] = _PLAIN.unstructure(synthetic)
    if not any(policies.writes(spec.name) for spec in specs):
        del texts["stale"]
    return texts


def _secret_arguments(
    policies: ExecutorPolicies, specs: Sequence[ToolSpec]
) -> dict[str, JSONValue]:
    """``{tool: [secret argument names]}`` from the executor's ``secret_arguments``."""
    if "secret_arguments" not in policies.declared:
        return {}
    return secrets_of_tools((spec.name, policies.secret_arguments(spec.name)) for spec in specs)


_TEXT_REPLY_PROBE: Final = "Hello."
"""The text of the call the executor is asked about for a parser's text-reply tool."""


def _check_text_reply_tool(parser: object, policies: ExecutorPolicies) -> None:
    """Refuse a parser's ``text_reply_tool`` that the executor would refuse every call of.

    Such a parser makes every text reply a call of that tool with ``{"content": <text>}``
    (docs/decisions/0006-text-reply-as-action.md). The executor's ``invalid_arguments`` is
    asked about such a call, of the text `_TEXT_REPLY_PROBE` (`treadle.Toolbox` answers:
    an unknown tool, arguments its signature refuses); an executor without one is not
    asked, and a tool the model is not offered may be the text-reply tool
    (docs/decisions/0125-a-text-reply-tool-is-checked-when-the-agent-is-built.md). Left
    unchecked, every answer of the model was NOT_EXECUTED and the run spent its steps.

    Raises:
        UsageError: naming the tool and the executor's reason.
    """
    name = getattr(parser, "text_reply_tool", None)
    if name is None:
        return
    problem = policies.invalid_arguments(name, {"content": _TEXT_REPLY_PROBE})
    if problem is None:
        return
    raise UsageError(
        f"the parser makes every text reply a call of {name!r} with "
        f'{{"content": <the text>}} (text_reply_tool), and the executor refuses such a call: '
        f"{problem}. Give the executor a tool {name!r} whose one required argument is the "
        "str content, or name such a tool in text_reply_tool"
    )


def _check_params(client: object, params: Mapping[str, JSONValue], *, output: bool) -> None:
    """Ask the model client whether it takes ``params``, when the agent is built.

    A client that sets some request keys itself says so with an optional
    ``check_params(params, *, output)`` method, the rule it applies to every request (as
    `treadle.OpenAIChatClient` and `treadle.AnthropicMessagesClient` do). Asked only at the
    first model call, such params left a run started and orphaned, with an attempt recorded
    at every resume though nothing was sent (docs/models.md, "What goes on the wire").

    Args:
        client: the agent's model client.
        params: the agent's params (already checked to be JSON data).
        output: the agent's output is asked for natively (every request has an ``output``).

    Raises:
        UsageError: whatever the client's ``check_params`` raises for these params.
    """
    check = getattr(client, "check_params", None)
    if callable(check):
        check(params, output=output)


def _check_takes_attempt(role: str, client: object) -> None:
    """Refuse a model client whose ``complete`` cannot take the ``attempt`` argument.

    The model gateway passes ``attempt=`` to every call (docs/seams.md, "Model client");
    a client written before it did would otherwise fail inside the run, on its first call.

    Raises:
        UsageError: ``complete`` has neither an ``attempt`` parameter nor ``**kwargs``.
    """
    complete = getattr(client, "complete", None)
    if complete is None:
        return  # not a model client at all: the first call says so
    try:
        parameters = inspect.signature(complete).parameters
    except (TypeError, ValueError):
        return
    if "attempt" in parameters or any(
        p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()
    ):
        return
    raise UsageError(
        f"the {role}'s complete() takes no attempt argument: a model client is handed each "
        "attempt's deadlines, usage observer and image source as "
        "complete(request, *, on_delta=None, attempt=Attempt.STANDALONE) (treadle.types.Attempt; "
        'docs/seams.md, "Model client")'
    )


def tool_names(snapshot: Mapping[str, JSONValue]) -> frozenset[str] | None:
    """The names of the tools a parameter snapshot lists (``None`` when it lists none)."""
    specs = snapshot.get("tools")
    if not isinstance(specs, list):
        return None
    return frozenset(
        name
        for spec in specs
        if isinstance(spec, Mapping) and isinstance(name := spec.get("name"), str)
    )


def snapshot_diff(stored: Mapping[str, JSONValue], current: Mapping[str, JSONValue]) -> list[str]:
    """The sorted keys whose values differ between two snapshots (a missing key differs)."""
    keys = set(stored) | set(current)
    return sorted(k for k in keys if _normalise(stored.get(k)) != _normalise(current.get(k)))


def check_snapshot(
    run_id: str, stored: Mapping[str, JSONValue], current: Mapping[str, JSONValue]
) -> None:
    """Refuse to resume ``run_id`` with a different definition.

    Raises:
        SnapshotMismatch: naming every differing key.
    """
    differing = snapshot_diff(stored, current)
    if differing:
        raise SnapshotMismatch(run_id, differing, note=policy_change(stored, current))


def policy_change(stored: Mapping[str, JSONValue], current: Mapping[str, JSONValue]) -> str:
    """What a change of approval policy between two snapshots means, in words (``""``: none).

    The snapshot holds the policy's name (key ``approval_policy``, `Agent.snapshot`). A run
    goes on under the policy it was started with; one resumed without it would run the
    calls it selects without a human (docs/events.md, "Human approval").
    """
    was, now = stored.get("approval_policy"), current.get("approval_policy")
    if was == now:
        return ""
    if was is None:
        return f"the run was started with no approval policy; this definition has {now!r}"
    gives = (
        "give the definition that policy (Agent(approval_policy=...), or approval_policy= "
        "of open_run or run)"
    )
    if now is None:
        return (
            f"the run was started under the approval policy {was!r} and this definition has "
            f"none: the calls it selects would run without a human; {gives}"
        )
    return f"the run was started under the approval policy {was!r}, not {now!r}; {gives}"


def _normalise(value: Any) -> Any:
    """Tuples and lists compare equal (a JSON round trip turns one into the other)."""
    if isinstance(value, Mapping):
        return {k: _normalise(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_normalise(v) for v in value]
    return value


RunInput = str | Message | Sequence[Message]
"""What a run is started on: a text, one user message, or several messages."""


def input_messages(value: RunInput) -> tuple[Message, ...]:
    """Normalise a run input into messages, oldest first.

    Raises:
        UsageError: an input of another type, an empty input, or an image given as raw bytes
            instead of an `ImageRef`.
    """
    if isinstance(value, str):
        messages: tuple[Message, ...] = (Message(role="user", content=value),)
    elif isinstance(value, Message):
        messages = (value,)
    elif isinstance(value, Sequence):
        messages = tuple(value)  # type: ignore[arg-type]  # (a str is taken above)
    else:
        raise UsageError(
            "a run's input is a str, a Message or a sequence of Message records, "
            f"not {type(value).__name__} {value!r:.80}"
        )
    if not messages:
        raise UsageError("a run needs a non-empty input")
    for message in messages:
        if not isinstance(message, Message):
            raise UsageError(f"run input items must be Message records, got {type(message)!r}")
        if any(not isinstance(image, ImageRef) for image in message.images):
            raise UsageError("images enter a run as ImageRef references, never as bytes")
    return messages


def check_input(started: RunStarted, input: RunInput | None, *, thread: str | None = None) -> None:
    """Refuse ``input`` when it is not the input the run was started with.

    A run id names one run: the same call again resumes it, or returns its result when it
    finished (docs/concepts.md, "Run ids"); another input under the same id is a mistake.
    For a caller continuing thread ``thread``, the run is the one the thread named next, and
    another input means another caller continued the thread first with its own message
    (docs/threads.md, "When a thread cannot go on"): the message says the thread moved on,
    and that calling again continues it after that run.

    Args:
        started: the stored run-started record.
        input: the input the caller gave.
        thread: the thread the caller continues, when the run was named as its next run.

    Raises:
        UsageError: the input differs (``None`` means "whatever it was", and passes).
    """
    from treadle._text import valid_unicode  # (it imports the record types this module does)

    if input is None or valid_unicode(input_messages(input))[0] == started.input:
        return
    if thread is not None:
        raise UsageError(
            f"thread {thread!r} moved on: its run {started.run_id!r} was started by another "
            "caller with another message; call again to continue the thread after it"
        )
    raise UsageError(
        f"run {started.run_id!r}: the input differs from the stored input (a run id names "
        "one run; give a new run id to start another)"
    )
