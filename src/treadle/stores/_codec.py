"""The one private codec of log records: records <-> stored bytes, for every durable store.

Two encodings live here; the tag a record is stored under says which one it is
(docs/decisions/0085-compact-log-records.md):

* **compact** (every record written now): one JSON array, ``[tag, field, field, ...]``, the
  fields in the fixed order of `WIRE`, with the trailing ones that hold their default left
  out. What the row or file already says is not repeated: the run id (the row's key, the
  file's header) is left out and restored on read; an intent id of the run's own form
  (``<run_id>/s<step>/m<attempt>``, docs/decisions/0001) is its number; a UTC timestamp of
  the clock's form is its microseconds since the epoch, but only when formatting them back
  gives the very same text. Tags are two letters (`TAG_OF`). Decoding checks every field's
  type (msgspec) and refuses an array longer than the fields it knows.
* **objects** (logs written before): one JSON object of the record's non-default fields with
  its ``kind`` (`KIND_OF`), made by cattrs. It is still read, and still written where a
  stored format requires it (control streams, and appends to a JSONL file begun in it); it is
  also the named form the command line, the console and event streams show a record in
  (`record_to_dict`).

Unknown keys, unknown tags and wrong types are refused, so a typo or a foreign record never
decodes silently. A run-started record from a newer schema version is refused by
`check_schema`.
"""

from __future__ import annotations

import datetime as dt
import enum
import functools
import json
import types
import typing
import zlib
from collections.abc import Callable, Mapping
from typing import Annotated, Any, Final, TypeAlias, Union

import attrs
import cattrs
import msgspec
import orjson
from cattrs.preconf.json import make_converter
from cattrs.strategies import configure_tagged_union

from treadle._exceptions import SchemaTooNew
from treadle.types import (
    SCHEMA_VERSION,
    ActionIntent,
    ActionOutcome,
    ActionResult,
    ApprovalDecided,
    ApprovalRequested,
    BudgetCaps,
    CancelRequested,
    ChildrenAwaited,
    ContextUsed,
    DefinitionAccepted,
    Event,
    ImageRef,
    InvalidToolCall,
    Message,
    ModelErrorInfo,
    ModelIntent,
    ModelReply,
    ModelResult,
    Record,
    RunFinished,
    RunStarted,
    StepRecord,
    Submission,
    ToolCall,
    Totals,
    Usage,
)

KIND_OF: Final[dict[type[Any], str]] = {
    RunStarted: "run_started",
    ModelIntent: "model_intent",
    ModelResult: "model_result",
    ActionIntent: "action_intent",
    ActionResult: "action_result",
    StepRecord: "step",
    RunFinished: "run_finished",
    CancelRequested: "cancel_requested",
    ApprovalRequested: "approval_requested",
    ApprovalDecided: "approval_decided",
    DefinitionAccepted: "definition_accepted",
    ChildrenAwaited: "children_awaited",
}
"""Record class -> tag of the objects encoding (and of events). Tags are schema: never rename
one."""

_CLASS_OF: Final[dict[str, type[Any]]] = {tag: cls for cls, tag in KIND_OF.items()}

TAG_OF: Final[dict[type[Any], str]] = {
    RunStarted: "rs",
    ModelIntent: "mi",
    ModelResult: "mr",
    ActionIntent: "ai",
    ActionResult: "ar",
    StepRecord: "st",
    RunFinished: "rf",
    CancelRequested: "cr",
    ApprovalRequested: "aq",
    ApprovalDecided: "ad",
    DefinitionAccepted: "da",
    ChildrenAwaited: "ca",
}
"""Record class -> tag of the compact encoding. Tags are schema: never rename one."""

CLASS_OF_TAG: Final[dict[str, type[Any]]] = {tag: cls for cls, tag in TAG_OF.items()}

STEP_KINDS: Final = (KIND_OF[StepRecord], TAG_OF[StepRecord])
"""The tags a step record is stored under, in either encoding."""


# --------------------------------------------------------------------------- objects (cattrs)


def _make() -> cattrs.Converter:
    conv = make_converter(forbid_extra_keys=True, omit_if_default=True)
    configure_tagged_union(
        Record,
        conv,
        tag_name="kind",
        tag_generator=lambda cls: KIND_OF[cls],
    )
    return conv


@functools.cache
def _converter() -> cattrs.Converter:
    """The objects encoding's converter, made when first used.

    Making it takes tens of ms, and a process that meets only compact records never needs it.
    """
    return _make()


