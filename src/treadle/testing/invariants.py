"""Invariants of a run's log (docs/crash-safety.md), checked after every simulated run.

Usable on any log: a simulation of your own agent, a log read back from a store after an
incident. Each checker returns one sentence per violation, an empty list when all hold.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Protocol

from treadle._text import holds_surrogates
from treadle.approvals import DECISIONS, Decision, arguments_digest, counts
from treadle.testing._run_end import check_cancel as check_cancel
from treadle.testing._run_end import check_run_finished as check_run_finished
from treadle.types import (
    ActionIntent,
    ActionResult,
    ActionStatus,
    ApprovalDecided,
    ApprovalRequested,
    Budgets,
    ChildrenAwaited,
    DecisionKind,
    JSONValue,
    ModelIntent,
    ModelReply,
    ModelRequest,
    ModelResult,
    RunFinished,
    RunLog,
    RunStarted,
    StepRecord,
    StopReason,
    ToolCall,
    Usage,
)


class EffectLedger(Protocol):
    """An environment's record of side effects, which survives crashes.

    Attributes:
        effects: intent id -> how many times a ``never``-policy effect was applied.
    """

    @property
    def effects(self) -> Mapping[str, int]:
        """Intent id -> times applied."""
        ...


TIME_SLACK_S = 0.25
"""Seconds the active time of a log written on a real clock may pass its time budget by.

The call in flight is cancelled at the deadline (docs/concepts.md, "Tools and
cancellation"), but on a real clock ending it, writing the step and scheduling the tasks
take a few milliseconds more, and more on a busy machine. A quarter second allows for that
and still finds a run that waited for a call past the deadline (a tool given the 2 s cancel
grace, a model stream left to its own deadline). The default of `check_invariants` and
`check_budgets`; docs/simulation.md, "Invariants checked after every run"."""

VIRTUAL_TIME_SLACK_S = 0.001
"""Seconds the active time may pass its budget by on trio's virtual clock (a simulation,
an ``autojump_clock`` test): the in-flight call is cancelled at the deadline and nothing
else takes time. `treadle.testing.simulation.simulate` checks its logs with it."""


def check_invariants(
    log: RunLog,
    *,
    ledger: EffectLedger | None = None,
    max_steps: int | None = None,
    budgets: Budgets | None = None,
    time_slack_s: float = TIME_SLACK_S,
) -> list[str]:
    """Check a finished run's log (and its environment's ledger) against docs/crash-safety.md.

    Args:
        log: the run's log.
        ledger: the environment's ledger: no ``never``-policy effect applied twice.
        max_steps: a step budget to check (also taken from ``budgets``).
        budgets: the run's budgets: steps, model attempts, tokens and active time must not
            overshoot by more than the one call in flight (see `check_budgets`).
        time_slack_s: seconds the active time may pass its budget by: `TIME_SLACK_S` for
            a log written on a real clock (the default), `VIRTUAL_TIME_SLACK_S` for one
            written on trio's virtual clock.

    Returns:
        One sentence per violation; empty when every invariant holds.
    """
    problems: list[str] = []
    records = log.records
    if not records or not isinstance(records[0], RunStarted):
        return [f"{log.run_id}: the log does not start with run-started"]
    problems.extend(check_records(log))
    problems.extend(_results_have_intents(log.run_id, records))
    problems.extend(_no_attempt_after_final_error(log.run_id, records))
    problems.extend(_steps_contiguous(log.run_id, records))
    problems.extend(_steps_in_order(log.run_id, records))
    problems.extend(_nothing_after_the_answer(log.run_id, records))
    problems.extend(check_approvals(log))
    problems.extend(check_cancel(log))
    problems.extend(check_run_finished(log))
    problems.extend(check_action_results(log))
    problems.extend(check_child_waits(log))
    problems.extend(check_valid_text(log))
    problems.extend(check_context(log))
    finished = [r for r in records if isinstance(r, RunFinished)]
    if len(finished) != 1 or not isinstance(records[-1], RunFinished):
        problems.append(f"{log.run_id}: expected exactly one run-finished, last ({len(finished)})")
    elif not finished[0].state.is_terminal:
        problems.append(f"{log.run_id}: finished in a non-terminal state {finished[0].state}")
    else:
        problems.extend(_totals_match(log.run_id, records, finished[0]))
    if max_steps is not None and len(log.steps) > max_steps:
        problems.append(f"{log.run_id}: {len(log.steps)} steps exceed the budget of {max_steps}")
    if budgets is not None:
        problems.extend(check_budgets(log, budgets, time_slack_s=time_slack_s))
    if ledger is not None:
        twice = sorted(k for k, n in ledger.effects.items() if n > 1)
        if twice:
            problems.append(f"{log.run_id}: never-policy actions applied twice: {twice}")
    return problems


def check_valid_text(log: RunLog) -> list[str]:
    """Every string in every record is valid Unicode (no surrogate code points).

    A surrogate in the log would make every later model request impossible to encode, so the
    run could never take another step (docs/crash-safety.md, "Text that is not Unicode").

    Returns:
        One sentence per record holding such text, naming its seq and kind.
    """
    return [
        f"{log.run_id}: record {seq} ({type(record).__name__}) holds text that is not valid "
        "Unicode (a lone surrogate): no request built from it can be sent"
        for seq, record in enumerate(log.records, start=1)
        if holds_surrogates(record)
    ]


def check_tool_replies(requests: Iterable[ModelRequest]) -> list[str]:
    """Check that every request pairs each assistant tool call with its tool message.

    OpenAI and Anthropic refuse a request in which an assistant message's tool call is not
    answered by a ``tool`` message (same call id) before the next message of another role, or
    a ``tool`` message answers no call of the assistant message before it.

    Args:
        requests: the requests a model client received, in order (for example
            `treadle.testing.ScriptedModel.requests`).

    Returns:
        One sentence per violation, naming the request (0-based) and the call id.
    """
    problems: list[str] = []
    for index, request in enumerate(requests):
        waiting: dict[str, str] = {}
        for message in (*request.messages, None):
            if message is not None and message.role == "tool":
                if message.tool_call_id not in waiting:
                    problems.append(
                        f"request {index}: tool message for call {message.tool_call_id!r} "
                        "answers no call of the assistant message before it"
                    )
                waiting.pop(message.tool_call_id or "", None)
                continue
            problems.extend(
                f"request {index}: tool call {call_id!r} ({tool}) has no tool message"
                for call_id, tool in waiting.items()
            )
            waiting = {}
            if message is not None and message.role == "assistant":
                waiting = {call.id: call.name for call in message.tool_calls}
    return problems


def _tokens(usage: Usage) -> int:
    return usage.known_total or 0


def _unknown(usage: Usage) -> bool:
    return usage.known_total is None


def _other(usage: Usage) -> int | None:
    """What a reported total holds beyond the usage's input and output tokens."""
    other = _tokens(usage) - (usage.input_tokens or 0) - (usage.output_tokens or 0)
    return other if other > 0 else None


