"""Contract checks for the model client, decision parser and action executor seams.

Each ``check_*`` function is public so that users who write their own implementation can hold
it to the same contract as ours (docs/seams.md); the run store's contract is
`treadle.testing.contracts.check_run_store`. Every check raises `SeamContractError` (an
`AssertionError`) naming the rule that was broken.
"""

from __future__ import annotations

import inspect
import random
from collections.abc import Sequence

import trio

from treadle._exceptions import ContractViolation, ModelCallError, SeamViolation, UsageError
from treadle._shapes import outcome_problem, reply_problem, usage_problem
from treadle.policies import ExecutorPolicies, policies_of, replay_policy_of
from treadle.ports import ActionExecutor, DecisionParser, ModelClient
from treadle.types import (
    Action,
    ActionOutcome,
    ActionStatus,
    Attempt,
    DecisionKind,
    ImageRef,
    InvalidToolCall,
    Message,
    ModelErrorInfo,
    ModelReply,
    ModelRequest,
    ParsedReply,
    ReplayPolicy,
    ToolCall,
    ToolSpec,
    Usage,
)

__all__ = [
    "SeamContractError",
    "adversarial_replies",
    "check_action_executor",
    "check_decision_parser",
    "check_model_client",
    "check_model_client_deadlines",
]


class SeamContractError(ContractViolation):
    """An implementation broke a seam contract; the message names the rule."""


def _expect(condition: bool, rule: str) -> None:
    if not condition:
        raise SeamContractError(rule)


_TEXTS: tuple[str | None, ...] = (
    None,
    "",
    "   ",
    "The answer is 42.",
    '{"name": "lookup", "arguments": {"q": "x"}}',
    '```json\n{"name": "lookup", "arguments": {"q": "x"}}\n```',
    '{"name": "unknown_tool", "arguments": {}}',
    "{not json",
    "null",
    "[1, 2, 3]",
    "Grüße aus 東京 🌏",
    "x" * 5000,
)
_ARGUMENTS: tuple[str, ...] = (
    "",
    "{}",
    '{"q": "x"}',
    '{"q": "x"}{"q": "y"}',
    "{'q': 'x', 'flag': True}",
    '```json\n{"q": 1}\n```',
    '{"q": "trunc',
    "[]",
    '"a string"',
    "\x00\x01",
)


def adversarial_replies(seed: int = 0, count: int = 200) -> list[ModelReply]:
    """Replies a parser must survive: every text and argument form above, mixed at random.

    Args:
        seed: the random seed (the same seed gives the same list).
        count: how many mixed replies to add to the fixed ones.
    """
    rng = random.Random(seed)
    replies = [ModelReply(text=t, finish_reason="stop") for t in _TEXTS]
    for raw in _ARGUMENTS:
        replies.append(
            ModelReply(
                invalid_tool_calls=(
                    InvalidToolCall(
                        id="c1", name="lookup", raw_arguments=raw, reason="unparseable"
                    ),
                ),
                finish_reason=rng.choice(["tool_calls", "length", None]),
            )
        )
    for _ in range(count):
        calls = tuple(
            ToolCall(
                id=rng.choice(["", "dup", f"c{rng.randrange(99)}"]),
                name=rng.choice(["lookup", "", "unknown_tool", "lookup lookup"]),
                arguments=rng.choice([{}, {"q": "x"}, {"q": None, "n": [1, {"a": 2}]}]),
            )
            for _ in range(rng.randrange(3))
        )
        invalid = tuple(
            InvalidToolCall(
                id=f"i{k}",
                name=rng.choice(["lookup", ""]),
                raw_arguments=rng.choice(_ARGUMENTS),
                reason=rng.choice(["truncated", "unparseable"]),
            )
            for k in range(rng.randrange(2))
        )
        replies.append(
            ModelReply(
                text=rng.choice(_TEXTS),
                reasoning=rng.choice([None, "", "thinking"]),
                tool_calls=calls,
                invalid_tool_calls=invalid,
                finish_reason=rng.choice(["stop", "tool_calls", "length", None, "weird"]),
            )
        )
    return replies