def record_to_dict(record: Record) -> dict[str, Any]:
    """Unstructure ``record`` into plain JSON data with its ``kind`` tag (last key).

    The named form of a record, for people and event streams (the objects encoding).
    """
    data: dict[str, Any] = _converter().unstructure(record)
    data["kind"] = KIND_OF[type(record)]
    return data


def event_to_dict(event: Event) -> dict[str, Any]:
    """One event as JSON data: ``{"seq", "kind", "run_id", ...}``.

    The shape ``treadle tail --json``, ``treadle show --json`` and `treadle.asyncio.event_data`
    give (docs/events.md, "Reading events"): the event kind (docs/events.md, "Event types")
    and the run the event belongs to, then a durable event's record fields, a delta's or a
    warning's ``ordinal`` and ``text``, or a step-started event's ``step`` and ``ordinal``.
    Every event names its run, so a stream that carries a child run's events beside its
    parent's (docs/child-runs.md, "Events") tells them apart.
    """
    data: dict[str, Any] = {"seq": event.seq, "kind": event.kind.value, "run_id": event.run_id}
    if event.record is not None:
        fields = record_to_dict(event.record)
        del fields["kind"]  # the record's tag in the log format; the event kind names it here
        data.update(fields)
    elif event.text is not None:
        data.update(ordinal=event.ordinal, text=event.text)
    else:
        data.update(step=event.step, ordinal=event.ordinal)
    return data


def record_from_dict(data: dict[str, Any]) -> Record:
    """Structure plain JSON data (with ``kind``) into a record.

    Raises:
        cattrs.BaseValidationError: the data does not match the record schema.
        KeyError: the ``kind`` tag is missing or unknown.
    """
    cls = _CLASS_OF[data["kind"]]
    payload = {k: v for k, v in data.items() if k != "kind"}
    record: Record = _converter().structure(payload, cls)
    return record


def record_to_json(record: Record) -> str:
    """Serialise ``record`` in the objects encoding: one line of compact JSON (no newline).

    orjson is the fast path; values it refuses (integers beyond 64 bits, lone surrogates)
    take the standard library's path with ASCII escapes, which round-trips them exactly.
    """
    data = record_to_dict(record)
    try:
        return orjson.dumps(data).decode("utf-8")
    except orjson.JSONEncodeError:
        return json.dumps(data, ensure_ascii=True, separators=(",", ":"))


def encode_bytes(record: Record) -> bytes:
    """`record_to_json` as UTF-8 bytes (orjson's output as is on the fast path)."""
    data = record_to_dict(record)
    try:
        return orjson.dumps(data)
    except orjson.JSONEncodeError:
        return json.dumps(data, ensure_ascii=True, separators=(",", ":")).encode("ascii")


def decode(text: str | bytes) -> Record:
    """Parse one record of the objects encoding; raises `ValueError` (or a cattrs error)."""
    # The standard library's decoder: orjson would turn integers beyond 64 bits into floats.
    data = json.loads(text)
    if not isinstance(data, dict):
        raise ValueError(f"a JSON {type(data).__name__}, not an object")  # noqa: TRY004 - input
    return record_from_dict(data)


def record_crc(run_id: str, seq: int, generation: int, kind: str, body: bytes) -> int:
    """The CRC-32 (zlib) a stored record row carries: over its key, generation, tag and body.

    A bit flipped anywhere in the row (a changed run id, seq, generation, tag or body byte)
    changes it, so a read refuses the row instead of returning a different log.
    """
    head = f"{run_id}\x1f{seq}\x1f{generation}\x1f{kind}\x1f".encode("utf-8", "surrogatepass")
    return zlib.crc32(body, zlib.crc32(head))


def encode_submission(submission: Submission) -> bytes:
    """A queue entry's stored part as JSON bytes: its input, and a child run's caps and parent.

    A plain submission is its list of input messages (the form every version reads); one
    that carries caps or a parent is an object ``{"input": [...], "caps": {...}, "parent":
    [run id, intent id]}``.
    """
    messages = _converter().unstructure(submission.input, tuple[Message, ...])
    parent = submission.parent_run_id, submission.parent_intent_id
    if submission.caps is None and parent == (None, None):
        return orjson.dumps(messages)
    data: dict[str, Any] = {"input": messages}
    if submission.caps is not None:
        data["caps"] = _converter().unstructure(submission.caps)
    if parent != (None, None):
        data["parent"] = list(parent)
    return orjson.dumps(data)