def _sum_known(values: Iterable[int | None]) -> int | None:
    known = [v for v in values if v is not None]
    return sum(known) if known else None


def _totals_match(run_id: str, records: Sequence[Any], finished: RunFinished) -> list[str]:
    """The run-finished totals are what the log holds; unknown usage is never counted as 0.

    The tokens include what action results report spending on the run's behalf (a child
    run's, docs/child-runs.md, "Budgets").
    """
    results = [r for r in records if isinstance(r, ModelResult)]
    spent = [r.usage for r in results] + [
        r.outcome.usage
        for r in records
        if isinstance(r, ActionResult) and r.outcome.usage is not None
    ]
    expected = (
        _sum_known(u.input_tokens for u in spent),
        _sum_known(u.output_tokens for u in spent),
        _sum_known(_other(u) for u in spent),
        sum(1 for r in results if _unknown(r.usage))
        + sum(r.outcome.unknown_usage_attempts for r in records if isinstance(r, ActionResult)),
        sum(1 for r in records if isinstance(r, ModelIntent)),
        sum(1 for r in records if isinstance(r, StepRecord)),
    )
    totals = finished.totals
    reported = (
        totals.input_tokens,
        totals.output_tokens,
        totals.other_tokens,
        totals.unknown_usage_attempts,
        totals.model_attempts,
        totals.steps,
    )
    if reported != expected:
        return [
            f"{run_id}: run-finished totals (input, output, other, unknown-usage attempts, "
            f"attempts, steps) {reported} differ from the log's {expected}"
        ]
    return []


def check_budgets(
    log: RunLog, budgets: Budgets, *, time_slack_s: float = TIME_SLACK_S
) -> list[str]:
    """Budgets never overshoot by more than the one call in flight.

    See docs/concepts.md, "Stop reasons".

    - steps: no more step records than ``max_steps``;
    - model attempts: no attempt started once ``max_model_attempts`` were made;
    - tokens (input + output as reported, or a larger reported total: `Usage.known_total`):
      no model attempt started, and no action started, once the reported usage reached the
      budget (an action may follow a reply that brought usage exactly to the budget, never
      one that went past it). Attempts that reported no usage are unknown, not 0: they add
      nothing here and are counted apart in the totals; but under a token budget no model
      attempt and no action starts after a reply that reported none (docs/decisions/0114);
    - active time: no step started once the steps before it had used the budget, and the
      run's total active time (the step records' plus a step cut at the deadline) is within
      ``time_slack_s`` of the budget.

    Returns:
        One sentence per violation.
    """
    run_id = log.run_id
    problems: list[str] = []
    if budgets.max_steps is not None and len(log.steps) > budgets.max_steps:
        problems.append(
            f"{run_id}: {len(log.steps)} steps exceed the budget of {budgets.max_steps}"
        )
    attempts = 0
    tokens = 0
    unmetered: str | None = None  # the first reply of unknown usage
    active = 0.0
    step_began: set[int] = set()
    for record in log.records:
        if isinstance(record, ModelIntent):
            if budgets.max_model_attempts is not None and attempts >= budgets.max_model_attempts:
                problems.append(
                    f"{run_id}: model attempt {record.intent_id} began after the attempt budget"
                )
            if budgets.token_budget is not None and tokens >= budgets.token_budget:
                problems.append(
                    f"{run_id}: model attempt {record.intent_id} began with {tokens} tokens "
                    f"reported, at or past the token budget of {budgets.token_budget}"
                )
            if budgets.token_budget is not None and unmetered is not None:
                problems.append(
                    f"{run_id}: model attempt {record.intent_id} began after the reply "
                    f"{unmetered} reported no usage, under a token budget"
                )
            if record.step not in step_began:
                step_began.add(record.step)
                if budgets.time_budget_s is not None and active >= budgets.time_budget_s:
                    problems.append(
                        f"{run_id}: step {record.step} began after {active:.3f} s of active "
                        f"time, at or past the time budget of {budgets.time_budget_s} s"
                    )
            attempts += 1
        elif isinstance(record, ModelResult):
            tokens += _tokens(record.usage)
            if unmetered is None and record.unmetered:
                unmetered = record.intent_id
        elif isinstance(record, ActionResult) and record.outcome.usage is not None:
            tokens += _tokens(record.outcome.usage)  # a child run's (docs/child-runs.md)
        elif isinstance(record, ActionIntent):
            if budgets.token_budget is not None and tokens > budgets.token_budget:
                problems.append(
                    f"{run_id}: action {record.intent_id} began with {tokens} tokens reported, "
                    f"past the token budget of {budgets.token_budget}"
                )
            if budgets.token_budget is not None and unmetered is not None:
                problems.append(
                    f"{run_id}: action {record.intent_id} began after the reply {unmetered} "
                    "reported no usage, under a token budget"
                )
        elif isinstance(record, StepRecord):
            active += record.active_s
        elif isinstance(record, RunFinished) and budgets.time_budget_s is not None:
            total = record.totals.active_s
            if total > budgets.time_budget_s + time_slack_s:
                problems.append(
                    f"{run_id}: {total:.3f} s of active time overshoot the time budget of "
                    f"{budgets.time_budget_s} s"
                )
    return problems


