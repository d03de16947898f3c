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
from typing import Any, TypeVar

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

_T = TypeVar("_T")


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

MAX_TOKEN_SLOTS = 160
"""The most steps the tokens chart draws one by one; beyond, each pair of bars sums
consecutive steps, so that the chart stays a few hundred bars however long the run
(docs/ui.md, "A run's page")."""

MAX_WATERFALL_ROWS = 300
"""The most model attempts and tool calls the timing chart draws one by one; beyond, each
bar covers consecutive ones (docs/ui.md, "A run's page")."""


@attrs.frozen
class Span:
    """One model attempt or tool call on the run's time axis.

    Attributes:
        start: its intent's timestamp, in seconds since the epoch (UTC wall clock).
        duration: its measured latency or duration in seconds (or up to its result's
            timestamp; 0 without a result).
        kind: ``model`` or ``tool``.
        step: the step it belongs to.
        label: what hovering its bar says.
    """

    start: float
    duration: float
    kind: str
    step: int | None
    label: str

    @property
    def end(self) -> float:
        """Seconds since the epoch at which it ended."""
        return self.start + self.duration


def token_bars(blocks: Iterable[Block], *, height: float = 120) -> list[Bar]:
    """Bars of input and output tokens per step (two bars a slot, scaled to ``height``).

    A slot is one step, or consecutive steps summed when the run has more than
    `MAX_TOKEN_SLOTS`; each bar's label names its steps.
    """
    slots = _chunks([b for b in blocks if b.kind == "step"], MAX_TOKEN_SLOTS)
    if not slots:
        return []
    sums = [(sum(b.tokens[0] for b in s), sum(b.tokens[1] for b in s)) for s in slots]
    peak = max(max(pair) for pair in sums) or 1
    slot_px = CHART_WIDTH / len(slots)
    width = max(1.0, slot_px / 2 - 2)
    bars = []
    for index, (slot, counts) in enumerate(zip(slots, sums, strict=True)):
        for offset, (kind, count) in enumerate(zip(("input", "output"), counts, strict=True)):
            h = height * count / peak
            bars.append(
                Bar(
                    x=round(index * slot_px + offset * (width + 1), 2),
                    y=round(height - h, 2),
                    width=round(width, 2),
                    height=round(h, 2),
                    kind=kind,
                    label=f"{_steps_text(slot[0].step, slot[-1].step)}: {count} {kind} tokens",
                )
            )
    return bars


def _waterfall(spans: Sequence[Span], *, row: float = 14) -> list[Bar]:
    """One bar per model attempt and tool call, placed on the run's time axis.

    A bar starts at its intent's timestamp and lasts its measured latency or duration (or up
    to its result's timestamp); an attempt or call without a result is drawn as a sliver.
    Beyond `MAX_WATERFALL_ROWS` of them, a bar covers consecutive ones (in seq order), from
    the first one's start to the last end among them: kind ``mixed`` when it holds both
    kinds, its label counting each kind and its seconds. The axis spans from the first
    start to the last end.
    """
    if not spans:
        return []
    origin = min(s.start for s in spans)
    scale = CHART_WIDTH / max(_span_s(spans), 1e-6)
    return [
        Bar(
            x=round((start - origin) * scale, 2),
            y=index * row,
            width=round(max(duration * scale, 1.0), 2),
            height=row - 3,
            kind=kind,
            label=label,
        )
        for index, (start, duration, kind, label) in enumerate(
            _grouped(group) for group in _chunks(spans, MAX_WATERFALL_ROWS)
        )
    ]


def charts(blocks: Sequence[Block]) -> dict[str, Any]:
    """What the charts template shows of a run's ``blocks`` (`token_bars`, `_waterfall`).

    Returns:
        ``token_bars`` and ``waterfall`` (lists of `Bar`), ``steps_charted`` (the step blocks),
        ``steps_per_slot``, ``calls`` (model attempts and tool calls), ``calls_per_row``
        (how many each waterfall bar covers) and ``span_s`` (seconds of the time axis).
    """
    spans = _spans(blocks)
    steps = sum(1 for b in blocks if b.kind == "step")
    return {
        "token_bars": token_bars(blocks),
        "steps_charted": steps,
        "steps_per_slot": _chunk_size(steps, MAX_TOKEN_SLOTS),
        "waterfall": _waterfall(spans),
        "calls": len(spans),
        "calls_per_row": _chunk_size(len(spans), MAX_WATERFALL_ROWS),
        "span_s": _span_s(spans),
    }


def _grouped(spans: Sequence[Span]) -> tuple[float, float, str, str]:
    """``(start, seconds, kind, label)`` of one waterfall bar covering ``spans``."""
    if len(spans) == 1:
        (span,) = spans
        return span.start, span.duration, span.kind, span.label
    start = min(s.start for s in spans)
    kinds = {s.kind for s in spans}
    parts = []
    for kind, name in (("model", "model attempts"), ("tool", "tool calls")):
        mine = [s for s in spans if s.kind == kind]
        if mine:
            parts.append(f"{len(mine)} {name} ({sum(s.duration for s in mine):.3f} s)")
    steps = _steps_text(spans[0].step, spans[-1].step)
    kind = kinds.pop() if len(kinds) == 1 else "mixed"
    return start, max(s.end for s in spans) - start, kind, f"{steps}: {', '.join(parts)}"


def _span_s(spans: Sequence[Span]) -> float:
    """Seconds from the first span's start to the last one's end (0 for none)."""
    if not spans:
        return 0.0
    return max(s.end for s in spans) - min(s.start for s in spans)


def _spans(blocks: Iterable[Block]) -> list[Span]:
    """Each model attempt and tool call, in seq order."""
    spans: list[Span] = []
    for block in blocks:
        for attempt in block.attempts:
            start = _instant(attempt.intent.ts)
            result = attempt.result
            duration = _duration(
                start, result.ts if result else None, result.latency_s if result else None
            )
            label = f"step {block.step} model attempt {attempt.intent.attempt}"
            spans.append(Span(start, duration, "model", block.step, f"{label}: {duration:.3f} s"))
        for call in block.calls:
            start = _instant(call.intent.ts)
            done = call.result
            duration = _duration(
                start, done.ts if done else None, done.duration_s if done else None
            )
            label = f"step {block.step} {call.intent.tool}: {duration:.3f} s"
            spans.append(Span(start, duration, "tool", block.step, label))
    return spans


def _chunk_size(count: int, most: int) -> int:
    """How many consecutive items each of at most ``most`` chunks of ``count`` holds."""
    return max(1, -(-count // most))


def _chunks(items: Sequence[_T], most: int) -> list[Sequence[_T]]:
    """``items`` cut into at most ``most`` runs of consecutive items, in order."""
    size = _chunk_size(len(items), most)
    return [items[i : i + size] for i in range(0, len(items), size)]


def _steps_text(first: int | None, last: int | None) -> str:
    return f"step {first}" if first == last else f"steps {first}–{last}"


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
    """Reported tokens of every attempt of ``log``; ``None`` when none says.

    Counted as the token budget counts them (`treadle.types.Usage.known_total`).
    """
    counts = [r.usage.known_total for r in log.records if isinstance(r, ModelResult)]
    known = [c for c in counts if c is not None]
    return sum(known) if known else None


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
