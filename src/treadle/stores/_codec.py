"""The one private converter that turns log records into JSON and back.

Records are a closed union tagged by ``kind``; unknown keys are refused so a typo or a
foreign record never decodes silently. Each stored record carries the schema version in its
run-started record; a log from a newer version is refused by `check_schema`.
"""

from __future__ import annotations

import json
import zlib
from typing import Any, Final

import cattrs
import orjson
from cattrs.preconf.json import make_converter
from cattrs.strategies import configure_tagged_union

from treadle._exceptions import SchemaTooNew
from treadle.types import (
    SCHEMA_VERSION,
    ActionIntent,
    ActionResult,
    ApprovalDecided,
    ApprovalRequested,
    BudgetCaps,
    CancelRequested,
    ChildrenAwaited,
    DefinitionAccepted,
    Message,
    ModelIntent,
    ModelResult,
    Record,
    RunFinished,
    RunStarted,
    StepRecord,
    Submission,
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
"""Record class -> tag. Tags are schema: never rename one."""

_CLASS_OF: Final[dict[str, type[Any]]] = {tag: cls for cls, tag in KIND_OF.items()}


def _make() -> cattrs.Converter:
    conv = make_converter(forbid_extra_keys=True, omit_if_default=True)
    configure_tagged_union(
        Record,
        conv,
        tag_name="kind",
        tag_generator=lambda cls: KIND_OF[cls],
    )
    return conv


_CONVERTER: Final = _make()


def record_to_dict(record: Record) -> dict[str, Any]:
    """Unstructure ``record`` into plain JSON data with its ``kind`` tag (last key)."""
    data: dict[str, Any] = _CONVERTER.unstructure(record)
    data["kind"] = KIND_OF[type(record)]
    return data


def record_from_dict(data: dict[str, Any]) -> Record:
    """Structure plain JSON data (with ``kind``) into a record.

    Raises:
        cattrs.BaseValidationError: the data does not match the record schema.
        KeyError: the ``kind`` tag is missing or unknown.
    """
    cls = _CLASS_OF[data["kind"]]
    payload = {k: v for k, v in data.items() if k != "kind"}
    record: Record = _CONVERTER.structure(payload, cls)
    return record


def encode(record: Record) -> str:
    """Serialise ``record`` to one line of compact JSON (no newline).

    orjson is the fast path; values it refuses (integers beyond 64 bits, lone surrogates)
    take the standard library's path with ASCII escapes, which round-trips them exactly.
    """
    data = record_to_dict(record)
    try:
        return orjson.dumps(data).decode("utf-8")
    except orjson.JSONEncodeError:
        return json.dumps(data, ensure_ascii=True, separators=(",", ":"))


def encode_bytes(record: Record) -> bytes:
    """`encode` as UTF-8 bytes (orjson's output as is on the fast path)."""
    data = record_to_dict(record)
    try:
        return orjson.dumps(data)
    except orjson.JSONEncodeError:
        return json.dumps(data, ensure_ascii=True, separators=(",", ":")).encode("ascii")


def record_crc(run_id: str, seq: int, generation: int, kind: str, body: bytes) -> int:
    """The CRC-32 (zlib) a stored record row carries: over its key, generation, tag and body.

    A bit flipped anywhere in the row (a changed run id, seq, generation, tag or body byte)
    changes it, so a read refuses the row instead of returning a different log.
    """
    head = f"{run_id}\x1f{seq}\x1f{generation}\x1f{kind}\x1f".encode("utf-8", "surrogatepass")
    return zlib.crc32(body, zlib.crc32(head))


def decode(text: str | bytes) -> Record:
    """Parse one JSON record; raises `ValueError` (or a cattrs error) on bad input."""
    # The standard library's decoder: orjson would turn integers beyond 64 bits into floats.
    return record_from_dict(json.loads(text))


def encode_submission(submission: Submission) -> bytes:
    """A queue entry's stored part as JSON bytes: its input, and a child run's caps and parent.

    A plain submission is its list of input messages (the form every version reads); one
    that carries caps or a parent is an object ``{"input": [...], "caps": {...}, "parent":
    [run id, intent id]}``.
    """
    messages = _CONVERTER.unstructure(submission.input, tuple[Message, ...])
    parent = submission.parent_run_id, submission.parent_intent_id
    if submission.caps is None and parent == (None, None):
        return orjson.dumps(messages)
    data: dict[str, Any] = {"input": messages}
    if submission.caps is not None:
        data["caps"] = _CONVERTER.unstructure(submission.caps)
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
            input=_CONVERTER.structure(parts["input"], tuple[Message, ...]),
            submitted_at=submitted_at,
            caps=None if caps is None else _CONVERTER.structure(caps, BudgetCaps),
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
