"""Hypothesis strategies for every record of `treadle.types`, every field set.

The property tests thus cover the whole log format.

Each strategy names every attrs field of its class; a test checks that (`missing_fields`), so
a field added to a record without a strategy fails loudly instead of never being exercised.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

import attrs
from hypothesis import strategies as st

from treadle import types as t

# --------------------------------------------------------------------------- building blocks

texts = st.text(max_size=40)
"""Any unicode text (no lone surrogates), including NUL, newlines and quotes."""

timestamps = st.datetimes(timezones=st.just(dt.UTC)).map(lambda d: d.isoformat())
"""UTC instants as ISO-8601 strings."""
ids = st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789-_/.", min_size=1, max_size=16)
counts = st.integers(min_value=0, max_value=10**9)
maybe_counts = st.none() | counts
seconds = st.floats(min_value=0, max_value=1e6, allow_nan=False)
maybe_seconds = st.none() | seconds

json_scalars = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | texts
)
json_values: st.SearchStrategy[Any] = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(texts, inner, max_size=4),
    max_leaves=12,
)
json_objects = st.dictionaries(texts, json_values, max_size=5)


BUILT: dict[type[Any], frozenset[str]] = {}
"""Class -> the fields its strategy names; `tests/stores/test_codec.py` checks it is all."""


def _build(cls: type[Any], **fields: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    BUILT[cls] = frozenset(fields)
    return st.builds(cls, **fields)


def missing_fields(cls: type[Any]) -> list[str]:
    """Fields of ``cls`` its strategy leaves at their defaults (never exercised)."""
    return sorted({f.name for f in attrs.fields(cls)} - BUILT[cls])


def _tuples(strategy: st.SearchStrategy[Any], max_size: int = 3) -> st.SearchStrategy[Any]:
    return st.lists(strategy, max_size=max_size).map(tuple)


# --------------------------------------------------------------------------- model shapes

image_refs = _build(
    t.ImageRef,
    url=texts,
    digest=st.none() | st.from_regex(r"sha256:[0-9a-f]{64}", fullmatch=True),
    media_type=st.none() | st.sampled_from(["image/png", "image/jpeg"]),
)
tool_calls = _build(t.ToolCall, id=ids, name=texts, arguments=json_objects)
invalid_tool_calls = _build(
    t.InvalidToolCall,
    id=ids,
    name=texts,
    raw_arguments=texts,
    reason=st.sampled_from(["truncated", "unparseable"]),
)
messages = _build(
    t.Message,
    role=st.sampled_from(["system", "user", "assistant", "tool"]),
    content=st.none() | texts,
    images=_tuples(image_refs, 2),
    tool_calls=_tuples(tool_calls, 2),
    tool_call_id=st.none() | ids,
    name=st.none() | texts,
    reasoning=st.none() | texts,
    reasoning_signature=st.none() | texts,
)
tool_specs = _build(t.ToolSpec, name=ids, description=texts, parameters=json_objects)
output_formats = _build(
    t.OutputFormat, name=ids, schema=json_objects, strict=st.booleans(), description=texts
)
context_useds = _build(
    t.ContextUsed,
    window=counts,
    budget=counts,
    estimated_input_tokens=counts,
    counted_tokens=counts,
    verbatim_from=maybe_counts,
    summary_intent_id=st.none() | ids,
    summary_through=maybe_counts,
    marked=counts,
    marked_from=maybe_counts,
    marked_to=maybe_counts,
    truncated=counts,
    forced=st.booleans(),
    unfit=st.booleans(),
    summary_run_id=st.none() | ids,
)
model_requests = _build(
    t.ModelRequest,
    messages=_tuples(messages),
    tools=_tuples(tool_specs, 2),
    model=texts,
    max_output_tokens=maybe_counts,
    params=json_objects,
    output=st.none() | output_formats,
    context=st.none() | context_useds,
)
usages = _build(
    t.Usage,
    input_tokens=maybe_counts,
    output_tokens=maybe_counts,
    reasoning_tokens=maybe_counts,
    total_tokens=maybe_counts,
    cached_input_tokens=maybe_counts,
    cache_creation_input_tokens=maybe_counts,
)
model_replies = _build(
    t.ModelReply,
    text=st.none() | texts,
    reasoning=st.none() | texts,
    reasoning_signature=st.none() | texts,
    tool_calls=_tuples(tool_calls),
    invalid_tool_calls=_tuples(invalid_tool_calls, 2),
    finish_reason=st.none() | st.sampled_from(["stop", "tool_calls", "length"]),
    usage=usages,
    response_id=st.none() | ids,
    refusal=st.none() | texts,
    provider_finish_reason=st.none() | st.sampled_from(["end_turn", "MAX_TOKENS", "eos"]),
)
model_error_infos = _build(
    t.ModelErrorInfo,
    kind=st.sampled_from(["rate_limited", "server_error", "timeout", "connection"]),
    message=texts,
    retryable=st.booleans(),
    retry_after_s=maybe_seconds,
    status=st.none() | st.integers(min_value=100, max_value=599),
)
parsed_replies = _build(
    t.ParsedReply,
    kind=st.sampled_from(t.DecisionKind),
    actions=_tuples(tool_calls),
    text=st.none() | texts,
    feedback=st.none() | texts,
    reason=st.none() | texts,
    repairs=_tuples(texts),
    history_message=messages,
)
action_outcomes = _build(
    t.ActionOutcome,
    status=st.sampled_from(t.ActionStatus),
    observation=texts,
    observation_is_synthetic=st.booleans(),
    task_completed=st.booleans(),
    observation_truncated_chars=counts,
    detail=st.none() | texts,
    revisions=st.dictionaries(texts, st.integers(), max_size=3),
    stale_resource=st.none() | texts,
    child_run_id=st.none() | ids,
    usage=st.none() | usages,
    images=_tuples(image_refs, 2),
    unknown_usage_attempts=counts,
)
actions = _build(
    t.Action,
    run_id=ids,
    step=counts,
    intent_id=ids,
    call_id=ids,
    tool=ids,
    arguments=json_objects,
    replay=st.booleans(),
    revisions=st.dictionaries(texts, _tuples(st.integers()), max_size=3),
    tokens_left=maybe_counts,
    deadline=seconds | st.just(float("inf")),
    forward=st.none() | st.just(lambda event: None),
    cancelled=st.none() | st.just(lambda: False),
    report_active_s=st.none() | st.just(lambda seconds: None),
    can_park=st.booleans(),
    timeout_s=seconds | st.just(float("inf")),
    generation=counts,
)
attempts = _build(
    t.Attempt,
    connect_s=seconds | st.just(float("inf")),
    first_byte_s=seconds | st.just(float("inf")),
    idle_s=seconds | st.just(float("inf")),
    report_usage=st.just(lambda usage: None),
    image_source=st.none() | st.just(lambda image: b""),
)

# --------------------------------------------------------------------------- definition data

budgets = _build(
    t.Budgets,
    max_steps=maybe_counts,
    max_model_attempts=maybe_counts,
    token_budget=maybe_counts,
    time_budget_s=maybe_seconds,
)
budget_caps = _build(t.BudgetCaps, token_budget=maybe_counts, time_budget_s=maybe_seconds)
limits = _build(
    t.Limits,
    tool_timeout_s=seconds,
    approval_timeout_s=seconds,
    model_connect_s=seconds,
    model_first_byte_s=seconds,
    model_idle_s=seconds,
    model_attempt_s=seconds,
    max_model_retries=counts,
    retry_initial_s=seconds,
    retry_max_s=seconds,
    retry_after_max_s=maybe_seconds,
    invalid_decisions=counts,
    max_observation_chars=maybe_counts,
)
synthetic_observations = _build(
    t.SyntheticObservations,
    not_executed=texts,
    env_error=texts,
    unknown=texts,
    rejected=texts,
    stale=texts,
)

# --------------------------------------------------------------------------- log records

run_starteds = _build(
    t.RunStarted,
    run_id=ids,
    ts=timestamps,
    input=_tuples(messages),
    snapshot=json_objects,
    schema_version=st.integers(min_value=1, max_value=t.SCHEMA_VERSION),
    agent=st.none() | ids,
    agent_version=st.none() | ids,
    surrogates_replaced=counts,
    parent_run_id=st.none() | ids,
    parent_intent_id=st.none() | ids,
    thread=st.none() | ids,
    continues=st.none() | ids,
    fork_step=st.none() | counts,
    caps=st.none() | budget_caps,
)
model_intents = _build(
    t.ModelIntent,
    run_id=ids,
    step=counts,
    intent_id=ids,
    attempt=counts,
    ts=timestamps,
    compaction=st.booleans(),
)
model_results = _build(
    t.ModelResult,
    run_id=ids,
    step=counts,
    intent_id=ids,
    ts=timestamps,
    reply=st.none() | model_replies,
    error=st.none() | model_error_infos,
    abandoned=st.booleans(),
    latency_s=maybe_seconds,
    usage=usages,
    surrogates_replaced=counts,
    context=st.none() | context_useds,
    summary_through=maybe_counts,
)
action_intents = _build(
    t.ActionIntent,
    run_id=ids,
    step=counts,
    intent_id=ids,
    call_id=ids,
    tool=ids,
    arguments=json_objects,
    ts=timestamps,
)
action_results = _build(
    t.ActionResult,
    run_id=ids,
    step=counts,
    intent_id=ids,
    call_id=ids,
    tool=ids,
    outcome=action_outcomes,
    ts=timestamps,
    duration_s=maybe_seconds,
    late=st.booleans(),
    reconciled=st.booleans(),
    surrogates_replaced=counts,
)
step_records = _build(
    t.StepRecord,
    run_id=ids,
    step=counts,
    ts=timestamps,
    model_intent_id=st.none() | ids,
    decision=st.none() | st.sampled_from(t.DecisionKind),
    history_message=st.none() | messages,
    feedback=st.none() | texts,
    model_output_text=st.none() | texts,
    visible_output_chars=counts,
    observations=_tuples(texts),
    observation_images=_tuples(_tuples(image_refs, 2), 2),
    observation_truncated_chars=counts,
    task_completed=st.booleans(),
    action_result_ids=_tuples(ids),
    env_error=st.booleans(),
    active_s=seconds,
    output=st.none() | json_objects,
    repairs=_tuples(ids),
)
totals = _build(
    t.Totals,
    steps=counts,
    model_attempts=counts,
    input_tokens=maybe_counts,
    output_tokens=maybe_counts,
    unknown_usage_attempts=counts,
    active_s=seconds,
    other_tokens=maybe_counts,
)
run_finisheds = _build(
    t.RunFinished,
    run_id=ids,
    ts=timestamps,
    state=st.sampled_from(t.RunState),
    stop_reason=st.sampled_from(t.StopReason),
    totals=totals,
    final_answer=st.none() | texts,
    error=st.none() | texts,
    model_error=st.none() | model_error_infos,
    output=st.none() | json_objects,
    sink_drops=counts,
    sink_failures=counts,
    subscriber_drops=counts,
)
cancel_requesteds = _build(
    t.CancelRequested,
    run_id=ids,
    ts=timestamps,
    reason=texts,
    canceller=texts,
    surrogates_replaced=counts,
)
approval_requesteds = _build(
    t.ApprovalRequested,
    run_id=ids,
    step=counts,
    call_id=ids,
    tool=ids,
    arguments_digest=texts,
    ts=timestamps,
    deadline_ts=timestamps,
    arguments=st.none() | json_objects,
)
approval_decideds = _build(
    t.ApprovalDecided,
    run_id=ids,
    step=counts,
    call_id=ids,
    arguments_digest=texts,
    decision=st.sampled_from(["approve", "reject", "edit"]),
    ts=timestamps,
    message=texts,
    edited_arguments=st.none() | json_objects,
    tool=st.just("") | ids,
    surrogates_replaced=counts,
)

definition_accepteds = _build(
    t.DefinitionAccepted,
    run_id=ids,
    ts=timestamps,
    changed=_tuples(ids),
    snapshot=json_objects,
    agent_version=st.none() | ids,
    accepted_by=texts,
)
children_awaiteds = _build(
    t.ChildrenAwaited,
    run_id=ids,
    step=counts,
    ts=timestamps,
    intent_ids=_tuples(ids),
    children=_tuples(ids),
    active_s=seconds,
    recheck_ts=timestamps,
)

RECORD_STRATEGIES: dict[type[Any], st.SearchStrategy[Any]] = {
    t.RunStarted: run_starteds,
    t.ModelIntent: model_intents,
    t.ModelResult: model_results,
    t.ActionIntent: action_intents,
    t.ActionResult: action_results,
    t.StepRecord: step_records,
    t.RunFinished: run_finisheds,
    t.CancelRequested: cancel_requesteds,
    t.ApprovalRequested: approval_requesteds,
    t.ApprovalDecided: approval_decideds,
    t.DefinitionAccepted: definition_accepteds,
    t.ChildrenAwaited: children_awaiteds,
}
"""Log record class -> strategy; one entry per member of `treadle.types.Record`."""

records: st.SearchStrategy[t.Record] = st.one_of(*RECORD_STRATEGIES.values())
"""Any log record."""

run_logs = _build(t.RunLog, run_id=ids, records=_tuples(records, 6))
events = _build(
    t.Event,
    run_id=ids,
    seq=counts,
    kind=st.sampled_from(t.EventKind),
    record=st.none() | records,
    text=st.none() | texts,
    ordinal=counts,
    step=st.none() | counts,
)
seconds = st.floats(min_value=0, max_value=2e9, allow_nan=False)
leases = _build(
    t.Lease, run_id=ids, owner=texts, generation=counts, expires_at=seconds, heartbeat_at=seconds
)
control_entries = _build(
    t.ControlEntry,
    run_id=ids,
    position=counts,
    record=st.one_of(cancel_requesteds, approval_decideds),
)
run_summaries = _build(
    t.RunSummary,
    run_id=ids,
    state=st.none() | st.sampled_from(t.RunState),
    liveness=st.sampled_from(t.Liveness),
    observed_at=seconds,
    lease=st.none() | leases,
    agent=st.none() | ids,
    agent_version=st.none() | ids,
    steps=counts,
    stop_reason=st.none() | st.sampled_from(t.StopReason),
    started_at=st.none() | timestamps,
    submitted_at=st.none() | seconds,
    claims=counts,
    takeovers=counts,
    quarantined=st.none() | texts,
    awaiting_until=st.none() | timestamps,
    error=st.none() | texts,
    where=st.none() | texts,
    records=st.none() | counts,
)
submissions = _build(
    t.Submission,
    run_id=ids,
    agent=ids,
    input=_tuples(messages),
    submitted_at=seconds,
    caps=st.none() | budget_caps,
    parent_run_id=st.none() | ids,
    parent_intent_id=st.none() | ids,
)
claims = _build(
    t.Claim,
    lease=leases,
    agent=ids,
    submission=st.none() | submissions,
    takeover=st.booleans(),
)
run_results = _build(
    t.RunResult,
    run_id=ids,
    state=st.sampled_from(t.RunState),
    stop_reason=st.sampled_from(t.StopReason),
    totals=totals,
    final_answer=st.none() | texts,
    error=st.none() | texts,
    model_error=st.none() | model_error_infos,
    output=st.none() | json_objects,
)