_TOOLS = (
    ToolSpec(
        name="lookup",
        parameters={"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]},
    ),
)


def check_decision_parser(
    parser: DecisionParser,
    *,
    tools: Sequence[ToolSpec] = _TOOLS,
    replies: Sequence[ModelReply] | None = None,
) -> None:
    """Hold ``parser`` to the decision parser contract (docs/seams.md, "Decision parser").

    For every reply (default: `adversarial_replies`) the parser must return a `ParsedReply`
    without raising; ``ACTIONS`` carries at least one action with an id and a mapping of
    arguments; ``INVALID`` carries feedback; the history message is an assistant message whose
    calls all have ids, no two the same, and hold every call of the reply that has an id of
    its own under that id and with its tool (none dropped, renamed, turned into an answer or
    aimed at another tool), a complete call with its arguments too (an ``INVALID`` decision
    may keep them as ``{}``); the actions of ``ACTIONS`` are the history message's calls (the
    same ids, tools and arguments, in order; a history without calls only for calls written
    as text, whose action ids must differ); ``FINAL_ANSWER`` has text (not ``None`` nor
    ``""``: an empty reply is ``INVALID``, as the built-in parsers decide it) and no call in its
    history message (a call it kept would never run nor be answered); and parsing is pure
    (the same reply twice gives equal decisions).

    Raises:
        SeamContractError: naming the broken rule and the reply.
    """
    for reply in replies if replies is not None else adversarial_replies():
        try:
            first = parser.parse(reply, tools)
            second = parser.parse(reply, tools)
        except Exception as exc:
            raise SeamContractError(f"parse raised {exc!r} for {reply!r}") from exc
        _expect(isinstance(first, ParsedReply), f"parse returned {type(first)!r}")
        _expect(first == second, f"parse is not pure for {reply!r}")
        _check_decision(first, reply)


def _check_decision(parsed: ParsedReply, reply: ModelReply) -> None:
    where = f"for {reply!r}"
    history = parsed.history_message
    _expect(history.role == "assistant", f"history message role is {history.role!r} {where}")
    _expect(all(c.id for c in history.tool_calls), f"a history call has no id {where}")
    ids = [c.id for c in history.tool_calls]
    _expect(len(ids) == len(set(ids)), f"history call ids repeat ({ids}) {where}")
    _check_calls_kept(reply, parsed, where)
    if parsed.kind is DecisionKind.ACTIONS:
        _expect(bool(parsed.actions), f"ACTIONS without actions {where}")
        for action in parsed.actions:
            _expect(isinstance(action.arguments, dict), f"action arguments not a dict {where}")
        _check_actions_answer_history(parsed, reply, where)
    elif parsed.kind is DecisionKind.INVALID:
        _expect(bool(parsed.feedback), f"INVALID without feedback {where}")
        _expect(not parsed.actions, f"INVALID with actions {where}")
    else:
        _expect(bool(parsed.text), f"FINAL_ANSWER without text ({parsed.text!r}) {where}")
        _expect(not parsed.actions, f"FINAL_ANSWER with actions {where}")
        _check_no_call_answered_for(parsed, where)
    if reply.finish_reason == "length" and reply.invalid_tool_calls:
        _expect(parsed.kind is not DecisionKind.ACTIONS, f"a truncated call was executed {where}")


def _check_no_call_answered_for(parsed: ParsedReply, where: str) -> None:
    """A final answer's history message holds no call: no call is turned into an answer.

    docs/seams.md, "Decision parser": every call id is kept so each one is answered, by its
    action's observation (``ACTIONS``) or by the feedback (``INVALID``); a final answer
    answers none, so a call it kept would never run nor be answered.
    """
    kept = [call.id for call in parsed.history_message.tool_calls]
    _expect(
        not kept,
        f"FINAL_ANSWER whose history message holds the calls {kept}: the calls are turned "
        f"into an answer, never run nor answered (decide ACTIONS, or INVALID) {where}",
    )


def _check_calls_kept(reply: ModelReply, parsed: ParsedReply, where: str) -> None:
    """Every call of the reply with an id of its own is in the history message, as it was.

    docs/seams.md, "Decision parser": every call id is kept, so each one is answered. A call
    without an id, or whose id another call of the reply shares, may be given a new one; no
    call with its own id may be dropped, renamed, turned into an answer, or made to call
    another tool. A complete call (`ModelReply.tool_calls`) keeps its arguments too, except
    that an invalid decision may keep them as ``{}`` (a call whose arguments cannot be used);
    the arguments of an invalid call are the parser's repair of its raw text.
    """
    history = {c.id: c for c in parsed.history_message.tool_calls}
    calls = [(c.id, c.name) for c in reply.tool_calls] + [
        (c.id, c.name) for c in reply.invalid_tool_calls
    ]
    ids = [call_id for call_id, _ in calls]
    own = [(i, name) for i, name in calls if i and ids.count(i) == 1]
    lost = [i for i, _ in own if i not in history]
    _expect(
        not lost,
        f"the reply's calls {lost} are not in the history message (its calls: "
        f"{list(history)}): every call id must be kept {where}",
    )
    renamed = [i for i, name in own if history[i].name != name]
    _expect(not renamed, f"the reply's calls {renamed} call another tool in the history {where}")
    _check_arguments_kept(reply, parsed, {i for i, _ in own}, where)


def _check_arguments_kept(
    reply: ModelReply, parsed: ParsedReply, own: set[str], where: str
) -> None:
    """A complete call with an id of its own (``own``) keeps its arguments in the history.

    An invalid decision may keep them as ``{}``: the call is answered by the feedback.
    """
    history = {c.id: c for c in parsed.history_message.tool_calls}
    emptied = parsed.kind is DecisionKind.INVALID
    changed = [
        call.id
        for call in reply.tool_calls
        if call.id in own
        and history[call.id].arguments != call.arguments
        and not (emptied and not history[call.id].arguments)
    ]
    _expect(
        not changed,
        f"the reply's calls {changed} have other arguments in the history message {where}",
    )


def _check_actions_answer_history(parsed: ParsedReply, reply: ModelReply, where: str) -> None:
    """The actions are the history message's calls, so each call is answered by its action.

    Each action's observation answers the history call at its place (docs/seams.md, "Decision
    parser": every call id kept so each one is answered): the actions' ids are the history
    calls' ids, in order. A history without calls is allowed only when the reply held no
    native call (calls written as text are answered by user messages).
    """
    actions = [a.id for a in parsed.actions]
    history = [c.id for c in parsed.history_message.tool_calls]
    if history or reply.tool_calls or reply.invalid_tool_calls:
        _expect(
            actions == history,
            f"the actions {actions} are not the history message's calls {history} {where}",
        )
        other = [
            a.id
            for a, c in zip(parsed.actions, parsed.history_message.tool_calls, strict=True)
            if (a.name, a.arguments) != (c.name, c.arguments)
        ]
        _expect(
            not other,
            f"the actions {other} call another tool or other arguments than the history "
            f"message's calls of their ids {where}",
        )
    else:
        _expect(len(actions) == len(set(actions)), f"action ids repeat ({actions}) {where}")


async def check_action_executor(executor: ActionExecutor, *, sample: Action | None = None) -> None:
    """Hold ``executor`` to the action executor contract (docs/seams.md, "Action executor").

    Checks: ``tool_specs`` is a tuple of `ToolSpec` with unique names; ``replay_policy`` of
    each tool is a `ReplayPolicy` or its value, as the runtime reads it
    (`treadle.policies.replay_policy_of`); an unknown tool is NOT_EXECUTED (never raises,
    never EXECUTED) and its replay policy is ``NEVER``; invalid arguments for a declared tool
    are NOT_EXECUTED; ``sample`` (when given) returns a well-formed outcome; ``execute``
    never raises (a tool that raised is EXECUTED with the error text); ``reconcile`` of an
    action never written and of each action the check ran returns ``None`` or an outcome,
    without raising; and ``execute`` is a checkpoint that lets `trio.Cancelled` through
    (and raises nothing else when cancelled).

    Then the `treadle.ports.ToolPolicies` methods the executor declares (those
    `treadle.policies.policies_of` finds; an executor without one gets its default and is not
    asked), for each tool and an unknown one: each is callable; ``requires_approval`` gives
    a bool; ``secret_arguments`` a collection of str; ``invalid_arguments`` ``None`` or a
    reason, and a reason for an unknown tool and for every call above that ``execute``
    answered NOT_EXECUTED for its arguments (such a call must wait for no human);
    ``timeout_s`` ``None`` or seconds above 0 (``math.inf`` allowed); ``writes`` ``None`` or
    a non-empty key template; ``image_source`` raises `LookupError` for an image it does not
    keep.

    Raises:
        SeamContractError: naming the broken rule.
    """
    try:
        policies = policies_of(executor)
    except UsageError as exc:
        raise SeamContractError(str(exc)) from exc
    specs = executor.tool_specs()
    _expect(isinstance(specs, tuple), "tool_specs must return a tuple")
    _expect(all(isinstance(s, ToolSpec) for s in specs), "tool_specs must hold ToolSpec records")
    names = [s.name for s in specs]
    _expect(len(names) == len(set(names)), "tool names must be unique")
    unknown = _action("__no_such_tool__", {})
    for name in names:
        _replay_policy(executor, name)
    _expect(
        _replay_policy(executor, unknown.tool) is ReplayPolicy.NEVER, "unknown tool must be NEVER"
    )
    outcome = await _execute(executor, unknown, "an unknown tool")
    _check_outcome(outcome)
    _expect(outcome.status is ActionStatus.NOT_EXECUTED, "an unknown tool must be NOT_EXECUTED")
    refused = [unknown]
    for spec in specs:
        if spec.parameters.get("required"):
            bad_call = _action(spec.name, {"__unexpected__": object()}, number=len(refused) + 1)
            bad = await _execute(executor, bad_call, f"invalid arguments for {spec.name}")
            _check_outcome(bad)
            _expect(
                bad.status is ActionStatus.NOT_EXECUTED,
                f"invalid arguments for {spec.name} must be NOT_EXECUTED",
            )
            refused.append(bad_call)
    _check_policies(policies, [*names, unknown.tool], refused)
    written = list(refused)
    if sample is not None:
        _check_outcome(await _execute(executor, sample, "the sample action"))
        written.append(sample)
    never_written = _action(names[0] if names else "x", {}, step=2)
    await _reconcile(executor, never_written, "an action never written")
    for action in written:
        await _reconcile(executor, action, f"an action written and run ({action.tool})")
    await _lets_cancelled_through(executor, sample or unknown)


def _replay_policy(executor: ActionExecutor, tool: str) -> ReplayPolicy:
    """``executor``'s replay policy for ``tool``, as the runtime reads it.

    Raises:
        SeamContractError: the answer is no `ReplayPolicy` (nor its value), or it raised.
    """
    try:
        return replay_policy_of(executor, tool)
    except Exception as exc:
        raise SeamContractError(f"replay_policy({tool!r}): {exc}") from exc


async def _reconcile(executor: ActionExecutor, action: Action, what: str) -> None:
    """``executor.reconcile(action)`` answers an outcome or ``None`` without raising.

    Raises:
        SeamContractError: it raised or answered something else (docs/seams.md, "Action
            executor": ``None`` when it cannot tell).
    """
    try:
        reconciled = await executor.reconcile(action)
    except Exception as exc:
        raise SeamContractError(
            f"reconcile raised {exc!r} for {what}: it returns an outcome, "
            "or None when it cannot tell"
        ) from exc
    _expect(
        reconciled is None or isinstance(reconciled, ActionOutcome),
        f"reconcile must return an ActionOutcome or None for {what}, got {reconciled!r}",
    )


async def _lets_cancelled_through(executor: ActionExecutor, action: Action) -> None:
    """A cancelled ``execute`` raises `trio.Cancelled`, nothing else.

    Raises:
        SeamContractError: it returned or raised another exception.
    """
    with trio.CancelScope() as scope:
        scope.cancel()
        try:
            await executor.execute(action)
        except Exception as exc:
            raise SeamContractError(
                f"a cancelled execute raised {exc!r}: it must let trio.Cancelled through"
            ) from exc
    _expect(scope.cancelled_caught, "execute must be a checkpoint that lets Cancelled through")


async def _execute(executor: ActionExecutor, action: Action, what: str) -> ActionOutcome:
    """``executor.execute(action)``; an exception from it breaks the contract.

    Raises:
        SeamContractError: ``execute`` raised (docs/seams.md, "Action executor": a tool that
            raised is EXECUTED with the error text, an unknown tool or invalid arguments
            NOT_EXECUTED).
    """
    try:
        return await executor.execute(action)
    except Exception as exc:
        raise SeamContractError(
            f"execute raised {exc!r} for {what}: a tool that raised is EXECUTED with the "
            "error text, an unknown tool or invalid arguments NOT_EXECUTED"
        ) from exc


def _check_policies(
    policies: ExecutorPolicies, tools: Sequence[str], refused: Sequence[Action]
) -> None:
    """The answers of the `treadle.ports.ToolPolicies` methods ``policies`` declares."""
    declared = policies.declared
    for tool in tools:
        if "requires_approval" in declared:
            answer: object = policies.requires_approval(tool)
            _expect(isinstance(answer, bool), f"requires_approval({tool!r}) must be a bool")
        if "secret_arguments" in declared:
            try:  # as the runtime reads it (`treadle.policies.policies_of`)
                policies.secret_arguments(tool)
            except SeamViolation as exc:
                raise SeamContractError(
                    f"secret_arguments({tool!r}) returned {exc.returned}: it must be a "
                    "collection of argument names (str), e.g. a tuple, never a bare str"
                ) from exc
        if "timeout_s" in declared:
            seconds = policies.timeout_s(tool)
            number = isinstance(seconds, int | float) and not isinstance(seconds, bool)
            _expect(
                seconds is None or (number and seconds > 0),
                f"timeout_s({tool!r}) must be None or seconds above 0, got {seconds!r}",
            )
        if "writes" in declared:
            template = policies.writes(tool)
            _expect(
                template is None or (isinstance(template, str) and bool(template)),
                f"writes({tool!r}) must be None or a key template, got {template!r}",
            )
    if "invalid_arguments" in declared:
        for action in refused:
            reason = policies.invalid_arguments(action.tool, action.arguments)
            _expect(
                isinstance(reason, str) and bool(reason),
                f"invalid_arguments must give the reason a call of {action.tool!r} with "
                f"{dict(action.arguments)!r} is NOT_EXECUTED (no human is asked about it)",
            )
    if policies.image_source is not None:
        missing = ImageRef(url="ref:__no_such_image__")
        try:
            data = policies.image_source(missing)
        except LookupError:
            pass
        except Exception as exc:
            rule = "image_source must raise LookupError for an image it does not keep"
            raise SeamContractError(f"{rule}, raised {exc!r}") from exc
        else:
            raise SeamContractError(
                f"image_source returned {type(data).__name__} for an image it never returned"
            )


def _action(tool: str, arguments: dict[str, object], *, step: int = 1, number: int = 1) -> Action:
    """An action of the check's run, call ``number`` of ``step`` (its own intent id)."""
    return Action(
        run_id="contract",
        step=step,
        intent_id=f"contract/s{step}/a{number}",
        call_id=f"c{step}.{number}",
        tool=tool,
        arguments=arguments,
    )


def _check_outcome(outcome: ActionOutcome) -> None:
    problem = outcome_problem(outcome)
    _expect(problem is None, problem or "")
    _expect(outcome.status is not ActionStatus.UNKNOWN, "only resume reports UNKNOWN")


async def check_model_client(
    client: ModelClient, request: ModelRequest | None = None
) -> ModelReply:
    """Hold ``client`` to the model client contract (docs/seams.md, "Model client").

    Makes up to two calls of ``request`` (default: a one-line user message), so the server
    behind ``client`` must answer it twice.

    Checks, on the first call (made with an `Attempt` that records every usage report):
    ``complete`` takes the keyword-only ``attempt`` argument, with a default (a call outside a
    run passes none); the call returns a `ModelReply` (or raises `ModelCallError` with a
    classified kind and a `Usage`); usage counts, the reply's, each report's and a raised
    error's, are ints >= 0 or ``None`` (never a made-up value of another type); the text is
    ``None`` when there is none (never ``""``); every tool call
    has a non-empty id and a dict of arguments; the streamed text fragments, when any were
    delivered, add up to the reply's text; every usage report is a `Usage`, and the reply's
    usage is the last one reported (the run records the reply's usage, docs/models.md,
    "Usage").

    When the client reported usage, a second call's `Attempt` raises `ModelCallError` (kind
    ``token_budget``) from the first report, as the model gateway's does when the run's token
    budget is crossed: the call must end by raising that very error (docs/models.md,
    "Budgets during a call"). A client that reports no usage is not asked this (the gateway
    then checks the reply's usage when the call ends). Last, a call made in a cancelled
    scope must raise `trio.Cancelled`; and a failed call that raises anything but
    `ModelCallError` breaks the contract. The attempt's deadlines are held by
    `check_model_client_deadlines`, against a server that stalls.

    Returns:
        The first call's reply, for further checks by the caller.

    Raises:
        SeamContractError: naming the broken rule.
        ModelCallError: the first call failed (after its error was checked to be classified).
    """
    _check_takes_attempt(client)
    request = request or ModelRequest(messages=(Message(role="user", content="Say hi."),))
    fragments: list[str] = []
    reports: list[object] = []

    def on_delta(channel: str, text: str) -> None:
        _expect(channel in ("text", "reasoning"), f"unknown delta channel {channel!r}")
        if channel == "text":
            fragments.append(text)

    recording = Attempt(
        connect_s=_GENEROUS_S,
        first_byte_s=_GENEROUS_S,
        idle_s=_GENEROUS_S,
        report_usage=reports.append,
    )
    try:
        reply = await client.complete(request, on_delta=on_delta, attempt=recording)
    except ModelCallError as exc:
        _check_model_error(exc)
        raise
    except Exception as exc:
        raise SeamContractError(
            f"complete raised {exc!r}: a failed call raises ModelCallError with a classified "
            'kind (docs/seams.md, "Model client")'
        ) from exc
    problem = reply_problem(reply)
    _expect(problem is None, problem or "")
    _expect(
        reply.text != "",
        'reply.text is "": a reply without visible text (a tool-only turn) has text None, '
        'never "" standing for nothing (docs/seams.md, "Model client")',
    )
    if fragments:
        _expect("".join(fragments) == (reply.text or ""), "text deltas must add up to the text")
    reported = [problem for problem in map(usage_problem, reports) if problem is not None]
    _expect(not reported, f"attempt.report_usage: {reported[0] if reported else ''}")
    if reports:
        _expect(
            reply.usage == reports[-1],
            f"the reply's usage {reply.usage} is not the last usage reported, {reports[-1]}: "
            "the run records the reply's, so the tokens reported would be lost "
            '(docs/models.md, "Usage")',
        )
        await _check_usage_report_ends_the_attempt(client, request)
    await _check_cancel_ends_the_call(client, request, recording, after_s=0)
    return reply


async def _check_cancel_ends_the_call(
    client: ModelClient, request: ModelRequest, attempt: Attempt, *, after_s: float
) -> None:
    """A call cancelled ``after_s`` seconds in ends by raising `trio.Cancelled`.

    ``after_s`` 0 cancels it before it starts (no request need reach the server). A call
    that cannot be cancelled is waited for until it ends (by its attempt's deadlines).

    Raises:
        SeamContractError: the call ended otherwise: with a reply, or an exception of its
            own (docs/seams.md, "Model client": a cancel ends the call at once).
    """
    ended: ModelReply | Exception | None = None
    with trio.move_on_after(after_s) as cancel:
        try:
            ended = await client.complete(request, attempt=attempt)
        except Exception as exc:
            ended = exc
    if cancel.cancelled_caught:
        return
    if not cancel.cancel_called:
        raise SeamContractError(
            f"the call ended with {_clipped(ended)} before the cancel {after_s:g} s in: "
            "point the client at a server that stalls"
        )
    raise SeamContractError(
        f"a call cancelled {after_s:g} s in ended with {_clipped(ended)}, not trio.Cancelled: "
        "complete must end at once when cancelled (a shielded call, or a blocking one in a "
        "thread, does not)"
    )


async def check_model_client_deadlines(
    client: ModelClient,
    request: ModelRequest | None = None,
    *,
    deadline_s: float = 0.5,
    grace_s: float = 10.0,
) -> ModelCallError:
    """Hold ``client`` to the attempt's deadlines (docs/seams.md, "Model client").

    ``client`` must be pointed at a server that stalls: it accepts the request and then sends
    nothing, or stops sending in the middle of a stream (`treadle.testing.loopback` serves
    either: a `CannedResponse` with a long ``delay_s``, or a long pause among its
    ``chunks``). The call is made with an `Attempt` whose connect, first-byte and idle
    deadlines are all ``deadline_s`` seconds; it must end by raising a retryable
    `ModelCallError` of kind ``timeout`` (docs/models.md, "Deadlines inside every attempt").
    A call still running ``grace_s`` seconds after its deadline is cancelled, and the client
    broke the rule, whatever the call ends with once cancelled (a client that cannot be
    cancelled, e.g. a blocking SDK call in a worker thread, is waited for until it ends).
    Then a second call, with deadlines of ``grace_s``, is cancelled ``deadline_s`` seconds in:
    it must end by raising `trio.Cancelled` (a call shielded from cancellation ends only at
    its own deadline).

    Returns:
        The timeout error, for further checks by the caller.

    Raises:
        SeamContractError: the call did not end in time, ended with a reply (the server did
            not stall), or raised anything but a retryable ``timeout`` (any exception).
    """
    _check_takes_attempt(client)
    request = request or ModelRequest(messages=(Message(role="user", content="Say hi."),))
    tight = Attempt(connect_s=deadline_s, first_byte_s=deadline_s, idle_s=deadline_s)
    ended: ModelReply | Exception | None = None
    with trio.move_on_after(deadline_s + grace_s) as scope:
        try:
            ended = await client.complete(request, attempt=tight)
        except Exception as exc:
            ended = exc
    if scope.cancel_called:  # whatever it ended with, it ended only once cancelled (or never)
        late = f" (then it ended with {_clipped(ended)})" if ended is not None else ""
        raise SeamContractError(
            f"the call ran {grace_s:g} s past the attempt's {deadline_s:g} s deadlines{late}: "
            "complete must apply attempt.connect_s, first_byte_s and idle_s, and end at once "
            "when cancelled (a blocking call in a thread, or a shielded one, does not)"
        )
    if isinstance(ended, ModelCallError):
        _check_model_error(ended)
        _expect(
            ended.info.kind == "timeout" and ended.info.retryable,
            f"a passed attempt deadline must raise a retryable timeout, got {ended.info!r}",
        )
        patient = Attempt(connect_s=grace_s, first_byte_s=grace_s, idle_s=grace_s)
        await _check_cancel_ends_the_call(client, request, patient, after_s=deadline_s)
        return ended
    if isinstance(ended, Exception):
        raise SeamContractError(
            f"a passed attempt deadline must raise a retryable timeout (ModelCallError), "
            f"complete raised {ended!r}"
        ) from ended
    raise SeamContractError(
        f"the call returned {type(ended).__name__} from a server that should stall: "
        "point the client at one that sends nothing"
    )


def _clipped(value: object, limit: int = 120) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 1] + "…"