def decode_submission(
    data: bytes | str, *, run_id: str, agent: str, submitted_at: float
) -> Submission:
    """The queue entry `encode_submission` stored.

    Raises:
        ValueError: neither form (a cattrs error included).
    """
    try:
        found = json.loads(data)
        parts = found if isinstance(found, dict) else {"input": found}
        if set(parts) - {"input", "caps", "parent"}:
            raise ValueError(f"unknown keys {sorted(set(parts) - {'input', 'caps', 'parent'})}")
        caps = parts.get("caps")
        parent = parts.get("parent") or (None, None)
        run, intent = parent
        return Submission(
            run_id=run_id,
            agent=agent,
            input=_converter().structure(parts["input"], tuple[Message, ...]),
            submitted_at=submitted_at,
            caps=None if caps is None else _converter().structure(caps, BudgetCaps),
            parent_run_id=run if isinstance(run, str) else None,
            parent_intent_id=intent if isinstance(intent, str) else None,
        )
    except (cattrs.BaseValidationError, KeyError, TypeError) as exc:
        raise ValueError(f"not a queue entry: {exc}") from exc


def check_schema(record: Record) -> None:
    """Refuse a run-started record written by a newer schema version.

    Raises:
        SchemaTooNew: ``record.schema_version`` exceeds `SCHEMA_VERSION`.
    """
    if isinstance(record, RunStarted) and record.schema_version > SCHEMA_VERSION:
        raise SchemaTooNew(record.schema_version, SCHEMA_VERSION)


# --------------------------------------------------------------------------- compact: timestamps

_EPOCH: Final = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)
_EPOCH_ORDINAL: Final = dt.date(1970, 1, 1).toordinal()
_ONE_US: Final = dt.timedelta(microseconds=1)
_MINUTE_US: Final = 60_000_000
_MINUTES: dict[int, str] = {}
"""Minute (since the epoch) -> ``YYYY-MM-DDTHH:MM:`` (a log's instants share few minutes)."""
_MINUTE_OF: dict[str, int] = {}
"""The other way: ``YYYY-MM-DDTHH:MM:`` -> minute since the epoch."""


def micros_text(micros: int) -> str:
    """The UTC instant ``micros`` microseconds after the epoch, as the clock writes it.

    ``YYYY-MM-DDTHH:MM:SS.ffffff+00:00``, without the fraction when it is zero
    (`datetime.isoformat`'s form).

    Raises:
        ValueError: the instant is outside years 1 to 9999.
    """
    minute, rest = divmod(micros, _MINUTE_US)
    head = _MINUTES.get(minute)
    if head is None:
        day, minutes = divmod(minute, 1440)
        try:
            date = dt.date.fromordinal(_EPOCH_ORDINAL + day).isoformat()
        except OverflowError as exc:
            raise ValueError(f"{micros} microseconds is no instant of years 1 to 9999") from exc
        head = f"{date}T{minutes // 60:02d}:{minutes % 60:02d}:"
        if len(_MINUTES) >= 4096:
            _MINUTES.clear()
        _MINUTES[minute] = head
    digits = str(rest + 100_000_000)  # "1SSffffff"
    if rest % 1_000_000:
        return f"{head}{digits[1:3]}.{digits[3:]}+00:00"
    return f"{head}{digits[1:3]}+00:00"


def compact_ts(text: str) -> int | str:
    """``text`` as microseconds since the epoch when `micros_text` gives it back exactly.

    Any other text (another offset, another precision, not a timestamp) is kept as it is.
    Exact by construction: the date, hour and minute must be those `micros_text` writes for
    their minute (checked once per minute), the seconds two ASCII digits below 60, the
    fraction six ASCII digits, not all zero (`micros_text` leaves a zero fraction out).
    """
    size = len(text)
    if size == 32:
        fraction = text[20:26]
        if text[19] != "." or not text.endswith("+00:00") or fraction == "000000":
            return text
    elif size == 25 and text.endswith("+00:00"):
        fraction = "000000"
    else:
        return text
    seconds = text[17:19]
    digits = seconds + fraction
    if not (digits.isascii() and digits.isdigit()) or seconds >= "60":
        return text
    head = text[:17]
    minute = _MINUTE_OF.get(head)
    if minute is None:
        minute = _minute_of(head)
        if minute is None:
            return text
    return minute * _MINUTE_US + int(digits)


def _minute_of(head: str) -> int | None:
    """The minute ``YYYY-MM-DDTHH:MM:`` names, when `micros_text` writes it so; else ``None``."""
    try:
        instant = dt.datetime.fromisoformat(f"{head}00+00:00")
    except ValueError:
        return None
    minute = (instant - _EPOCH) // _ONE_US // _MINUTE_US
    if micros_text(minute * _MINUTE_US)[:17] != head:
        return None
    if len(_MINUTE_OF) >= 4096:
        _MINUTE_OF.clear()
    _MINUTE_OF[head] = minute
    return minute


