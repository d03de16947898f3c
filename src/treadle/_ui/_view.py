"""What the run console shows: a run's log folded into blocks a page renders.

A run's page is a timeline of blocks: the run's start, one block per step (its model attempts,
tool calls, approvals and the step record), run-level records (cancel requests, accepted
definitions, records of kinds this version does not know) and the run's end. Each block has a
stable DOM id, so a live page replaces a block when a later record changes it
(docs/ui.md, "A run's page"). Everything here is plain data: the templates escape all of it.
"""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import attrs

from treadle.redaction import Redaction
from treadle.stores import record_to_dict
from treadle.types import (
    ActionIntent,
    ActionResult,
    ActionStatus,
    ApprovalDecided,
    ApprovalRequested,
    ModelIntent,
    ModelResult,
    Record,
    RunFinished,
    RunLog,
    RunStarted,
    StepRecord,
)


@attrs.define
class Attempt:
    """One model call attempt: its intent and, once written, its result."""

    intent: ModelIntent
    result: ModelResult | None = None
    seq: int = 0

    @property
    def outcome_unknown(self) -> bool:
        """The attempt was abandoned after a crash: whether the call happened is unknown."""
        return self.result is not None and self.result.abandoned

    @property
    def truncated(self) -> bool:
        """The reply was cut by the output-token limit."""
        reply = self.result.reply if self.result else None
        if reply is None:
            return False
        return reply.finish_reason == "length" or any(
            c.reason == "truncated" for c in reply.invalid_tool_calls
        )


@attrs.define
class Call:
    """One tool call: its intent and, once written, its result."""

    intent: ActionIntent
    result: ActionResult | None = None

    @property
    def highlighted(self) -> bool:
        """Its outcome is unknown or late: a person should look at it."""
        result = self.result
        return result is not None and (result.outcome.status is ActionStatus.UNKNOWN or result.late)

    @property
    def arguments_json(self) -> str:
        """The arguments as indented JSON."""
        return json.dumps(dict(self.intent.arguments), ensure_ascii=False, indent=2)


@attrs.define
class Block:
    """One entry of a run's timeline.

    Attributes:
        id: the DOM id (``step-N`` for step N, ``rec-SEQ`` for a run-level record).
        kind: ``start``, ``step``, ``finish``, ``cancel``, ``approval`` or ``other``.
        step: the step number, for a step block.
        first_seq: the seq of its first record.
        records: its records (redacted), in seq order, with their seqs.
    """

    id: str
    kind: str
    step: int | None = None
    first_seq: int = 0
    records: list[tuple[int, Record]] = attrs.field(factory=list)
    attempts: list[Attempt] = attrs.field(factory=list)
    calls: list[Call] = attrs.field(factory=list)
    approvals: list[ApprovalRequested | ApprovalDecided] = attrs.field(factory=list)
    step_record: StepRecord | None = None
    others: list[tuple[int, str, str]] = attrs.field(factory=list)

    @property
    def record(self) -> Record:
        """The block's first record (the only one of a run-level block)."""
        return self.records[0][1]

    @property
    def tokens(self) -> tuple[int, int]:
        """Reported input and output tokens of the step's attempts."""
        inputs = sum((a.result.usage.input_tokens or 0) for a in self.attempts if a.result)
        outputs = sum((a.result.usage.output_tokens or 0) for a in self.attempts if a.result)
        return inputs, outputs

    @property
    def highlighted(self) -> bool:
        """Some outcome in it is unknown or late."""
        return any(c.highlighted for c in self.calls) or any(
            a.outcome_unknown for a in self.attempts
        )

    @property
    def marks(self) -> list[str]:
        """Short marks for the step header: repairs, truncation, summaries, unknown outcomes."""
        marks = []
        record = self.step_record
        if record is not None:
            marks += [f"repaired: {r}" for r in record.repairs]
            if record.observation_truncated_chars:
                marks.append(f"observations truncated by {record.observation_truncated_chars}")
        if any(a.truncated for a in self.attempts):
            marks.append("reply truncated")
        summaries = [a for a in self.attempts if a.intent.compaction]
        if summaries:
            marks.append("earlier steps summarized")
        context = [a.result.context for a in self.attempts if a.result and a.result.context]
        if any(c.marked for c in context):
            marks.append("old observations elided")
        if any(c.truncated for c in context):
            marks.append("observations truncated to fit")
        if any(a.outcome_unknown for a in self.attempts):
            marks.append("model outcome unknown")
        for call in self.calls:
            result = call.result
            if result is None:
                continue
            if result.outcome.status is ActionStatus.UNKNOWN:
                marks.append(f"{call.intent.tool}: outcome unknown")
            if result.late:
                marks.append(f"{call.intent.tool}: late")
        marks += [label for _, label, _ in self.others]
        return marks