def check_action_results(log: RunLog) -> list[str]:
    """Every action intent of a finished log has exactly one action result.

    See docs/crash-safety.md, "What is guaranteed": the result is executed, not executed,
    env error or unknown (a call the run abandoned is unknown and ``late``); what a call
    returns after its result was written never becomes a second result. A log that is not
    finished may end with intents still open (resume resolves them).

    Returns:
        One sentence per intent without a result or with more than one.
    """
    run_id = log.run_id
    if log.finished is None:
        return []
    counts: dict[str, int] = {}
    for record in log.records:
        if isinstance(record, ActionIntent):
            counts.setdefault(record.intent_id, 0)
        elif isinstance(record, ActionResult) and record.intent_id in counts:
            counts[record.intent_id] += 1
    problems: list[str] = []
    for intent_id, count in counts.items():
        if count == 0:
            problems.append(f"{run_id}: action intent {intent_id} has no result")
        elif count > 1:
            problems.append(f"{run_id}: action intent {intent_id} has {count} results")
    return problems


def check_child_waits(log: RunLog) -> list[str]:
    """A step parked on child runs (`ChildrenAwaited`) names calls that were waiting then.

    Each named intent is an action intent of the record's step written before it and without
    a result yet, and it names one child per intent (docs/child-runs.md, "In a fleet").

    Returns:
        One sentence per violation.
    """
    problems: list[str] = []
    open_intents: dict[str, int] = {}
    for record in log.records:
        if isinstance(record, ActionIntent):
            open_intents[record.intent_id] = record.step
        elif isinstance(record, ActionResult):
            open_intents.pop(record.intent_id, None)
        elif isinstance(record, ChildrenAwaited):
            if len(record.children) != len(record.intent_ids) or not record.intent_ids:
                problems.append(f"{log.run_id}: a children-awaited record names no call per child")
            for intent_id in record.intent_ids:
                if open_intents.get(intent_id) != record.step:
                    problems.append(
                        f"{log.run_id}: step {record.step} parked on {intent_id}, which was "
                        "not a call waiting in that step"
                    )
    return problems


def check_approvals(log: RunLog) -> list[str]:
    """Approval invariants, from the log alone.

    - a call that waited for approval has its decision recorded before its action intent,
      and only an approve or edit decision lets it start;
    - a call has at most one decision: the first counts, a second is refused and never
      recorded (docs/events.md, "Human approval");
    - no action of a rejected (or expired) call ran: no intent, and a NOT_EXECUTED result;
    - an edited call ran with the edited arguments, an approved one with the arguments its
      approval is bound to (docs/events.md, "Human approval": ``approve`` runs the call as
      the model wrote it);
    - a recorded decision answers the request written before it, and is one the run applies
      (`treadle.approvals.counts`): for the same step, call and arguments digest, and, but an
      expiry, not written after the request's deadline (docs/events.md, "Human approval": a
      decision bound to other arguments is never applied, one written after the deadline
      never counts);
    - a request is for a call of its step's reply, with its tool and bound to its arguments,
      when the step record's history message holds calls (`check_actions_asked_for` says
      why only then).

    A digest is compared with arguments only when it is a plain one (``sha256:``): the keyed
    digest of a call with secret arguments is made under a key kept nowhere
    (`treadle.approvals.request_digest`), and nothing can compute it again.

    Returns:
        One sentence per violation.
    """
    run_id = log.run_id
    problems: list[str] = []
    requested: dict[tuple[int, str], ApprovalRequested] = {}
    asked: dict[int, list[ApprovalRequested]] = {}  # step -> its requests
    decided: dict[tuple[int, str], ApprovalDecided] = {}
    for record in log.records:
        if isinstance(record, ApprovalRequested):
            requested.setdefault((record.step, record.call_id), record)
            asked.setdefault(record.step, []).append(record)
        elif isinstance(record, StepRecord):
            mine = asked.pop(record.step, [])
            problems.extend(_requests_are_its_calls(run_id, record, mine))
        elif isinstance(record, ApprovalDecided):
            key = (record.step, record.call_id)
            problems.extend(_decision_counts(run_id, record, requested.get(key)))
            if key in decided:
                problems.append(
                    f"{run_id}: call {record.call_id} of step {record.step} was decided twice "
                    f"({decided[key].decision}, then {record.decision}): the first decision "
                    "counts and a second is refused, never recorded"
                )
            decided.setdefault(key, record)
        elif isinstance(record, ActionIntent):
            key = (record.step, record.call_id)
            problems.extend(
                _intent_after_decision(run_id, record, key in requested, decided.get(key))
            )
        elif isinstance(record, ActionResult) and not record.late:
            decision = decided.get((record.step, record.call_id))
            if _refused(decision) and record.outcome.status is not ActionStatus.NOT_EXECUTED:
                problems.append(
                    f"{run_id}: call {record.call_id} was refused but its result is "
                    f"{record.outcome.status.value}"
                )
    return problems