# --------------------------------------------------------------------------- compact: intent ids


def _ref_out(value: str, prefix: str) -> int | str:
    """``value`` as its number when it is ``prefix`` + a number written plainly, else itself."""
    if value.startswith(prefix):
        digits = value[len(prefix) :]
        if digits.isascii() and digits.isdigit() and (digits[0] != "0" or digits == "0"):
            return int(digits)
    return value


# --------------------------------------------------------------------------- compact: the schema

WIRE: Final[dict[type[Any], tuple[str, ...]]] = {
    # nested shapes
    BudgetCaps: ("token_budget", "time_budget_s"),
    ImageRef: ("url", "digest", "media_type"),
    ToolCall: ("id", "name", "arguments"),
    InvalidToolCall: ("id", "name", "raw_arguments", "reason"),
    Message: (
        "role",
        "content",
        "tool_calls",
        "images",
        "reasoning",
        "reasoning_signature",
        "tool_call_id",
        "name",
    ),
    ContextUsed: (
        "window",
        "budget",
        "estimated_input_tokens",
        "counted_tokens",
        "verbatim_from",
        "summary_intent_id",
        "summary_through",
        "marked",
        "marked_from",
        "marked_to",
        "truncated",
        "forced",
        "unfit",
        "summary_run_id",
    ),
    Usage: (
        "input_tokens",
        "output_tokens",
        "total_tokens",
        "reasoning_tokens",
        "cached_input_tokens",
        "cache_creation_input_tokens",
    ),
    ModelReply: (
        "tool_calls",
        "finish_reason",
        "text",
        "usage",
        "reasoning",
        "reasoning_signature",
        "response_id",
        "invalid_tool_calls",
        "refusal",
        "provider_finish_reason",
    ),
    ModelErrorInfo: ("kind", "message", "retryable", "retry_after_s", "status"),
    ActionOutcome: (
        "status",
        "observation",
        "observation_is_synthetic",
        "task_completed",
        "observation_truncated_chars",
        "detail",
        "revisions",
        "stale_resource",
        "child_run_id",
        "usage",
        "images",
        "unknown_usage_attempts",
    ),
    Totals: (
        "steps",
        "model_attempts",
        "input_tokens",
        "output_tokens",
        "unknown_usage_attempts",
        "active_s",
        "other_tokens",
    ),
    # records (the run id is the row's or the file's)
    RunStarted: (
        "ts",
        "input",
        "snapshot",
        "schema_version",
        "agent_version",
        "agent",
        "surrogates_replaced",
        "parent_run_id",
        "parent_intent_id",
        "thread",
        "continues",
        "fork_step",
        "caps",
    ),
    ModelIntent: ("step", "attempt", "ts", "intent_id", "compaction"),
    ModelResult: (
        "step",
        "intent_id",
        "ts",
        "reply",
        "latency_s",
        "usage",
        "error",
        "abandoned",
        "surrogates_replaced",
        "context",
        "summary_through",
    ),
    ActionIntent: ("step", "intent_id", "call_id", "tool", "arguments", "ts"),
    ActionResult: (
        "step",
        "intent_id",
        "call_id",
        "tool",
        "outcome",
        "ts",
        "duration_s",
        "late",
        "reconciled",
        "surrogates_replaced",
    ),
    StepRecord: (
        "step",
        "ts",
        "model_intent_id",
        "decision",
        "history_message",
        "observations",
        "action_result_ids",
        "active_s",
        "model_output_text",
        "visible_output_chars",
        "task_completed",
        "feedback",
        "observation_images",
        "observation_truncated_chars",
        "env_error",
        "output",
        "repairs",
    ),
    RunFinished: (
        "ts",
        "state",
        "stop_reason",
        "totals",
        "final_answer",
        "error",
        "model_error",
        "output",
        "sink_drops",
        "sink_failures",
        "subscriber_drops",
    ),
    CancelRequested: ("ts", "reason", "canceller", "surrogates_replaced"),
    ApprovalRequested: (
        "step",
        "call_id",
        "tool",
        "arguments_digest",
        "ts",
        "deadline_ts",
        "arguments",
    ),
    ApprovalDecided: (
        "step",
        "call_id",
        "arguments_digest",
        "decision",
        "ts",
        "message",
        "edited_arguments",
        "tool",
        "surrogates_replaced",
    ),
    DefinitionAccepted: ("ts", "changed", "snapshot", "agent_version", "accepted_by"),
    ChildrenAwaited: ("step", "ts", "intent_ids", "children", "active_s", "recheck_ts"),
}
"""Class -> its fields in the order the compact encoding writes them (a record's run id is
never written). Positions are schema: a new field goes last, an old one is never moved.
Fields without a default come first; the trailing fields that hold their default are left
out of each array."""