_GENEROUS_S = 120.0
"""Seconds of each deadline of the recording attempt: wide enough for any healthy server."""


def _check_takes_attempt(client: ModelClient) -> None:
    """``complete`` takes ``attempt`` by keyword, with a default (or takes ``**kwargs``)."""
    try:
        parameters = inspect.signature(client.complete).parameters
    except (TypeError, ValueError):  # a callable without a signature: the call will tell
        return
    found = parameters.get("attempt")
    if found is None:
        _expect(
            any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()),
            "complete must take the keyword argument attempt (treadle.types.Attempt)",
        )
        return
    _expect(
        found.kind in (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD),
        "complete must take attempt by keyword",
    )
    _expect(
        found.default is not inspect.Parameter.empty,
        "complete's attempt needs a default (Attempt.STANDALONE) for calls outside a run",
    )


def _check_model_error(exc: ModelCallError) -> None:
    _expect(bool(exc.info.kind), "a model error must carry a kind")
    problem = usage_problem(exc.usage)  # a Usage (maybe all unknown) of valid counts
    _expect(problem is None, f"a model error's {problem}")


async def _check_usage_report_ends_the_attempt(client: ModelClient, request: ModelRequest) -> None:
    """A report that raises ends the attempt with that very error."""
    cut = ModelCallError(ModelErrorInfo(kind="token_budget", message="contract check"))
    reported: list[Usage] = []

    def over_budget(usage: Usage) -> None:
        reported.append(usage)
        raise cut

    try:
        await client.complete(request, attempt=Attempt(report_usage=over_budget))
    except ModelCallError as exc:
        if exc is cut:
            return
        _expect(not reported, f"complete replaced the error report_usage raised with {exc!r}")
        _check_model_error(exc)  # a failure before any report: nothing more to check
        return
    except Exception as exc:
        what = "replaced the error report_usage raised with" if reported else "raised"
        raise SeamContractError(f"complete {what} {exc!r}") from exc
    _expect(not reported, "complete went on after attempt.report_usage raised")