def _decision_counts(
    run_id: str, decided: ApprovalDecided, request: ApprovalRequested | None
) -> list[str]:
    """Why the run could not have applied ``decided`` to ``request`` (empty: it could)."""
    which = f"the decision ({decided.decision}) on call {decided.call_id} of step {decided.step}"
    if request is None:
        return [f"{run_id}: {which} answers no approval request written before it"]
    if counts(decided, request):
        return []
    if decided.arguments_digest != request.arguments_digest:
        why = (
            f"is bound to arguments {decided.arguments_digest}, the request to "
            f"{request.arguments_digest}: it is never applied"
        )
    elif decided.decision not in DECISIONS:
        why = "is no decision a run applies"
    else:
        why = (
            f"was written at {decided.ts}, after the request's deadline {request.deadline_ts}: "
            "it never counts"
        )
    return [f"{run_id}: {which} {why}"]


def _requests_are_its_calls(
    run_id: str, step: StepRecord, requests: Sequence[ApprovalRequested]
) -> list[str]:
    """Each approval request of ``step`` is of a call its history message holds, if any."""
    calls = _native_calls(step)
    if not calls:
        return []  # calls written as text: their ids are the parser's
    problems: list[str] = []
    for request in requests:
        call = calls.get(request.call_id)
        if call is None:
            problems.append(
                f"{run_id}: an approval was requested for call {request.call_id!r} "
                f"({request.tool}), which the reply of step {step.step} does not hold"
            )
        elif call.name != request.tool:
            problems.append(
                f"{run_id}: an approval was requested for {request.tool}, but call "
                f"{request.call_id!r} of step {step.step} asked for {call.name}"
            )
        elif _bound_elsewhere(request.arguments_digest, call.arguments):
            problems.append(
                f"{run_id}: the approval request for call {request.call_id!r} of step "
                f"{step.step} is bound to arguments {request.arguments_digest}, not to the "
                f"call's {dict(call.arguments)}"
            )
    return problems


def _bound_elsewhere(digest: str, arguments: Mapping[str, JSONValue]) -> bool:
    """Whether ``digest`` is the plain digest of other arguments than ``arguments``.

    A plain digest is `treadle.approvals.arguments_digest`'s ``sha256:<hex>``; a keyed one
    (``hmac-sha256:``, of a call with secret arguments) cannot be computed again, and is
    never found bound elsewhere.
    """
    return digest.startswith("sha256:") and arguments_digest(arguments) != digest


def _refused(decision: ApprovalDecided | None) -> bool:
    return decision is not None and decision.decision in (Decision.REJECT, Decision.EXPIRED)


def _intent_after_decision(
    run_id: str, intent: ActionIntent, requested: bool, decision: ApprovalDecided | None
) -> list[str]:
    if not requested:
        return []
    if decision is None:
        return [f"{run_id}: action {intent.intent_id} began before its approval decision"]
    if decision.decision not in (Decision.APPROVE, Decision.EDIT):
        return [f"{run_id}: action {intent.intent_id} began although it was {decision.decision}"]
    if decision.decision == Decision.EDIT and dict(intent.arguments) != dict(
        decision.edited_arguments or {}
    ):
        return [
            f"{run_id}: action {intent.intent_id} ran with {dict(intent.arguments)}, "
            f"not the edited arguments {dict(decision.edited_arguments or {})}"
        ]
    if decision.decision == Decision.APPROVE and _bound_elsewhere(
        decision.arguments_digest, intent.arguments
    ):
        return [
            f"{run_id}: action {intent.intent_id} ran with {dict(intent.arguments)}, not the "
            f"arguments approved ({decision.arguments_digest})"
        ]
    return []


def check_records(log: RunLog) -> list[str]:
    """Every record is where the write protocol puts it (docs/crash-safety.md).

    - every record is of this run, and only the first is a run-started;
    - no intent id is written twice (an intent is written once; resume re-uses it);
    - an action result is of its intent's call: the same call id, tool and step;
    - a step record lists the action results of its write, in order, names a model intent
      of the log, and each result's observation is in what the step's history shows;
    - a step's actions are what its model reply asked for (`check_actions_asked_for`), and
      each call its reply asked for got an action (`check_calls_answered`);
    - a model result is of its intent's step.

    Returns:
        One sentence per violation.
    """
    run_id = log.run_id
    problems = [
        f"{run_id}: record {seq} ({type(record).__name__}) is of run {record.run_id!r}"
        for seq, record in enumerate(log.records, start=1)
        if record.run_id != run_id
    ]
    problems.extend(
        f"{run_id}: record {seq} is a second run-started"
        for seq, record in enumerate(log.records, start=1)
        if seq > 1 and isinstance(record, RunStarted)
    )
    problems.extend(_intents_once_and_answered_in_kind(run_id, log.records))
    problems.extend(_steps_hold_their_results(run_id, log.records))
    problems.extend(check_actions_asked_for(log))
    problems.extend(check_calls_answered(log))
    return problems