_ALWAYS: Final = frozenset({(RunStarted, "schema_version")})
"""Fields written even when they hold their default: a default that changes between versions
(the schema version of the writer) must not be read back as the reader's."""

_TS: Final = "ts"
_OWN_MODEL_ID: Final = "own_model_id"
_MODEL_REF: Final = "model_ref"
_ACTION_REF: Final = "action_ref"
_ACTION_REFS: Final = "action_refs"

_SPECIAL: Final[dict[tuple[type[Any], str], str]] = {
    **{(cls, "ts"): _TS for cls in TAG_OF},
    (ApprovalRequested, "deadline_ts"): _TS,
    (ModelIntent, "intent_id"): _OWN_MODEL_ID,
    (ModelResult, "intent_id"): _MODEL_REF,
    (StepRecord, "model_intent_id"): _MODEL_REF,
    (ActionIntent, "intent_id"): _ACTION_REF,
    (ActionResult, "intent_id"): _ACTION_REF,
    (StepRecord, "action_result_ids"): _ACTION_REFS,
}
"""Fields written in a shorter form than their value (see the module docstring)."""

_Count = Annotated[int, msgspec.Meta(ge=0)]
_WIRE_TYPE_OF_SPECIAL: Final[dict[str, Any]] = {
    _TS: int | str,
    _OWN_MODEL_ID: str | None,
    _MODEL_REF: _Count | str,
    _ACTION_REF: _Count | str,
    _ACTION_REFS: tuple[_Count | str, ...],
}


@attrs.frozen
class _Shape:
    """What the schema builder made of one class: its wire struct, encoder and decoder."""

    wire: type[msgspec.Struct]
    encode: Callable[..., list[Any]]
    decode: Callable[..., Any]
    source: str


_SHAPES: dict[type[Any], _Shape] = {}


def _wire_type(tp: Any) -> Any:
    """The msgspec type the compact form of a value of type ``tp`` is checked against."""
    if tp is Any or tp in (str, int, float, bool, type(None)):
        return tp
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return tp
    if isinstance(tp, type) and attrs.has(tp):
        return _SHAPES[tp].wire
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (Union, types.UnionType):
        return Union[tuple(_wire_type(a) for a in args)]  # noqa: UP007 - computed members
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        return tuple[_wire_type(args[0]), ...]  # type: ignore[misc]
    if origin in (Mapping, dict) and args[0] is str:
        return dict[str, _wire_type(args[1])]  # type: ignore[misc]
    raise TypeError(f"the compact encoding has no form for {tp!r}")


def _shape_of(tp: Any) -> tuple[str, type[Any] | None]:
    """How a value of type ``tp`` is converted, and the attrs class it holds (if any).

    ``object`` (an attrs instance), ``objects`` (a tuple of them), ``objects2`` (a tuple of
    tuples of them), ``mapping``, or ``plain`` (JSON data as it is); ``optional_`` before
    ``object`` and ``mapping`` when the value may be ``None``.
    """
    if isinstance(tp, type) and attrs.has(tp):
        return "object", tp
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (Union, types.UnionType):
        members = [a for a in args if a is not type(None)]
        if len(members) == 1 and len(args) == 2:
            kind, cls = _shape_of(members[0])
            if kind in ("object", "mapping"):
                return f"optional_{kind}", cls
        return "plain", None
    if origin is tuple and len(args) == 2:
        inner, cls = _shape_of(args[0])
        if inner in ("object", "objects"):
            return f"{inner}{'2' if inner == 'objects' else 's'}", cls
        return "plain", None
    if origin in (Mapping, dict):
        return "mapping", None
    return "plain", None


def _as_dict(value: Mapping[str, Any]) -> dict[str, Any]:
    return value if type(value) is dict else dict(value)