def timeline(log: RunLog, upto: int | None = None) -> list[Block]:
    """The blocks of ``log``'s first ``upto`` records (all by default), secrets redacted."""
    redaction = Redaction.of_log(log)
    blocks: list[Block] = []
    steps: dict[int, Block] = {}
    attempts: dict[str, Attempt] = {}
    calls: dict[str, Call] = {}
    records = log.records if upto is None else log.records[:upto]
    for seq, raw in enumerate(records, start=1):
        record = redaction.record(raw)
        step = getattr(record, "step", None)
        if isinstance(record, (RunStarted, RunFinished)) or not isinstance(step, int):
            kind = _run_level_kind(record)
            blocks.append(Block(id=f"rec-{seq}", kind=kind, first_seq=seq, records=[(seq, record)]))
            continue
        block = steps.get(step)
        if block is None:
            block = Block(id=f"step-{step}", kind="step", step=step, first_seq=seq)
            steps[step] = block
            blocks.append(block)
        block.records.append((seq, record))
        _fold(block, seq, record, attempts, calls)
    return blocks


def _run_level_kind(record: Record) -> str:
    names = {"RunStarted": "start", "RunFinished": "finish", "CancelRequested": "cancel"}
    return names.get(type(record).__name__, "other")


def _fold(
    block: Block,
    seq: int,
    record: Record,
    attempts: dict[str, Attempt],
    calls: dict[str, Call],
) -> None:
    if isinstance(record, ModelIntent):
        attempt = Attempt(intent=record, seq=seq)
        attempts[record.intent_id] = attempt
        block.attempts.append(attempt)
    elif isinstance(record, ModelResult):
        known = attempts.get(record.intent_id)
        if known is not None:
            known.result = record
    elif isinstance(record, ActionIntent):
        call = Call(intent=record)
        calls[record.intent_id] = call
        block.calls.append(call)
    elif isinstance(record, ActionResult):
        found = calls.get(record.intent_id)
        if found is not None:
            found.result = record
    elif isinstance(record, (ApprovalRequested, ApprovalDecided)):
        block.approvals.append(record)
    elif isinstance(record, StepRecord):
        block.step_record = record
    else:  # a record kind of a newer version (a summary mark, say): shown by its fields
        block.others.append((seq, _label(record), fields_text(record)))


def _label(record: object) -> str:
    name = type(record).__name__
    return "".join(f" {c.lower()}" if c.isupper() else c for c in name).strip()


def fields_text(record: object) -> str:
    """A record's fields as indented JSON (for records the page has no layout for)."""
    try:
        data: Any = record_to_dict(record)  # type: ignore[arg-type]
    except Exception:  # a kind the codec does not know: its attrs fields
        data = attrs.asdict(record) if attrs.has(type(record)) else repr(record)  # type: ignore[arg-type]
    return json.dumps(data, ensure_ascii=False, indent=2, default=str)


def block_of(blocks: Sequence[Block], seq: int) -> Block | None:
    """The block holding the record of ``seq``."""
    for block in blocks:
        if any(s == seq for s, _ in block.records):
            return block
    return None


# --------------------------------------------------------------------------- charts


@attrs.frozen
class Bar:
    """One bar of a chart, in the chart's own units (``x``/``width`` in px)."""

    x: float
    y: float
    width: float
    height: float
    kind: str
    label: str


CHART_WIDTH = 640
"""Width of the charts in px (the SVG view box; the page scales it)."""