def check_actions_asked_for(log: RunLog) -> list[str]:
    """Every action intent is of a call its step's model reply asked for, and runs it once.

    The step record names the model call whose reply the step acted on and keeps the
    assistant message as it entered history; the actions of the step are that message's
    calls, the same ids (docs/seams.md, "Decision parser"). So, for each step record:

    - its action intents come after the model result they act on, and only a reply decided
      as actions has any;
    - no call id has two action intents (a resumed call re-uses its intent);
    - when the history message holds calls (native tool calls), each intent is of one of
      them: its call id, its tool, and its arguments, or the edited ones when a human edited
      the call (`check_approvals` checks those). A history message without calls is for
      calls written as text: their ids are the parser's, nothing in the log to compare.

    And each step record is of the reply it names (`_history_keeps_the_reply`):

    - the model call it names is of its own step;
    - its history message keeps every native call of that reply with an id of its own (one
      no other call of the reply shares), under that id and with its tool, and a complete
      call with its arguments (an invalid decision may keep them as ``{}``): the decision
      parser contract (docs/seams.md, "Decision parser"), which every parser is held to, so
      a step that runs calls the model did not make, or answers a reply that made calls, is
      found. Repairs change only calls the reply could not assemble, and calls a parser
      reads from text are not in the reply's calls: neither is compared. A human's edit
      changes the action's arguments, not the history's. The text of a final answer is
      the parser's reading of the reply, and is not compared
      (docs/decisions/0118-a-step-is-checked-against-its-reply-by-the-parser-contract.md).

    A step without a step record (a log that ends in it) is not checked.

    Returns:
        One sentence per violation.
    """
    problems: list[str] = []
    replied: dict[str, int] = {}  # model intent id -> index of its result with a reply
    replies: dict[str, ModelReply] = {}  # model intent id -> its (first) reply
    asked_in: dict[str, int] = {}  # model intent id -> its step
    intents: dict[int, list[tuple[int, ActionIntent]]] = {}  # step -> (index, intent)
    edited: set[tuple[int, str]] = set()  # (step, call id) of calls a human edited
    for index, record in enumerate(log.records):
        if isinstance(record, ModelIntent):
            asked_in.setdefault(record.intent_id, record.step)
        elif isinstance(record, ModelResult) and record.reply is not None:
            replied.setdefault(record.intent_id, index)
            replies.setdefault(record.intent_id, record.reply)
        elif isinstance(record, ActionIntent):
            intents.setdefault(record.step, []).append((index, record))
        elif isinstance(record, ApprovalDecided) and record.decision == Decision.EDIT:
            edited.add((record.step, record.call_id))
        elif isinstance(record, StepRecord):
            named = record.model_intent_id or ""
            elsewhere = _acts_on_its_own_call(log.run_id, record, asked_in.get(named))
            problems.extend(elsewhere)
            if named in replies and not elsewhere:
                problems.extend(_history_keeps_the_reply(log.run_id, record, replies[named]))
            mine = intents.pop(record.step, [])
            if mine:
                reply_at = replied.get(record.model_intent_id or "")
                problems.extend(_intents_follow_their_reply(log.run_id, record, mine, reply_at))
                ran = [intent for _, intent in mine]
                problems.extend(_no_call_run_twice(log.run_id, record.step, ran))
                problems.extend(_intents_are_its_calls(log.run_id, record, ran, edited))
    return problems


def check_calls_answered(log: RunLog) -> list[str]:
    """Each native call a step's history message holds got an action in the step.

    The calls of the assistant message that entered history are answered by their actions'
    observations (docs/seams.md, "Decision parser": every call id kept so each one is
    answered; no call turned into an answer). So a step record whose history message holds
    calls lists, among its action results, one for each of them (an intent and its result,
    or the not-executed result of a call a human refused), except:

    - an invalid decision, whose feedback answers its calls;
    - the final answer of an agent with an output type, given by a call of its output tool
      (docs/structured-output.md, "Native or a final-answer tool"), which never runs;
    - a step the run stopped in (a cancel, the time budget, a crash, a budget ending the run
      before its actions): its write holds a late or unknown result, or no model call
      follows it. Its calls without a result were never started.

    A step decided as the final answer holds no other call: a call turned into an answer
    never runs, and nothing answers it.

    Returns:
        One sentence per step with calls that got no action.
    """
    output_tool = _output_tool(log)
    results: dict[str, ActionResult] = {}
    last_call = max(
        (i for i, r in enumerate(log.records) if isinstance(r, ModelIntent)), default=-1
    )
    problems: list[str] = []
    for index, record in enumerate(log.records):
        if isinstance(record, ActionResult):
            results[record.intent_id] = record
        elif isinstance(record, StepRecord):
            mine = [results[i] for i in record.action_result_ids if i in results]
            stopped = index > last_call or any(_cut(result) for result in mine)
            problems.extend(_unanswered(log.run_id, record, mine, stopped, output_tool))
    return problems