_CONVERSIONS: Final[dict[str, tuple[str, str]]] = {
    # shape -> (record value to wire, wire value to record), as Python expressions: {v} is
    # the value, {n} the name of the nested class (its encoder _enc_{n}, decoder _dec_{n})
    "plain": ("{v}", "{v}"),
    "mapping": ("_as_dict({v})", "{v}"),
    "optional_mapping": ("(None if {v} is None else _as_dict({v}))", "{v}"),
    "object": ("_enc_{n}({v})", "_dec_{n}({v})"),
    "optional_object": (
        "(None if {v} is None else _enc_{n}({v}))",
        "(None if {v} is None else _dec_{n}({v}))",
    ),
    "objects": (
        "[_enc_{n}(x) for x in {v}]",
        "(tuple([_dec_{n}(x) for x in {v}]) if {v} else ())",
    ),
    "objects2": (
        "[[_enc_{n}(y) for y in x] for x in {v}]",
        "(tuple([tuple([_dec_{n}(y) for y in x]) for x in {v}]) if {v} else ())",
    ),
}

_SPECIAL_CONVERSIONS: Final[dict[str, tuple[str, str]]] = {
    _TS: ("_ts_out({v})", "({v} if type({v}) is str else _micros_text({v}))"),
    _OWN_MODEL_ID: (
        "(None if {v} == f'{{run_id}}/s{{r.step}}/m{{r.attempt}}' else {v})",
        "(f'{{run_id}}/s{{w.step}}/m{{w.attempt}}' if {v} is None else {v})",
    ),
    _MODEL_REF: (
        "_ref_out({v}, f'{{run_id}}/s{{r.step}}/m')",
        "({v} if type({v}) is str else f'{{run_id}}/s{{w.step}}/m{{{v}}}')",
    ),
    _ACTION_REF: (
        "_ref_out({v}, f'{{run_id}}/s{{r.step}}/a')",
        "({v} if type({v}) is str else f'{{run_id}}/s{{w.step}}/a{{{v}}}')",
    ),
    _ACTION_REFS: (
        "[_ref_out(x, f'{{run_id}}/s{{r.step}}/a') for x in {v}]",
        "(tuple([x if type(x) is str else f'{{run_id}}/s{{w.step}}/a{{x}}' for x in {v}])"
        " if {v} else ())",
    ),
}


def _plain_attrs(cls: type[Any]) -> bool:
    """Whether ``cls`` is built by its ``__init__`` alone (slots, no validator or converter).

    Without a post-init hook either, its instances may be made by setting their slots directly.
    """
    return (
        "__slots__" in cls.__dict__
        and not hasattr(cls, "__attrs_post_init__")
        and not hasattr(cls, "__attrs_pre_init__")
        and all(f.validator is None and f.converter is None for f in attrs.fields(cls))
    )


