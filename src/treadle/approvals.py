"""Human approval of tool calls, and the control inbox other processes write to.

A tool declared with ``@tool(requires_approval=True)``, or any call an `ApprovalPolicy`
selects by tool name and arguments, waits for a human decision before its action intent is
written (docs/concepts.md, "Stop reasons", docs/events.md). The request is bound to the call's id
and to
`arguments_digest` of its arguments; a decision that names another call or other arguments
is refused.

Another process (``treadle approve``, ``treadle cancel``) never appends to a run's log: only
the holder of the run's lease writes it (docs/fleet.md, "Leases"). It appends to the run's
**control stream** instead (`treadle.ports.ControlStream`), which the driving process polls and
copies into the run's log, in order (docs/decisions/0007-external-control.md). `request_cancel`
and `decide` are those writes. At an approval's deadline the driver writes the call's expiry
there too (`append_expiry`): the stream's order decides whether a human's decision or the
expiry counts (`first_counting`;
docs/decisions/0106-the-control-stream-orders-decisions-and-expiry.md).
"""

from __future__ import annotations

import enum
import functools
import hashlib
import hmac
import json
import os
import secrets
import sys
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any, TypeAlias

from treadle._clock import Clock, SystemClock
from treadle._exceptions import UsageError
from treadle._ids import check_run_id
from treadle._schema import argument_validator
from treadle._state import seconds_between
from treadle._text import loads_json, repaired, require_text
from treadle._trio_only import require_trio
from treadle.parsers import MAX_ARGUMENT_DEPTH, NESTED_TOO_DEEP, argument_problem
from treadle.policies import ExecutorPolicies
from treadle.ports import ControlStream, RunQueue, RunStore
from treadle.redaction import REDACTED, Redaction, without_secret_values
from treadle.types import (
    ActionIntent,
    ApprovalDecided,
    ApprovalRequested,
    CancelRequested,
    DefinitionAccepted,
    JSONValue,
    RunLog,
    RunStarted,
    StepRecord,
)

ApprovalPolicy: TypeAlias = Callable[[str, Mapping[str, JSONValue]], bool]
"""``policy(tool, arguments) -> True`` when that call must wait for a human decision."""


class Decision(enum.StrEnum):
    """The decisions an `ApprovalDecided` record can carry."""

    APPROVE = "approve"
    REJECT = "reject"
    EDIT = "edit"
    EXPIRED = "expired"
    """Written by the driving process when the approval deadline passed without a decision."""