def _output_tool(log: RunLog) -> str | None:
    """The name of the run's final-answer tool (its snapshot's ``output``), if it has one."""
    first = log.records[0] if log.records else None
    output = first.snapshot.get("output") if isinstance(first, RunStarted) else None
    name = output.get("name") if isinstance(output, dict) else None
    return name if isinstance(name, str) else None


def _cut(result: ActionResult) -> bool:
    """A result of a call the run stopped waiting for, or could not tell the outcome of."""
    return result.late or result.outcome.status is ActionStatus.UNKNOWN


def _unanswered(
    run_id: str,
    step: StepRecord,
    results: Sequence[ActionResult],
    stopped: bool,
    output_tool: str | None,
) -> list[str]:
    """The sentence for ``step``'s history calls that no result of its write answers."""
    message = step.history_message
    if message is None or step.decision in (None, DecisionKind.INVALID):
        return []
    if step.decision is DecisionKind.FINAL_ANSWER:
        missing = [c.id for c in message.tool_calls if step.output is None or c.name != output_tool]
        what = "but the step was decided as the final answer: the calls were turned into it"
    else:
        answered = {result.call_id for result in results}
        missing = [] if stopped else [c.id for c in message.tool_calls if c.id not in answered]
        what = "but got no action (no intent and no result in the step)"
    if not missing:
        return []
    return [f"{run_id}: step {step.step}'s reply asked for calls {missing}, {what}"]


def _intents_follow_their_reply(
    run_id: str, step: StepRecord, intents: Sequence[tuple[int, ActionIntent]], reply_at: int | None
) -> list[str]:
    """The step's intents (with their places in the log) follow the reply the step acted on."""
    ids = [intent.intent_id for _, intent in intents]
    if step.decision is not DecisionKind.ACTIONS:
        decided = step.decision.value if step.decision is not None else "no decision"
        return [f"{run_id}: step {step.step} ran actions {ids}, but its reply was {decided}"]
    if reply_at is None:
        return [
            f"{run_id}: step {step.step} ran actions {ids}, but its model call "
            f"{step.model_intent_id} has no reply in the log"
        ]
    early = [intent.intent_id for at, intent in intents if at < reply_at]
    if early:
        return [
            f"{run_id}: actions {early} of step {step.step} were written before the reply of "
            f"{step.model_intent_id} that asked for them"
        ]
    return []


def _acts_on_its_own_call(run_id: str, step: StepRecord, asked_in: int | None) -> list[str]:
    """The model call ``step`` names (asked in step ``asked_in``) is one of its own step.

    ``asked_in`` is ``None`` when the log holds no intent of that call (`check_records`
    says so) or the step names none.
    """
    if asked_in is None or asked_in == step.step:
        return []
    return [
        f"{run_id}: step {step.step} acted on model call {step.model_intent_id}, which is of "
        f"step {asked_in}"
    ]


def _history_keeps_the_reply(run_id: str, step: StepRecord, reply: ModelReply) -> list[str]:
    """Each native call of ``reply`` with an id of its own is in the step's history message.

    Under that id and with its tool; a complete call (`ModelReply.tool_calls`) with its
    arguments too, but that an invalid decision may keep them as ``{}`` (docs/seams.md,
    "Decision parser"). A step without a decision (its model call failed) is not checked.
    """
    message = step.history_message
    if step.decision is None or message is None:
        return []
    history = {call.id: call for call in message.tool_calls}
    made = [(c.id, c.name) for c in reply.tool_calls]
    made += [(c.id, c.name) for c in reply.invalid_tool_calls]
    ids = [call_id for call_id, _ in made]
    own = {call_id: name for call_id, name in made if call_id and ids.count(call_id) == 1}
    which = f"the reply of {step.model_intent_id} that step {step.step} acted on"
    lost = [call_id for call_id in own if call_id not in history]
    if lost:
        return [
            f"{run_id}: {which} made calls {lost}, which its history message "
            f"({step.decision.value}) does not hold"
        ]
    problems = [
        f"{run_id}: {which} made call {call_id!r} to {name}, its history message holds a "
        f"call to {history[call_id].name}"
        for call_id, name in own.items()
        if history[call_id].name != name
    ]
    emptied = step.decision is DecisionKind.INVALID
    problems.extend(
        f"{run_id}: {which} made call {call.id!r} with {dict(call.arguments)}, its history "
        f"message holds {dict(history[call.id].arguments)}"
        for call in reply.tool_calls
        if call.id in own
        and dict(history[call.id].arguments) != dict(call.arguments)
        and not (emptied and not history[call.id].arguments)
    )
    return problems


def _no_call_run_twice(run_id: str, step: int, intents: Sequence[ActionIntent]) -> list[str]:
    """No call id of the step has a second action intent (a resumed call re-uses its intent)."""
    problems: list[str] = []
    seen: set[str] = set()
    for intent in intents:
        if intent.call_id in seen:
            problems.append(
                f"{run_id}: call {intent.call_id!r} of step {step} has a second action intent "
                f"{intent.intent_id} (a call run twice)"
            )
        seen.add(intent.call_id)
    return problems