def _build(cls: type[Any]) -> _Shape:
    """Make the wire struct, the encoder and the decoder of ``cls`` (nested classes first).

    The encoder and decoder are generated Python functions, one call per object and no loop
    over fields, as attrs and cattrs make theirs. The encoder first finds the last field that
    does not hold its default, then converts the fields up to it only. The decoder of a class
    built by its ``__init__`` alone sets the instance's slots directly (what that ``__init__``
    does, at half the cost); a nested value equal to its field's shared default instance (an
    unreported `Usage`, say) is that instance.
    """
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in attrs.fields(cls)}
    order = WIRE[cls]
    tag = TAG_OF.get(cls)
    expected = set(fields) - ({"run_id"} if tag is not None else set())
    if set(order) != expected or len(order) != len(expected):
        raise TypeError(f"WIRE[{cls.__name__}] must name each of {sorted(expected)} once")
    env: dict[str, Any] = {
        "_cls": cls,
        "_new": object.__new__,
        "_ts_out": compact_ts,
        "_micros_text": micros_text,
        "_ref_out": _ref_out,
        "_as_dict": _as_dict,
    }
    wire_fields: list[Any] = []
    required: list[str] = [repr(tag)] if tag is not None else []  # always written
    optional: list[tuple[str, str]] = []  # (written value, test that it is not its default)
    values: dict[str, str] = {"run_id": "run_id"} if tag is not None else {}
    for name in order:
        field, tp = fields[name], hints[name]
        special = _SPECIAL.get((cls, name))
        inner: type[Any] | None = None
        if special is not None:
            out, back = _SPECIAL_CONVERSIONS[special]
            wire_type = _WIRE_TYPE_OF_SPECIAL[special]
            if special != _OWN_MODEL_ID and type(None) in typing.get_args(tp):
                wire_type = wire_type | None
                out = f"(None if {{v}} is None else {out})"
                back = f"(None if {{v}} is None else {back})"
        else:
            shape, inner = _shape_of(tp)
            out, back = _CONVERSIONS[shape]
            wire_type = _wire_type(tp)
            if inner is not None:
                env[f"_enc_{inner.__name__}"] = _SHAPES[inner].encode
                env[f"_dec_{inner.__name__}"] = _SHAPES[inner].decode
        nested = inner.__name__ if inner is not None else ""
        written = out.format(v=f"r.{name}", n=nested)
        values[name] = back.format(v=f"w.{name}", n=nested)
        if special == _OWN_MODEL_ID:  # left out (None) when it has the run's own form
            optional.append((written, f"r.{name} != f'{{run_id}}/s{{r.step}}/m{{r.attempt}}'"))
            wire_fields.append((name, wire_type, None))
            continue
        if field.default is attrs.NOTHING or (cls, name) in _ALWAYS:
            if optional:
                raise TypeError(f"WIRE[{cls.__name__}]: {name!r} (required) follows an optional")
            required.append(written)
            wire_fields.append((name, wire_type))
            continue
        default = field.default
        if isinstance(default, attrs.Factory):  # type: ignore[arg-type]
            default = default.factory()
        elif inner is not None and attrs.has(type(default)):  # a shared default instance
            env[f"_wire_default_{name}"] = _wire_struct(default)
            values[name] = (
                f"(_default_{name} if w.{name} == _wire_default_{name} else {values[name]})"
            )
        env[f"_default_{name}"] = default
        test = f"r.{name} is not None" if default is None else f"r.{name} != _default_{name}"
        optional.append((written, test))
        wire_fields.append((name, wire_type, _struct_default(default)))
    wire = msgspec.defstruct(
        f"Wire{cls.__name__}",
        wire_fields,
        array_like=True,
        tag=tag,
        forbid_unknown_fields=True,  # an array longer than the fields is refused
        gc=False,
    )
    run_arg = ", run_id" if tag is not None else ""
    encode = [f"def encode(r{run_arg}):\n"]
    if optional:  # n: how many optional fields to write (up to the last not at its default)
        for count in range(len(optional), 0, -1):
            keyword = "if" if count == len(optional) else "elif"
            encode.append(f"    {keyword} {optional[count - 1][1]}:\n        n = {count}\n")
        encode.append("    else:\n        return [" + ", ".join(required) + "]\n")
    encode.append(f"    out = [{', '.join(required)}]\n")
    for count, (written, _) in enumerate(optional, start=1):
        encode.append(f"    if n >= {count}:\n        out.append({written})\n")
    encode.append("    return out\n")
    if _plain_attrs(cls):
        for name in values:
            env[f"_set_{name}"] = cls.__dict__[name].__set__
        body = "".join(f"    _set_{name}(o, {value})\n" for name, value in values.items())
        make = f"    o = _new(_cls)\n{body}    return o\n"
    else:
        make = f"    return _cls({', '.join(f'{k}={v}' for k, v in values.items())})\n"
    source = "".join(encode) + f"def decode(w{run_arg}):\n{make}"
    exec(compile(source, f"<treadle compact codec: {cls.__name__}>", "exec"), env)
    return _Shape(wire=wire, encode=env["encode"], decode=env["decode"], source=source)


def _wire_struct(value: Any) -> msgspec.Struct:
    """An attrs instance as its (untagged) wire struct."""
    shape = _SHAPES[type(value)]
    wired: msgspec.Struct = msgspec.convert(shape.encode(value), type=shape.wire)
    return wired


def _struct_default(default: Any) -> Any:
    """The default a wire struct field takes when its array is shorter (a record default)."""
    if isinstance(default, dict):
        if default:
            raise TypeError(f"no wire default for {default!r}")
        return msgspec.field(default_factory=dict)
    if attrs.has(type(default)):
        wired = _wire_struct(default)
        return msgspec.field(default_factory=lambda: wired)
    return default


for _cls in WIRE:  # nested shapes are listed before the classes that hold them
    _SHAPES[_cls] = _build(_cls)

_ENCODER: Final = msgspec.json.Encoder()

Body: TypeAlias = bytes | str | msgspec.Raw
"""A stored record's JSON text: a row's body, or a record of a JSONL frame left undecoded."""