def arguments_digest(arguments: Mapping[str, JSONValue], *, key: bytes | None = None) -> str:
    """The digest an approval is bound to: ``sha256:<hex>`` of the canonical JSON arguments.

    Canonical JSON: keys sorted, no insignificant whitespace, non-ASCII kept as is. With a
    ``key``, ``hmac-sha256:<hex>``: the HMAC-SHA256 of that text under ``key``.

    Raises:
        UsageError: the arguments are not JSON data.
    """
    try:
        text = json.dumps(arguments, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    except (TypeError, ValueError) as exc:
        raise UsageError(f"tool arguments are not JSON data: {exc}") from exc
    if key is not None:
        return "hmac-sha256:" + hmac.new(key, text.encode("utf-8"), hashlib.sha256).hexdigest()
    return "sha256:" + hashlib.sha256(text.encode("utf-8")).hexdigest()


def request_digest(
    tool: str,
    arguments: Mapping[str, JSONValue],
    redaction: Redaction,
    keys: Callable[[int], bytes] = secrets.token_bytes,
    *,
    step: int | None = None,
) -> str:
    """The digest a new approval request of a call of ``tool`` in ``step`` is bound to.

    A call shown as it is: `arguments_digest` of its arguments, which anyone may compute
    again. A call shown with something hidden (a secret argument, or a secret value of its
    step's reply in another argument: `Redaction.hides`): keyed with 32 bytes drawn from
    ``keys`` for this request and kept nowhere (the OS's secure source; a seeded run's own
    random source, so that its log stays the same for a seed: docs/simulation.md), so the
    digest shown next to ``"[redacted]"`` cannot be tested against guesses of a secret value
    (a PIN would otherwise fall to a few million hashes). Nothing ever computes a request's
    digest again: a decision names the digest the request carries (`matches`), so requests
    written before, with plain digests, still take their decisions (docs/events.md, "Secret
    arguments").

    Raises:
        UsageError: the arguments are not JSON data.
    """
    key = keys(32) if redaction.hides(tool, arguments, step=step) else None
    return arguments_digest(arguments, key=key)


def edited_arguments(text: str) -> dict[str, JSONValue]:
    """The edited arguments a person typed (``treadle approve --edit``, the run console).

    Only read here; `check_edit` checks them against the tool's schema.

    Raises:
        UsageError: ``text`` is not JSON, cannot be read (it nests too deeply, or holds an
            integer of more digits than Python converts), or is not an object.
    """
    try:
        value = loads_json(text)
    except json.JSONDecodeError as exc:
        raise UsageError(f"the edited arguments are not JSON: {exc}") from exc
    except ValueError as exc:  # nested past what the decoder follows, a number too long
        raise UsageError(f"the edited arguments cannot be read: {exc}") from None
    if not isinstance(value, dict):
        raise UsageError("the edited arguments must be a JSON object")
    return value


def check_edit(
    edit: Mapping[str, JSONValue],
    tool: str = "",
    schema: Mapping[str, JSONValue] | None = None,
    *,
    secrets: Collection[str] = (),
) -> None:
    """Refuse edited arguments that are not strict JSON data or do not fit ``schema``.

    An edit replaces the model's whole argument object (docs/events.md, "Human approval"), so
    it is checked as a whole against the tool's argument schema, as the run's parameter
    snapshot holds it (`tool_schema`), by the check a call's arguments get before an MCP
    server is asked (`treadle._schema.argument_validator`: the draft its ``$schema`` names,
    2020-12 when none; ``pattern`` left to the tool; references resolved inside the schema
    alone, nothing fetched). ``schema=None`` checks only that it is JSON. The message never
    repeats the value of an argument named in ``secrets``, not even in an error about the
    whole object (docs/events.md, "Secret arguments").

    Raises:
        UsageError: they are not an object (a tool's arguments are one: a list, a string or
            a number is refused first, before any check or message looks inside), they are
            not strict JSON data (NaN, infinity, non-string keys), they nest deeper than a
            model's arguments may (`treadle.parsers.MAX_ARGUMENT_DEPTH`), or they do not fit
            ``schema`` (the message lists each error with its path), or ``schema`` itself
            cannot be checked (no valid schema, a reference to nowhere or outside it).
    """
    if not isinstance(edit, Mapping):
        raise UsageError(
            "edited arguments must be a JSON object of the tool's arguments by name, not "
            f"{type(edit).__name__}"
        )
    if argument_problem(edit) == NESTED_TOO_DEEP:
        raise UsageError(
            f"edited arguments nest objects and arrays deeper than {MAX_ARGUMENT_DEPTH} levels"
        )
    try:
        json.dumps(edit, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise UsageError(f"edited arguments are not JSON data: {exc}") from exc
    if schema is None:
        return
    errors = _schema_errors(edit, tool, schema)
    if errors:
        listed = "; ".join(
            f"{'/'.join(map(str, e.absolute_path)) or '(arguments)'}: "
            f"{_complaint(e, edit, secrets)}"
            for e in errors[:5]
        )
        more = f" (and {len(errors) - 5} more)" if len(errors) > 5 else ""
        raise UsageError(
            f"edited arguments do not fit the schema of {tool or 'the tool'}: {listed}{more}"
        )


def _schema_errors(
    edit: Mapping[str, JSONValue], tool: str, schema: Mapping[str, JSONValue]
) -> list[Any]:
    """The schema's errors about ``edit`` (`jsonschema.ValidationError`), by path.

    Raises:
        UsageError: ``schema`` cannot be checked (no valid schema, a reference to nowhere).
    """
    try:
        validator = argument_validator(schema)
        errors = list(validator.iter_errors(edit))
    except Exception as exc:  # the schema itself is broken (jsonschema's and referencing's)
        raise UsageError(
            f"the schema of {tool or 'the tool'} cannot be checked: {type(exc).__name__}: {exc}"
        ) from exc
    return sorted(errors, key=lambda e: list(map(str, e.absolute_path)))


def _complaint(error: Any, edit: Mapping[str, JSONValue], secrets: Collection[str]) -> str:
    """The schema's complaint, without the value of any secret argument of ``edit``.

    About a secret argument, the complaint names the rule only. Any other may quote an
    instance that holds one (an error about the whole object, of ``oneOf`` or
    ``maxProperties``, quotes all of it): its secret values are replaced
    (`treadle.redaction.without_secret_values`).
    """
    path = list(error.absolute_path)
    if path and path[0] in secrets:
        return f"the value does not fit ({error.validator}: {json.dumps(error.validator_value)})"
    return without_secret_values(str(error.message), edit, secrets)


def kept_secrets(
    edit: Mapping[str, Any], request: ApprovalRequested, secrets: Collection[str]
) -> Mapping[str, Any]:
    """``edit`` with each secret argument it leaves at `REDACTED` given its requested value.

    An approver is shown secret arguments as ``[redacted]`` (the handle, ``treadle approve``,
    the run console's edit box), so an edit of another argument made from what was shown
    would run the call with the placeholder as the secret. A secret argument whose edited
    value is exactly `REDACTED` keeps the value the model sent (docs/events.md, "Secret
    arguments"); any other value, or leaving the argument out, is the edit's. Nothing else is
    merged: the edit still replaces the model's whole argument object.
    """
    arguments = request.arguments
    if not secrets or arguments is None or not isinstance(edit, Mapping):
        return edit
    kept = {
        name: arguments[name]
        for name in secrets
        if name in arguments and isinstance(edit.get(name), str) and edit[name] == REDACTED
    }
    return {**edit, **kept} if kept else edit


def tool_schema(snapshot: Mapping[str, JSONValue], tool: str) -> Mapping[str, JSONValue]:
    """The argument schema of ``tool`` in a parameter snapshot (key ``tools``).

    Raises:
        UsageError: the snapshot declares no tool of that name (an edit cannot be checked).
    """
    tools = snapshot.get("tools")
    for spec in tools if isinstance(tools, list) else ():
        if isinstance(spec, Mapping) and spec.get("name") == tool:
            parameters = spec.get("parameters")
            if isinstance(parameters, Mapping):
                return parameters
    raise UsageError(
        f"the run's definition declares no tool {tool!r}: edited arguments cannot be checked"
    )


def current_snapshot(log: RunLog) -> Mapping[str, JSONValue]:
    """The snapshot a run goes on under: the last accepted definition change, else its start's.

    Raises:
        UsageError: the log has no run-started record.
    """
    snapshot: Mapping[str, JSONValue] | None = None
    for record in log.records:
        if isinstance(record, RunStarted | DefinitionAccepted):
            snapshot = record.snapshot
    if snapshot is None:
        raise UsageError(f"there is no run {log.run_id!r} in this store")
    return snapshot


EXPIRED_DETAIL = "no decision arrived before the approval deadline"
"""The detail of the synthetic observation of a call whose approval wait expired."""


def decision_for(
    run_id: str,
    request: ApprovalRequested | None,
    clock: Clock,
    *,
    call_id: str | None = None,
    reject: str | None = None,
    edit: Mapping[str, Any] | None = None,
    snapshot: Mapping[str, JSONValue] | None = None,
    redaction: Redaction | None = None,
) -> ApprovalDecided:
    """The decision record answering ``request``: approve, reject or edit.

    See docs/events.md, "Human approval". ``snapshot``: the parameter snapshot the run goes on
    under; an edit is checked against its schema of the tool (`check_edit`). ``redaction``:
    the run's secret arguments (`Redaction.of_log`; by default the snapshot's); a secret one
    the edit leaves at ``[redacted]`` keeps its requested value (`kept_secrets`).

    Raises:
        UsageError: no request is pending, ``call_id`` names another call, ``call_id`` or
            ``reject`` is not a ``str``, both ``reject`` and ``edit`` were given, or the
            edited arguments are not a JSON object or do not fit the tool's schema.
    """
    require_text("call_id", call_id, optional=True)
    require_text("a rejection's message (reject)", reject, optional=True)
    if request is None:
        raise UsageError(f"run {run_id!r} is not waiting for an approval")
    if call_id is not None and call_id != request.call_id:
        raise UsageError(f"run {run_id!r} waits on call {request.call_id!r}, not on {call_id!r}")
    if reject is not None and edit is not None:
        raise UsageError("a decision either rejects or edits the arguments, not both")
    if edit is not None:
        schema = None if snapshot is None else tool_schema(snapshot, request.tool)
        redaction = redaction or Redaction.of_snapshot(snapshot or {})
        secrets = redaction.secrets.get(request.tool, ())
        edit = kept_secrets(edit, request, secrets)
        check_edit(edit, request.tool, schema, secrets=secrets)
    decision = (
        Decision.REJECT if reject is not None else Decision.EDIT if edit is not None else None
    )
    return repaired(
        ApprovalDecided(
            run_id=run_id,
            step=request.step,
            call_id=request.call_id,
            arguments_digest=request.arguments_digest,
            decision=(decision or Decision.APPROVE).value,
            ts=clock.now_iso(),
            message=reject or "",
            edited_arguments=dict(edit) if edit is not None else None,
            tool=request.tool,
        )
    )


def expired_decision(request: ApprovalRequested, clock: Clock) -> ApprovalDecided:
    """The record ending ``request``'s wait at its deadline (a synthetic observation follows)."""
    return ApprovalDecided(
        run_id=request.run_id,
        step=request.step,
        call_id=request.call_id,
        arguments_digest=request.arguments_digest,
        decision=Decision.EXPIRED.value,
        ts=clock.now_iso(),
        message=EXPIRED_DETAIL,
        tool=request.tool,
    )


def policy_name(policy: ApprovalPolicy) -> str:
    """The name an approval policy is recorded under: ``module:qualified.name``.

    Of a function (or of the function a `functools.partial` wraps), its module and
    qualified name; of another callable, its class's. It is what the run's parameter
    snapshot holds (key ``approval_policy``), so a resume checks that the run goes on under
    the policy it was started with (docs/events.md, "Human approval"). Two lambdas of one
    module share a name: give a policy a ``def`` of its own. A policy of the script Python
    runs as ``__main__`` is named by the module that script is when imported (`_main_module`),
    as ``treadle resume --agent app:factory`` imports it.
    """
    target: object = policy.func if isinstance(policy, functools.partial) else policy
    owner = target if hasattr(target, "__qualname__") else type(target)
    module = getattr(owner, "__module__", None) or type(target).__module__
    if module == "__main__":
        module = _main_module()
    return f"{module}:{getattr(owner, '__qualname__', type(target).__qualname__)}"


def _main_module() -> str:
    """The module name of the program running as ``__main__``, as an import would name it.

    ``python -m app`` gives its module's name (``app``; a package's ``__main__`` stays
    ``pkg.__main__``); ``python app.py`` the file's name without ``.py`` (``app``), which is
    what ``import app`` from its folder gives; an interactive session or ``-c`` has neither
    and stays ``__main__``.
    """
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    if spec is not None and spec.name:
        return str(spec.name)
    path = getattr(main, "__file__", None)
    if isinstance(path, str) and path.endswith(".py"):
        return os.path.basename(path)[: -len(".py")]
    return "__main__"


def requires_approval(
    policies: ExecutorPolicies,
    policy: ApprovalPolicy | None,
    tool: str,
    arguments: Mapping[str, Any],
) -> bool:
    """Whether a call waits for a human: the tool says so, or ``policy`` selects it.

    ``policies`` are the executor's (`treadle.policies.policies_of`; `treadle.tools.Toolbox`
    declares ``requires_approval(tool)``); an executor without that method never requires
    approval itself. A call the executor would refuse to run anyway (its
    ``invalid_arguments(tool, arguments)`` says why: an unknown tool, arguments that do not
    validate) never waits: it is NOT_EXECUTED with that reason, and no human decides in vain
    (docs/events.md, "Human approval"). The arguments are validated only for a call that
    would otherwise wait, and before ``policy`` sees them.
    """
    declared = policies.requires_approval(tool)
    if not declared and policy is None:
        return False  # the common case: no validation needed to say so
    if policies.invalid_arguments(tool, arguments) is not None:
        return False
    return declared or bool(policy is not None and policy(tool, arguments))


def pending_approval(log: RunLog) -> ApprovalRequested | None:
    """The approval request a run waits on now, or ``None``.

    A request is pending while the run is unfinished and its step has no decision, no
    action intent for the call and no step record yet.
    """
    if log.finished is not None:
        return None
    pending: ApprovalRequested | None = None
    for record in log.records:
        if isinstance(record, ApprovalRequested):
            pending = record
        elif pending is None:
            continue
        elif _answers(record, pending):
            pending = None
    return pending


async def undecided_approval(store: RunStore, log: RunLog) -> ApprovalRequested | None:
    """The approval request the run of ``log`` waits on with no decision yet, or ``None``.

    `pending_approval`, unless the run's control stream already holds a decision the run
    will apply to it (`first_counting`: one written by ``treadle approve`` or the console
    while no driver ran, which the next drive takes up without waiting).

    Raises:
        StoreError: the control stream cannot be read.
    """
    request = pending_approval(log)
    if request is None:
        return None
    decided = first_counting(await read_control(store, log.run_id), request)
    return request if decided is None else None


def _answers(record: object, request: ApprovalRequested) -> bool:
    """Whether ``record`` ends the wait on ``request`` (a decision, an intent, a step)."""
    if isinstance(record, ApprovalDecided | ActionIntent):
        return record.call_id == request.call_id
    return isinstance(record, StepRecord) and record.step >= request.step


def matches(decided: ApprovalDecided, request: ApprovalRequested) -> bool:
    """Whether a decision answers exactly this request (step, call id and arguments)."""
    return (
        decided.step == request.step
        and decided.call_id == request.call_id
        and decided.arguments_digest == request.arguments_digest
    )


def written_late(decided: ApprovalDecided, request: ApprovalRequested) -> bool:
    """Whether ``decided`` was written after ``request``'s deadline (by its own timestamp).

    Such a human decision never counts: the call expires (docs/events.md, "Human approval").
    Whoever reads a decision checks this, the driven run, the parked one and one resumed
    past the deadline alike (`counts`), and `decide` checks it before writing one.
    """
    return seconds_between(request.deadline_ts, decided.ts) > 0


def counts(decided: ApprovalDecided, request: ApprovalRequested) -> bool:
    """Whether the run applies ``decided`` to ``request`` when nothing counting comes before it.

    It answers exactly that request (`matches`), and it is either the request's expiry
    (which the driver writes to the control stream at the deadline) or an approve, reject or
    edit written by the deadline (`written_late`). Of the decisions that count, the first in
    the run's control stream is the one applied (docs/events.md, "Human approval";
    docs/decisions/0106-the-control-stream-orders-decisions-and-expiry.md).
    """
    if not matches(decided, request) or decided.decision not in DECISIONS:
        return False
    return decided.decision == Decision.EXPIRED or not written_late(decided, request)


DECISIONS: frozenset[str] = frozenset(d.value for d in Decision)
"""The decisions a run applies (`Decision`); a record with any other is never applied."""


def first_counting(records: Sequence[object], request: ApprovalRequested) -> ApprovalDecided | None:
    """The decision of ``records`` (a control stream, in order) that ``request`` takes, if any.

    The first one that `counts`: the control stream's order decides between a human's
    decision and the expiry, and between two deciders.
    """
    return next((r for r in _decisions(records) if counts(r, request)), None)


async def append_expiry(
    controls: ControlStream, request: ApprovalRequested, clock: Clock
) -> ApprovalDecided:
    """Write the expiry of ``request`` to its run's control stream (the driver, at the deadline).

    The run then applies the first decision of the stream that `counts` (`first_counting`):
    a human's decision written before this entry still does, one written after it does not,
    and its decider is told so (`decide`). The driver appends it before it reads the stream
    for the last time and before it records any decision in the log, so a run resumed after
    a crash in between finds it too (docs/events.md, "Human approval").

    Returns:
        The expiry as appended.

    Raises:
        StoreError: the write failed.
    """
    expiry = expired_decision(request, clock)
    await controls.append_control(expiry)
    return expiry


async def expire_overdue(controls: ControlStream, log: RunLog, clock: Clock) -> None:
    """Write the expiry of the request ``log`` waits on to the control stream, if it is overdue.

    Called by a drive that begins (a resume, a claim in a fleet) before it reads the control
    stream: a request whose deadline passed (by ``clock``) is expired through the stream, as
    at the deadline (`append_expiry`), so that no decision written after that reading is
    told it counts.

    Raises:
        StoreError: the write failed.
    """
    request = pending_approval(log)
    if request is not None and seconds_between(request.deadline_ts, clock.now_iso()) >= 0:
        await append_expiry(controls, request, clock)


def _controls(store: RunStore) -> ControlStream:
    if not isinstance(store, ControlStream):
        raise UsageError(
            f"{type(store).__name__} has no control streams: cancel or decide through the run's "
            "handle in the process driving it"
        )
    return store


def check_cancel_text(reason: object, canceller: object) -> None:
    """Refuse a cancel's ``reason`` or ``canceller`` that is not a ``str`` (`require_text`).

    Written as it was, the cancel record would read back as damaged (docs/crash-safety.md).

    Raises:
        UsageError: names the one that is not.
    """
    require_text("a cancel's reason", reason)
    require_text("a cancel's canceller", canceller)


async def request_cancel(
    store: RunStore,
    run_id: str,
    *,
    reason: str = "",
    canceller: str = "",
    clock: Clock | None = None,
) -> CancelRequested:
    """Durably ask whoever drives ``run_id`` to cancel it (from any process).

    The request is appended to the run's control stream. A driver picks it up within its poll
    interval (0.5 s by default) and the run ends ``cancelled``; a run nobody drives (a queued
    run included) picks it up when it is next driven
    (`treadle.finish_cancelled` ends such a run at once).

    Returns:
        The record appended to the control stream.

    Raises:
        InvalidRunId: not an allowed run id (docs/concepts.md, "Run ids"); nothing is read.
        UsageError: the run does not exist or already finished (terminal states never
            change), ``reason`` or ``canceller`` is not a ``str``, or the store has no
            control streams; or it was called from asyncio, not trio (nothing is read:
            docs/asyncio.md, "Calling treadle from asyncio").
        StoreError: the write failed.
    """
    require_trio("treadle.approvals.request_cancel")
    check_run_id(run_id)
    check_cancel_text(reason, canceller)
    controls = _controls(store)
    log = await store.read_log(run_id)
    if log.started is not None or not await _queued(store, run_id):
        _require_unfinished(log)
    record = repaired(
        CancelRequested(
            run_id=run_id,
            ts=(clock or SystemClock()).now_iso(),
            reason=reason,
            canceller=canceller,
        )
    )
    await controls.append_control(record)
    return record


class AlreadyDecided(UsageError):
    """The call a decision was meant for has a decision that counts already; this one was not.

    Raised by `decide` (docs/events.md, "Human approval": the first decision counts). The
    decision refused is not written, or, when it lost a race, written and passed over.

    Attributes:
        request: the request the decision was meant for.
        counting: the decision that counts for it (first in the run's control stream).
        same: ``counting`` is the decision refused here, the same decision, message and
            edited arguments: a decision sent twice, whose intent stands.
    """

    def __init__(
        self, message: str, *, request: ApprovalRequested, counting: ApprovalDecided, same: bool
    ) -> None:
        super().__init__(message)
        self.request = request
        self.counting = counting
        self.same = same


async def decide(
    store: RunStore,
    run_id: str,
    *,
    call_id: str | None = None,
    reject: str | None = None,
    edit: Mapping[str, JSONValue] | None = None,
    clock: Clock | None = None,
    step: int | None = None,
    arguments_digest: str | None = None,
) -> ApprovalDecided:
    """Durably approve, reject or edit the tool call ``run_id`` waits on (from any process).

    Args:
        store: the run's store.
        run_id: the run.
        call_id: the call the decision is meant for; refused when it is not the pending
            one. ``None`` takes the pending call.
        reject: reject with this message (shown to the model in the synthetic observation).
        edit: approve with these arguments instead of the model's: they replace the whole
            argument object (no merge) and must fit the tool's argument schema.
        clock: wall clock for the record's timestamp.
        step: the step of the request the decider was shown; refused when the pending one
            is of another step. ``None`` takes the pending one's.
        arguments_digest: the digest of the arguments the decider was shown
            (`ApprovalRequested.arguments_digest`); refused when the pending request's
            differ (a model may ask again under the same call id with other arguments).

    Returns:
        The decision as appended to the run's control stream.

    Raises:
        InvalidRunId: not an allowed run id (docs/concepts.md, "Run ids"); nothing is read.
        UsageError: the run does not exist, finished, waits on a request whose deadline
            passed (the decision's timestamp, by ``clock``, is after it; nothing is written
            then), is being cancelled (a cancel request in its log or control stream, also
            one written just before this decision: the run ends cancelled without applying
            it), waits on no approval, waits on another call (or on one of another step or
            arguments than ``step`` and ``arguments_digest`` say; when the call it waits on
            has a decision waiting to be applied, the message says the call named is asked
            after it), already has a decision
            for that call in its control stream (the first one counts) or the call's expiry
            there, both ``reject`` and ``edit`` were given, the edit does not fit the tool's
            argument schema in the run's parameter snapshot (nothing is written then), the
            store has no control streams, or it was called from asyncio, not trio (nothing
            is read: docs/asyncio.md, "Calling treadle from asyncio"). Also when this
            decision, once written, comes after another one in the control stream: a second
            decider's that raced it (the message names the one that counts), or the expiry
            the run's driver wrote at the deadline (the call expired; the message says so).
            Either way the decision does not count; its record stays in the append-only
            stream, where the run's driver passes over it (docs/events.md, "Human approval").
        AlreadyDecided: (a `UsageError`) refused because the call meant (by ``call_id``,
            ``step`` and ``arguments_digest``, or the one the run waits on) has a decision
            that counts already: one waiting to be applied, one that raced this one, or one
            the run applied before it moved on or finished. It says which, and whether it is
            this decision again (a decision sent twice).
        StoreError: the write failed.
    """
    require_trio("treadle.approvals.decide")
    check_run_id(run_id)
    if reject is not None and edit is not None:
        raise UsageError("a decision either rejects or edits the arguments, not both")
    controls = _controls(store)
    log = await store.read_log(run_id)
    if log.started is None and await _queued(store, run_id):
        raise UsageError(f"run {run_id!r} is queued, not started: nothing waits for a decision")

    def asked(request: ApprovalRequested) -> ApprovalDecided:
        return decision_for(
            run_id,
            request,
            clock or SystemClock(),
            reject=reject,
            edit=edit,
            snapshot=current_snapshot(log),
            redaction=Redaction.of_log(log),
        )

    try:
        request = _waited_on(log, call_id, step, arguments_digest)
    except UsageError as refused:
        meant = _meant(log, call_id, step, arguments_digest)
        await _refuse_if_decided(store, log, meant, refused, asked)
        await _refuse_before_asked(store, log, call_id, refused)
        raise
    earlier = await read_control(store, run_id)
    _refuse_after_cancel(run_id, (*log.records, *earlier), None)
    already = first_counting(earlier, request)
    if already is not None:
        _refuse_after_expiry(run_id, request, already)
        raise AlreadyDecided(
            f"call {request.call_id!r} of run {run_id!r} already has a decision "
            f"({already.decision}) waiting to be applied; the first decision counts",
            request=request,
            counting=already,
            same=_asked_again(already, lambda: asked(request)),
        )
    decided = asked(request)
    _refuse_after_deadline(run_id, request, decided)
    await controls.append_control(decided)
    written = await read_control(store, run_id)
    _refuse_after_cancel(run_id, written, decided)
    first = first_counting(written, request) or decided
    if first != decided:
        _refuse_after_expiry(run_id, request, first)
        raise AlreadyDecided(
            f"call {request.call_id!r} of run {run_id!r}: another decision ({first.decision}) "
            f"was written just before this one ({decided.decision}); the first decision counts, "
            "so this one, written after it, does not count",
            request=request,
            counting=first,
            same=_asked_again(first, lambda: decided),
        )
    return decided


def _waited_on(
    log: RunLog, call_id: str | None, step: int | None, arguments_digest: str | None
) -> ApprovalRequested:
    """The request ``log``'s run waits on, when it is the one the decider meant.

    Raises:
        UsageError: the run does not exist or finished, waits on no approval, or on another
            call than ``call_id`` (or step or arguments than ``step`` and ``arguments_digest``).
    """
    _require_unfinished(log)
    request = pending_approval(log)
    run_id = log.run_id
    if request is None:
        raise UsageError(f"run {run_id!r} is not waiting for an approval")
    if call_id is not None and call_id != request.call_id:
        raise UsageError(
            f"run {run_id!r} waits on call {request.call_id!r} ({request.tool}), not on {call_id!r}"
        )
    if (step is not None and step != request.step) or (
        arguments_digest is not None and arguments_digest != request.arguments_digest
    ):
        raise UsageError(
            f"run {run_id!r} waits on call {request.call_id!r} of step {request.step} with "
            "other arguments than those shown: look at the call it waits on now, then decide"
        )
    return request


def _meant(
    log: RunLog, call_id: str | None, step: int | None, arguments_digest: str | None
) -> ApprovalRequested | None:
    """The last request of ``log`` with the call id, step and digest given.

    ``None`` when none of them is given, or no request has them.
    """
    if call_id is None and step is None and arguments_digest is None:
        return None
    wanted = {"call_id": call_id, "step": step, "arguments_digest": arguments_digest}
    return next(
        (
            record
            for record in reversed(log.records)
            if isinstance(record, ApprovalRequested)
            and all(value in (None, getattr(record, name)) for name, value in wanted.items())
        ),
        None,
    )


async def _refuse_if_decided(
    store: RunStore,
    log: RunLog,
    meant: ApprovalRequested | None,
    refused: UsageError,
    asked: Callable[[ApprovalRequested], ApprovalDecided],
) -> None:
    """Say so when the request a refused decision was meant for was decided already.

    A decision sent again after the first was applied (the run moved on, or finished) is
    refused for that (``refused``); when the run's log (every applied decision, a handle's
    one of an older log too, which no control stream holds) or its control stream holds a
    decision that counts for ``meant``, the refusal names it (`AlreadyDecided`), and whether
    it is this one. Not when the run is being cancelled: no decision of its is applied.

    Raises:
        AlreadyDecided: ``meant`` has a decision that counts.
        StoreError: the control stream cannot be read.
    """
    if meant is None:
        return
    control = await read_control(store, log.run_id)
    if any(isinstance(record, CancelRequested) for record in (*log.records, *control)):
        return
    # the decision the run applied is in its log (a handle's of an older log nowhere else);
    # one not yet applied, in its control stream, first there
    counting = first_counting((*log.records, *control), meant)
    if counting is not None:
        raise AlreadyDecided(
            f"{refused}; its call {meant.call_id!r} has a decision ({counting.decision}), and "
            "the first decision counts",
            request=meant,
            counting=counting,
            same=_asked_again(counting, lambda: asked(meant)),
        ) from refused


async def _refuse_before_asked(
    store: RunStore, log: RunLog, call_id: str | None, refused: UsageError
) -> None:
    """Say so when a decision names a call the run has not asked about yet, behind a decided one.

    The run puts the calls of a step to a human one at a time: the next request is written
    once the decision on the call it waits on is applied. A decision for another call, sent
    while the one the run waits on has its decision in the control stream, waiting to be
    applied, is refused (``refused``: "waits on call ..."); the refusal says the call it
    waits on is decided already, and that the call named is asked after it
    (docs/events.md, "Human approval", item 2).

    Raises:
        UsageError: ``call_id`` is not the call the run waits on, and that one has a
            decision that counts in the control stream.
        StoreError: the control stream cannot be read.
    """
    request = pending_approval(log)
    if request is None or call_id is None or call_id == request.call_id:
        return
    waiting = first_counting(await read_control(store, log.run_id), request)
    if waiting is None:
        return
    raise UsageError(
        f"run {log.run_id!r} has not asked about call {call_id!r} yet: the call it waits on, "
        f"{request.call_id!r} ({request.tool}), has a decision ({waiting.decision}) waiting to "
        "be applied, and a later call that needs a human is asked once it is; decide that "
        "call then"
    ) from refused


def _asked_again(counting: ApprovalDecided, asked: Callable[[], ApprovalDecided]) -> bool:
    """Whether ``asked()`` is ``counting`` again: the same decision, message and arguments.

    ``False`` when ``asked()`` raises `UsageError` (an edit that does not fit).
    """
    try:
        wanted = asked()
    except UsageError:
        return False
    fields = ("decision", "message", "edited_arguments")
    return all(getattr(counting, name) == getattr(wanted, name) for name in fields)


def _decisions(records: Sequence[object]) -> list[ApprovalDecided]:
    return [r for r in records if isinstance(r, ApprovalDecided)]


def _refuse_after_deadline(
    run_id: str, request: ApprovalRequested, decided: ApprovalDecided
) -> None:
    """Refuse a decision stamped past the request's deadline: the run never applies it.

    The decision's own timestamp is what the run checks (`written_late`), so it is what is
    checked here, after it was stamped and before it is written (docs/events.md, "Human
    approval": one written after the deadline never counts).

    Raises:
        UsageError: ``decided.ts`` is after ``request.deadline_ts``.
    """
    if written_late(decided, request):
        raise UsageError(
            f"run {run_id!r}: the wait on call {request.call_id!r} ({request.tool}) ended at "
            f"{request.deadline_ts}; a decision written after it is never applied: the call "
            "expires when the run is next driven"
        )


def _refuse_after_expiry(run_id: str, request: ApprovalRequested, first: ApprovalDecided) -> None:
    """Refuse a decision that the request's expiry comes before in the control stream.

    ``first`` is the stream's first decision that counts (`first_counting`). When it is the
    expiry the driver wrote at the deadline, the call expired: a decision after it does not
    count, however early its timestamp (docs/events.md, "Human approval").

    Raises:
        UsageError: ``first`` is the request's expiry.
    """
    if first.decision == Decision.EXPIRED:
        raise UsageError(
            f"run {run_id!r}: the wait on call {request.call_id!r} ({request.tool}) expired at "
            f"its deadline {request.deadline_ts}: the run expired the call before this "
            "decision reached it, so the decision does not count"
        )


def _refuse_after_cancel(
    run_id: str, records: Sequence[object], decided: ApprovalDecided | None
) -> None:
    """Refuse a decision that a cancel request comes before (docs/events.md, "Human approval").

    ``records`` are the run's log and control records in order; ``decided`` is the decision
    just written among them (``None``: before writing one). A run asked to cancel ends
    ``cancelled`` without applying a decision written after the request, so its decider is
    told so rather than that it counts.

    Raises:
        UsageError: a `CancelRequested` comes before ``decided`` (or, with ``None``, at all).
    """
    for record in records:
        if record == decided:
            return
        if isinstance(record, CancelRequested):
            when = "just before this decision" if decided is not None else "already"
            raise UsageError(
                f"run {run_id!r} is being cancelled (a cancel was requested {when}): it ends "
                "cancelled, and no decision on its call is applied"
            )


async def read_control(
    store: RunStore, run_id: str
) -> tuple[CancelRequested | ApprovalDecided, ...]:
    """The records of ``run_id``'s control stream, in write order (none without streams)."""
    if not isinstance(store, ControlStream):
        return ()
    return tuple(entry.record for entry in await store.read_control(run_id))


async def _queued(store: RunStore, run_id: str) -> bool:
    """Whether ``run_id`` waits in the store's queue (submitted, never started)."""
    return isinstance(store, RunQueue) and await store.read_submission(run_id) is not None


def _require_unfinished(log: RunLog) -> None:
    if log.started is None:
        raise UsageError(f"there is no run {log.run_id!r} in this store")
    if log.finished is not None:
        raise UsageError(
            f"run {log.run_id!r} already finished ({log.finished.state.value}); "
            "a finished run never changes"
        )