def _intents_are_its_calls(
    run_id: str, step: StepRecord, intents: Sequence[ActionIntent], edited: set[tuple[int, str]]
) -> list[str]:
    """Each intent is of a call of the step's history message, when that holds calls."""
    calls = _native_calls(step)
    if not calls:
        return []  # calls written as text: their ids are the parser's
    problems: list[str] = []
    for intent in intents:
        call = calls.get(intent.call_id)
        if call is None:
            problems.append(
                f"{run_id}: action {intent.intent_id} runs call {intent.call_id!r} "
                f"({intent.tool}), which the reply of step {step.step} does not hold"
            )
        elif call.name != intent.tool:
            problems.append(
                f"{run_id}: action {intent.intent_id} runs {intent.tool}, but call "
                f"{intent.call_id!r} of step {step.step} asked for {call.name}"
            )
        elif (step.step, call.id) not in edited and dict(call.arguments) != dict(intent.arguments):
            problems.append(
                f"{run_id}: action {intent.intent_id} runs {intent.tool} with "
                f"{dict(intent.arguments)}, but call {intent.call_id!r} of step {step.step} "
                f"asked for {dict(call.arguments)}"
            )
    return problems


def _intents_once_and_answered_in_kind(run_id: str, records: Sequence[Any]) -> list[str]:
    problems: list[str] = []
    intents: dict[str, ModelIntent | ActionIntent] = {}
    for record in records:
        if isinstance(record, ModelIntent | ActionIntent):
            if record.intent_id in intents:
                problems.append(f"{run_id}: intent {record.intent_id} was written twice")
            intents[record.intent_id] = record
        elif isinstance(record, ModelResult):
            model = intents.get(record.intent_id)
            if isinstance(model, ModelIntent) and model.step != record.step:
                problems.append(
                    f"{run_id}: model result {record.intent_id} is of step {record.step}, its "
                    f"intent of step {model.step}"
                )
        elif isinstance(record, ActionResult):
            intent = intents.get(record.intent_id)
            if not isinstance(intent, ActionIntent):
                continue  # no intent: `_results_have_intents` says so (or a refused call)
            mine = (intent.call_id, intent.tool, intent.step)
            theirs = (record.call_id, record.tool, record.step)
            if mine != theirs:
                problems.append(
                    f"{run_id}: action result {record.intent_id} is of call, tool and step "
                    f"{theirs}, its intent of {mine}"
                )
    return problems


def _steps_hold_their_results(run_id: str, records: Sequence[Any]) -> list[str]:
    problems: list[str] = []
    model_intents: set[str] = set()
    written: list[ActionResult] = []  # the action results of the step write under way
    for record in records:
        if isinstance(record, ModelIntent):
            model_intents.add(record.intent_id)
        elif isinstance(record, ActionResult):
            written.append(record)
            continue
        elif isinstance(record, StepRecord):
            problems.extend(_step_problems(run_id, record, written, model_intents))
        written = []
    return problems


def _step_problems(
    run_id: str, step: StepRecord, results: Sequence[ActionResult], model_intents: set[str]
) -> list[str]:
    problems: list[str] = []
    ids = tuple(r.intent_id for r in results)
    if tuple(step.action_result_ids) != ids:
        problems.append(
            f"{run_id}: step {step.step} lists action results {list(step.action_result_ids)}, "
            f"its write holds {list(ids)}"
        )
    if step.model_intent_id is not None and step.model_intent_id not in model_intents:
        problems.append(
            f"{run_id}: step {step.step} acted on model call {step.model_intent_id}, which has "
            "no intent before it"
        )
    if step.observations:
        shown = [r.intent_id for r in results if not _observed(r, step.observations)]
        if shown:
            problems.append(
                f"{run_id}: step {step.step}'s observations do not show the results {shown}"
            )
    return problems


def _observed(result: ActionResult, observations: Sequence[str]) -> bool:
    """Whether the result's observation is in one the step showed (its template around it)."""
    return any(result.outcome.observation in shown for shown in observations)


def _results_have_intents(run_id: str, records: Sequence[Any]) -> list[str]:
    problems: list[str] = []
    model_intents: set[str] = set()
    action_intents: set[str] = set()
    refused: set[tuple[int, str]] = set()  # rejected or expired calls never get an intent
    for index, record in enumerate(records):
        if isinstance(record, ModelIntent):
            model_intents.add(record.intent_id)
        elif isinstance(record, ActionIntent):
            action_intents.add(record.intent_id)
        elif isinstance(record, ApprovalDecided) and _refused(record):
            refused.add((record.step, record.call_id))
        elif isinstance(record, ModelResult) and record.intent_id not in model_intents:
            problems.append(f"{run_id}: model result {record.intent_id} has no intent")
        elif isinstance(record, ActionResult):
            if (
                record.intent_id not in action_intents
                and (record.step, record.call_id) not in refused
            ):
                problems.append(f"{run_id}: action result {record.intent_id} has no intent")
            following = records[index + 1] if index + 1 < len(records) else None
            if (
                not isinstance(following, ActionResult | StepRecord)
                or following.step != record.step
            ):
                problems.append(f"{run_id}: action result {record.intent_id} without step record")
    return problems


_CUT_KINDS = frozenset({StopReason.CANCELLED.value, StopReason.TIME_BUDGET.value, "token_budget"})
"""Error kinds of an attempt the run cut itself (a cancel or a budget), not a failed call."""