def _unpacker(decoder: msgspec.json.Decoder[Any]) -> Callable[[Body, str], Record]:
    """The function that decodes a compact body with ``decoder`` and builds its record."""
    decode_wire = decoder.decode
    build = {_SHAPES[cls].wire: _SHAPES[cls].decode for cls in TAG_OF}

    def unpack_body(body: Body, run_id: str) -> Record:
        try:
            wire = decode_wire(body)
        except msgspec.DecodeError:
            data = body.encode() if isinstance(body, str) else bytes(body)  # msgspec.Raw too
            if b"\\u" not in data:
                raise
            # escaped lone surrogates, which msgspec's parser refuses: the standard library's
            wire = msgspec.convert(json.loads(data), type=decoder.type)
        record: Record = build[type(wire)](wire, run_id)
        return record

    return unpack_body


_UNPACK: Final[dict[str, Callable[[Body, str], Record]]] = {
    tag: _unpacker(msgspec.json.Decoder(_SHAPES[cls].wire)) for tag, cls in CLASS_OF_TAG.items()
}
_UNPACK_ANY: Final = _unpacker(
    msgspec.json.Decoder(Union[tuple(_SHAPES[cls].wire for cls in TAG_OF)])  # noqa: UP007
)


def pack(record: Record, run_id: str) -> bytes:
    """``record`` in the compact encoding: ``[tag, ...fields]`` as one line of JSON bytes.

    Lone surrogates (which the log never holds, docs/crash-safety.md, "Text that is not
    Unicode", but a caller may still write) are written with ASCII escapes.

    Raises:
        ValueError: the record belongs to another run than ``run_id``.
        TypeError: a value is not JSON data (a set, an object).
    """
    if record.run_id != run_id:
        raise ValueError(f"a record of run {record.run_id!r} in the log of run {run_id!r}")
    items = _SHAPES[type(record)].encode(record, run_id)
    try:
        return _ENCODER.encode(items)
    except UnicodeEncodeError:
        return json.dumps(items, ensure_ascii=True, separators=(",", ":")).encode("ascii")


def unpack(body: Body, run_id: str, kind: str | None = None) -> Record:
    """The record a compact body holds, with ``run_id`` restored.

    Args:
        body: the bytes `pack` made.
        run_id: the run of the row or file it was read from.
        kind: the tag the row was stored under (the body must carry the same); ``None``
            takes the body's own.

    Raises:
        ValueError: not a compact record, a tag other than ``kind``, a field of the wrong
            type, more fields than the tag has (`msgspec.ValidationError` and
            `msgspec.DecodeError` are `ValueError`).
    """
    if kind is None:
        return _UNPACK_ANY(body, run_id)
    return stored_decoder(kind)(body, run_id)


def _objects_decoder(kind: str) -> Callable[[Body, str], Record]:
    def decode_object(body: Body, run_id: str) -> Record:
        record = decode(bytes(body) if isinstance(body, msgspec.Raw) else body)
        if KIND_OF[type(record)] != kind:
            raise ValueError(f"a {KIND_OF[type(record)]} record stored as {kind}")
        if record.run_id != run_id:
            raise ValueError(f"a record of run {record.run_id!r} in the log of run {run_id!r}")
        return record

    return decode_object


_STORED: Final[dict[str, Callable[[Body, str], Record]]] = {
    **_UNPACK,
    **{kind: _objects_decoder(kind) for kind in _CLASS_OF},
}


def stored_decoder(kind: str) -> Callable[[Body, str], Record]:
    """The decoder of a body stored under ``kind``, in either encoding.

    It takes ``(body, run_id)`` and returns the record (a compact one gets ``run_id``; an
    objects one must name it). It raises `ValueError` when the body does not decode as
    ``kind`` says, or is a record of another run (a cattrs error or `KeyError` for the objects
    encoding).

    Raises:
        ValueError: ``kind`` is a tag of neither encoding.
    """
    found = _STORED.get(kind)
    if found is None:
        raise ValueError(f"{kind!r} is not a tag of either encoding")
    return found


def decode_stored(kind: str, body: Body, run_id: str) -> Record:
    """A stored record of either encoding, by the tag it was stored under.

    Raises:
        ValueError: as `stored_decoder` and its decoder.
    """
    return stored_decoder(kind)(body, run_id)


def row_crc(run_id: str) -> Callable[[int, int, str, bytes], int]:
    """`record_crc` for the rows of one run: ``(seq, generation, kind, body)`` -> the CRC."""
    start = zlib.crc32(f"{run_id}\x1f".encode("utf-8", "surrogatepass"))
    crc32 = zlib.crc32

    def crc(seq: int, generation: int, kind: str, body: bytes) -> int:
        head = f"{seq}\x1f{generation}\x1f{kind}\x1f".encode("utf-8", "surrogatepass")
        return crc32(body, crc32(head, start))

    return crc