def token_bars(blocks: Iterable[Block], *, height: float = 120) -> list[Bar]:
    """Bars of input and output tokens per step (two bars a step, scaled to ``height``)."""
    steps = [b for b in blocks if b.kind == "step"]
    if not steps:
        return []
    peak = max(max(b.tokens) for b in steps) or 1
    slot = CHART_WIDTH / len(steps)
    width = max(1.0, slot / 2 - 2)
    bars = []
    for index, block in enumerate(steps):
        for offset, (kind, count) in enumerate(zip(("input", "output"), block.tokens, strict=True)):
            h = height * count / peak
            bars.append(
                Bar(
                    x=round(index * slot + offset * (width + 1), 2),
                    y=round(height - h, 2),
                    width=round(width, 2),
                    height=round(h, 2),
                    kind=kind,
                    label=f"step {block.step}: {count} {kind} tokens",
                )
            )
    return bars


def waterfall(blocks: Iterable[Block], *, row: float = 14) -> list[Bar]:
    """One bar per model attempt and tool call, placed on the run's time axis.

    A bar starts at its intent's timestamp and lasts its measured latency or duration (or up
    to its result's timestamp); an attempt or call without a result is drawn as a sliver.
    The axis spans `time_span_s` seconds.
    """
    spans = _spans(blocks)
    if not spans:
        return []
    origin = min(s for s, _, _, _ in spans)
    scale = CHART_WIDTH / max(time_span_s(blocks), 1e-6)
    return [
        Bar(
            x=round((start - origin) * scale, 2),
            y=index * row,
            width=round(max(duration * scale, 1.0), 2),
            height=row - 3,
            kind=kind,
            label=label,
        )
        for index, (start, duration, kind, label) in enumerate(spans)
    ]


def time_span_s(blocks: Iterable[Block]) -> float:
    """Seconds from the first model or tool call's start to the last one's end (0 for none)."""
    spans = _spans(blocks)
    if not spans:
        return 0.0
    return max(s + d for s, d, _, _ in spans) - min(s for s, _, _, _ in spans)


def _spans(blocks: Iterable[Block]) -> list[tuple[float, float, str, str]]:
    """``(start, seconds, kind, label)`` of each model attempt and tool call, in seq order."""
    spans: list[tuple[float, float, str, str]] = []
    for block in blocks:
        for attempt in block.attempts:
            start = _instant(attempt.intent.ts)
            result = attempt.result
            duration = _duration(
                start, result.ts if result else None, result.latency_s if result else None
            )
            label = f"step {block.step} model attempt {attempt.intent.attempt}"
            spans.append((start, duration, "model", f"{label}: {duration:.3f} s"))
        for call in block.calls:
            start = _instant(call.intent.ts)
            done = call.result
            duration = _duration(
                start, done.ts if done else None, done.duration_s if done else None
            )
            label = f"step {block.step} {call.intent.tool}: {duration:.3f} s"
            spans.append((start, duration, "tool", label))
    return spans


def _instant(ts: str) -> float:
    try:
        return dt.datetime.fromisoformat(ts).timestamp()
    except ValueError:
        return 0.0


def _duration(start: float, end_ts: str | None, measured: float | None) -> float:
    if measured is not None:
        return max(measured, 0.0)
    if end_ts is None:
        return 0.0
    return max(_instant(end_ts) - start, 0.0)


def run_tokens(log: RunLog) -> int | None:
    """Reported input plus output tokens of every attempt of ``log``; ``None`` when none says."""
    counts = [
        (r.usage.input_tokens or 0) + (r.usage.output_tokens or 0)
        for r in log.records
        if isinstance(r, ModelResult)
        and (r.usage.input_tokens is not None or r.usage.output_tokens is not None)
    ]
    return sum(counts) if counts else None


def run_thread(log: RunLog) -> str | None:
    """What the runs list shows of a run's thread: its thread id, or the run and step it forks.

    ``None`` for a run that neither continues a thread nor forks one (docs/threads.md).
    """
    started = log.started
    if started is None:
        return None
    if started.fork_step is not None and started.continues is not None:
        return f"fork of {started.continues} at step {started.fork_step}"
    return started.thread


def json_text(value: Mapping[str, Any] | None) -> str:
    """A JSON object as indented text (``""`` for ``None``)."""
    if value is None:
        return ""
    return json.dumps(dict(value), ensure_ascii=False, indent=2)