def _no_attempt_after_final_error(run_id: str, records: Sequence[Any]) -> list[str]:
    """A model call that failed for good is a finished call: resume never re-runs it.

    After a recorded non-retryable error (not a cut by cancel or budget), the same step gets
    no further model attempt.
    """
    final: dict[int, str] = {}
    refused: dict[int, int] = {}
    problems: list[str] = []
    for record in records:
        if isinstance(record, ModelResult) and record.error is not None:
            if record.error.kind == _CONTEXT_LENGTH:
                # A compacting run retries a step once after its first context-length
                # refusal (docs/context.md, "Context-length errors"); the second is final.
                refused[record.step] = refused.get(record.step, 0) + 1
                if refused[record.step] == 1 and _compacts(records):
                    continue
            if not record.error.retryable and record.error.kind not in _CUT_KINDS:
                final.setdefault(record.step, record.intent_id)
        elif isinstance(record, ModelIntent) and record.step in final:
            problems.append(
                f"{run_id}: model attempt {record.intent_id} after {final[record.step]} had "
                "failed for good (a finished call was re-run)"
            )
    return problems


_CONTEXT_LENGTH = "context_length_exceeded"


def _compacts(records: Sequence[Any]) -> bool:
    """The run declares a context window (its snapshot has the ``context`` key)."""
    first = records[0] if records else None
    return isinstance(first, RunStarted) and "context" in first.snapshot


def check_context(log: RunLog) -> list[str]:
    """The context budget's invariants (docs/context.md), from the log alone.

    * every request fits: its recorded estimate is within its budget, unless what cannot
      be cut alone exceeds it (``unfit``: the instructions, the input, the summariser's
      prompt);
    * a summary is computed once: no two summaries of a run cover the same steps, and each
      covers more than the one before;
    * a request names only a summary the log holds, durable before it (or one an earlier
      run of the thread wrote: ``summary_run_id``, not checked from this log).
    """
    problems: list[str] = []
    summaries: dict[str, int] = {}
    last_through: int | None = None  # steps up to 0: a thread's inherited history
    for record in log.records:
        if not isinstance(record, ModelResult):
            continue
        if record.summary_through is not None and record.reply is not None:
            if last_through is not None and record.summary_through <= last_through:
                problems.append(
                    f"{log.run_id}: summary {record.intent_id} covers steps 1-"
                    f"{record.summary_through}, already summarised (a summary recomputed)"
                )
            through = record.summary_through
            last_through = through if last_through is None else max(last_through, through)
            summaries[record.intent_id] = record.summary_through
        context = record.context
        if context is None:
            continue
        if context.estimated_input_tokens > context.budget and not context.unfit:
            problems.append(
                f"{log.run_id}: request {record.intent_id} was estimated at "
                f"{context.estimated_input_tokens} tokens, over its budget of {context.budget}"
            )
        wanted = context.summary_intent_id
        if context.summary_run_id is not None:
            continue  # carried over from an earlier run of the thread: in that run's log
        if wanted is not None and summaries.get(wanted) != context.summary_through:
            problems.append(
                f"{log.run_id}: request {record.intent_id} names summary {wanted} of steps "
                f"1-{context.summary_through}, which the log does not hold before it"
            )
    return problems


_OF_A_STEP = (
    ModelIntent,
    ModelResult,
    ActionIntent,
    ActionResult,
    ApprovalRequested,
    ApprovalDecided,
    ChildrenAwaited,
)
"""Records written while their step is under way, before its step record."""


def _steps_in_order(run_id: str, records: Sequence[Any]) -> list[str]:
    """A step's records come after the record of the step before it and before its own.

    Steps run one at a time (docs/crash-safety.md, "The write protocol"): nothing of step
    ``n + 1`` is written before step ``n``'s record, and no model call or action of a step
    follows that step's record.
    """
    problems: list[str] = []
    done = 0  # the number of the last step record so far
    for seq, record in enumerate(records, start=1):
        if isinstance(record, StepRecord):
            done = max(done, record.step)
        elif isinstance(record, _OF_A_STEP) and not done < record.step <= done + 1:
            kind = type(record).__name__
            problems.append(
                f"{run_id}: record {seq} ({kind}) is of step {record.step}, written after the "
                f"record of step {done}"
                if record.step <= done
                else f"{run_id}: record {seq} ({kind}) is of step {record.step}, written "
                f"before the record of step {record.step - 1}"
            )
    return problems


def _nothing_after_the_answer(run_id: str, records: Sequence[Any]) -> list[str]:
    """A step decided as the final answer is the run's last: no model call or step follows.

    The run ends with that answer (docs/concepts.md, "Stop reasons").
    """
    answered: int | None = None
    for seq, record in enumerate(records, start=1):
        if answered is not None and isinstance(record, (*_OF_A_STEP, StepRecord)):
            return [
                f"{run_id}: record {seq} ({type(record).__name__}) follows step {answered}, "
                "whose decision was the final answer"
            ]
        if isinstance(record, StepRecord) and record.decision is DecisionKind.FINAL_ANSWER:
            answered = record.step
    return []


def _steps_contiguous(run_id: str, records: Sequence[Any]) -> list[str]:
    numbers = [r.step for r in records if isinstance(r, StepRecord)]
    if numbers != list(range(1, len(numbers) + 1)):
        return [f"{run_id}: step records are not contiguous: {numbers}"]
    return []


def _native_calls(step: StepRecord) -> dict[str, ToolCall]:
    """The calls of ``step``'s history message, by id (none without a message)."""
    message = step.history_message
    return {call.id: call for call in message.tool_calls} if message is not None else {}
