"""An event sink that turns a run's events into OpenTelemetry spans (extra ``treadle[otel]``).

Spans follow the OpenTelemetry semantic conventions for generative AI (``gen_ai.*``)::

    invoke_agent <agent>                 one per run (the root)
      step <n>                           one per step (treadle's own span)
        chat <model>                     one per model call attempt, with token usage
        execute_tool <tool>              one per action

Span start and end times are the records' timestamps, so a sink that lags behind the run (it is
fed through a bounded buffer, docs/concepts.md, "Actors") still draws the run as it happened.
Approvals and the cancel request are span events. Text and reasoning deltas are not exported.
A drive that stops with the run unfinished ends its open spans at its ``run_left`` event, with
``treadle.run.left`` saying why (docs/events.md, "OpenTelemetry"). One sink serves any number
of runs, concurrent or not.

The sink only needs ``opentelemetry-api``; the application configures the SDK (exporters,
processors) and may pass its own tracer.

`OpenTelemetryMetrics` is the same package's metrics output: a `treadle.metrics.MetricsOutput`
that records treadle's figures (docs/metrics.md) as OpenTelemetry instruments of a meter.
"""

from __future__ import annotations

import datetime as dt
import time
from typing import Any

import attrs
from opentelemetry import metrics, trace
from opentelemetry.metrics import Counter, Histogram, Meter
from opentelemetry.trace import Span, SpanKind, Status, StatusCode, Tracer

from treadle.metrics import METRICS, Metric, MetricKind
from treadle.types import (
    ActionIntent,
    ActionResult,
    ActionStatus,
    ApprovalDecided,
    ApprovalRequested,
    CancelRequested,
    Event,
    EventKind,
    ModelIntent,
    ModelResult,
    Record,
    RunFinished,
    RunStarted,
    RunState,
    StepRecord,
)

TRACER_NAME = "treadle"
"""Instrumentation scope name of the spans (and of the metrics' meter)."""


def _ns(ts: str) -> int:
    """Nanoseconds since the epoch of an ISO-8601 instant."""
    instant = dt.datetime.fromisoformat(ts)
    return int(instant.timestamp()) * 1_000_000_000 + instant.microsecond * 1_000


@attrs.define(eq=False)
class _RunSpans:
    """The open spans of one run's drive, as one `OpenTelemetrySink` keeps them.

    Attributes:
        run: the run's ``invoke_agent`` span.
        model: the ``gen_ai.request.model`` of its model spans.
        steps: step number -> the open step span.
        calls: intent id -> the open model or tool span.
        last_ns: the latest record timestamp seen (nanoseconds since the epoch).
    """

    run: Span
    model: str
    steps: dict[int, Span] = attrs.Factory(dict)
    calls: dict[str, Span] = attrs.Factory(dict)
    last_ns: int = 0

    def cut(self, end_ns: int, attributes: dict[str, str]) -> None:
        """End every open model, tool and step span at ``end_ns`` (the run span stays)."""
        for span in (*self.calls.values(), *self.steps.values()):
            span.set_attributes(attributes)
            span.end(end_time=end_ns)
        self.calls.clear()
        self.steps.clear()


@attrs.define(eq=False)
class OpenTelemetrySink:
    """A `treadle.ports.EventSink` exporting runs' events as OpenTelemetry spans.

    One sink object serves any number of runs, one after another or at the same time (a
    fleet gives its sinks to every run it drives): it keeps each run's open spans by run id,
    and forgets them when the run finishes or its drive here stops unfinished (a
    ``run_left`` event, which every drive that stops without the sink getting its
    ``run_finished`` sends, one cancelled from outside included; docs/events.md,
    "OpenTelemetry"). Attributes set:

    * run: ``gen_ai.operation.name=invoke_agent``, ``gen_ai.agent.name``,
      ``gen_ai.conversation.id`` (the run id), ``treadle.run.state``,
      ``treadle.run.stop_reason``, ``gen_ai.usage.input_tokens`` / ``output_tokens`` (totals,
      only when reported); or, when the drive here stopped unfinished, ``treadle.run.left``
      (``drained``, ``parked``, ``interrupted``, ``finished_elsewhere``, ``cut_off``: the
      drive was cancelled from outside, or this sink's grace ran out), on the run span and
      on each step, model and tool span it cut;
    * model call: ``gen_ai.operation.name=chat``, ``gen_ai.provider.name``,
      ``gen_ai.request.model``, ``gen_ai.response.id``, ``gen_ai.response.finish_reasons``,
      ``gen_ai.usage.input_tokens`` / ``output_tokens`` (only when the server reported them),
      ``error.type`` for a failed attempt;
    * tool call: ``gen_ai.operation.name=execute_tool``, ``gen_ai.tool.name``,
      ``gen_ai.tool.call.id``, ``gen_ai.tool.type=function``, ``treadle.action.status``,
      ``error.type`` when the action did not execute.

    Args:
        tracer: where spans go; default ``opentelemetry.trace.get_tracer("treadle")``.
        agent_name: the ``gen_ai.agent.name`` of the run spans.
        provider: the ``gen_ai.provider.name`` of model spans (e.g. ``openai``), when known.
        model: the ``gen_ai.request.model`` of a run's model spans until its run-started
            record names the agent's model. A resumed run sends its sinks only the records
            it writes, never its run-started record: give ``model`` to a sink of runs that
            may be resumed, or their model spans name no model (docs/events.md,
            "OpenTelemetry").
    """

    tracer: Tracer | None = None
    agent_name: str = "treadle"
    provider: str | None = None
    model: str = ""
    _runs: dict[str, _RunSpans] = attrs.field(init=False, factory=dict)
    """Run id -> the open spans of the run's drive."""

    async def send(self, event: Event) -> None:
        """Turn one event into span starts, ends or span events (deltas are ignored)."""
        if event.record is not None:
            self.record(event.run_id, event.record)
        elif event.kind is EventKind.RUN_LEFT:
            self.left(event.run_id, event.text or "")

    def record(self, run_id: str, record: Record) -> None:
        """Apply one log record of run ``run_id`` (synchronous; `send` calls it)."""
        if isinstance(record, RunStarted):
            model = str(record.snapshot.get("model") or "") or self.model
            self._open(run_id, record.ts, model)
            return
        spans = self._spans(run_id, record.ts)
        spans.last_ns = max(spans.last_ns, _ns(record.ts))
        if isinstance(record, ModelIntent):
            self._start_model(spans, record)
        elif isinstance(record, ModelResult):
            self._end_model(spans, record)
        elif isinstance(record, ActionIntent):
            self._start_tool(
                spans, record.step, record.intent_id, record.tool, record.call_id, record.ts
            )
        elif isinstance(record, ActionResult):
            self._end_tool(spans, record)
        elif isinstance(record, StepRecord):
            step = spans.steps.pop(record.step, None)
            if step is not None:
                step.set_attribute("treadle.step.decision", str(record.decision or "model_failed"))
                step.end(end_time=_ns(record.ts))
        elif isinstance(record, ApprovalRequested | ApprovalDecided):
            self._approval(spans, record)
        elif isinstance(record, CancelRequested):
            spans.run.add_event(
                "treadle.cancel_requested",
                {
                    "treadle.cancel.reason": record.reason,
                    "treadle.cancel.canceller": record.canceller,
                },
                timestamp=_ns(record.ts),
            )
        elif isinstance(record, RunFinished):
            self._end_run(run_id, record)

    def left(self, run_id: str, why: str) -> None:
        """End the open spans of run ``run_id``, whose drive here stopped unfinished.

        What a ``run_left`` event says (`send` calls it): each span still open gets
        ``treadle.run.left`` = ``why`` and ends now, never before the run's last record
        (no record carries the moment the drive stopped). The run's next drive, here or
        elsewhere, starts a run span of its own at its first record (docs/events.md,
        "OpenTelemetry"). Nothing happens for a run with no open span.
        """
        spans = self._runs.pop(run_id, None)
        if spans is None:
            return
        end = max(spans.last_ns, time.time_ns())
        attributes = {"treadle.run.left": why}
        spans.cut(end, attributes)
        spans.run.set_attributes(attributes)
        spans.run.end(end_time=end)

    def _tracer(self) -> Tracer:
        return self.tracer or trace.get_tracer(TRACER_NAME)

    def _open(self, run_id: str, ts: str, model: str) -> _RunSpans:
        """Start run ``run_id``'s span at ``ts`` and keep it."""
        run = self._tracer().start_span(
            f"invoke_agent {self.agent_name}",
            kind=SpanKind.INTERNAL,
            start_time=_ns(ts),
            attributes={
                "gen_ai.operation.name": "invoke_agent",
                "gen_ai.agent.name": self.agent_name,
                "gen_ai.conversation.id": run_id,
            },
        )
        spans = self._runs[run_id] = _RunSpans(run=run, model=model, last_ns=_ns(ts))
        return spans

    def _spans(self, run_id: str, ts: str) -> _RunSpans:
        """The run's open spans, its run span started at ``ts`` if none is open.

        That is a resumed run's first record here: its run-started record is not sent again.
        """
        spans = self._runs.get(run_id)
        return spans if spans is not None else self._open(run_id, ts, self.model)

    def _step_span(self, spans: _RunSpans, step: int, ts: str) -> Span:
        span = spans.steps.get(step)
        if span is None:
            span = self._tracer().start_span(
                f"step {step}",
                context=trace.set_span_in_context(spans.run),
                kind=SpanKind.INTERNAL,
                start_time=_ns(ts),
                attributes={"treadle.step": step},
            )
            spans.steps[step] = span
        return span

    def _start_model(self, spans: _RunSpans, record: ModelIntent) -> None:
        parent = trace.set_span_in_context(self._step_span(spans, record.step, record.ts))
        attributes: dict[str, Any] = {
            "gen_ai.operation.name": "chat",
            "gen_ai.request.model": spans.model,
            "treadle.attempt": record.attempt,
        }
        if self.provider:
            attributes["gen_ai.provider.name"] = self.provider
        spans.calls[record.intent_id] = self._tracer().start_span(
            f"chat {spans.model}".strip(),
            context=parent,
            kind=SpanKind.CLIENT,
            start_time=_ns(record.ts),
            attributes=attributes,
        )

    def _end_model(self, spans: _RunSpans, record: ModelResult) -> None:
        span = spans.calls.pop(record.intent_id, None)
        if span is None:
            return
        usage = record.usage
        if usage.input_tokens is not None:
            span.set_attribute("gen_ai.usage.input_tokens", usage.input_tokens)
        if usage.output_tokens is not None:
            span.set_attribute("gen_ai.usage.output_tokens", usage.output_tokens)
        reply = record.reply
        if reply is not None:
            if reply.response_id:
                span.set_attribute("gen_ai.response.id", reply.response_id)
            if reply.finish_reason:
                span.set_attribute("gen_ai.response.finish_reasons", [reply.finish_reason])
        if record.error is not None or record.abandoned:
            kind = record.error.kind if record.error is not None else "abandoned"
            span.set_attribute("error.type", kind)
            span.set_status(
                Status(StatusCode.ERROR, record.error.message if record.error else kind)
            )
        span.end(end_time=_ns(record.ts))

    def _start_tool(
        self, spans: _RunSpans, step: int, intent_id: str, tool: str, call_id: str, ts: str
    ) -> Span:
        parent = trace.set_span_in_context(self._step_span(spans, step, ts))
        span = self._tracer().start_span(
            f"execute_tool {tool}",
            context=parent,
            kind=SpanKind.INTERNAL,
            start_time=_ns(ts),
            attributes={
                "gen_ai.operation.name": "execute_tool",
                "gen_ai.tool.name": tool,
                "gen_ai.tool.call.id": call_id,
                "gen_ai.tool.type": "function",
            },
        )
        spans.calls[intent_id] = span
        return span

    def _end_tool(self, spans: _RunSpans, record: ActionResult) -> None:
        span = spans.calls.pop(record.intent_id, None)
        if span is None:  # never started (rejected by a human): a span of no duration
            span = self._start_tool(
                spans, record.step, record.intent_id, record.tool, record.call_id, record.ts
            )
            spans.calls.pop(record.intent_id)
        status = record.outcome.status
        span.set_attribute("treadle.action.status", status.value)
        if record.late:
            span.set_attribute("treadle.action.late", True)
        if status is not ActionStatus.EXECUTED:
            span.set_attribute("error.type", status.value)
            span.set_status(Status(StatusCode.ERROR, record.outcome.detail or status.value))
        span.end(end_time=_ns(record.ts))

    def _approval(self, spans: _RunSpans, record: ApprovalRequested | ApprovalDecided) -> None:
        span = self._step_span(spans, record.step, record.ts)
        if isinstance(record, ApprovalRequested):
            span.add_event(
                "treadle.approval_requested",
                {
                    "gen_ai.tool.name": record.tool,
                    "gen_ai.tool.call.id": record.call_id,
                    "treadle.approval.deadline": record.deadline_ts,
                },
                timestamp=_ns(record.ts),
            )
            return
        span.add_event(
            "treadle.approval_decided",
            {"gen_ai.tool.call.id": record.call_id, "treadle.approval.decision": record.decision},
            timestamp=_ns(record.ts),
        )

    def _end_run(self, run_id: str, record: RunFinished) -> None:
        spans = self._runs.pop(run_id)
        end = _ns(record.ts)
        spans.cut(end, {})  # cut by the end of the run
        run = spans.run
        run.set_attribute("treadle.run.state", record.state.value)
        run.set_attribute("treadle.run.stop_reason", record.stop_reason.value)
        totals = record.totals
        if totals.input_tokens is not None:
            run.set_attribute("gen_ai.usage.input_tokens", totals.input_tokens)
        if totals.output_tokens is not None:
            run.set_attribute("gen_ai.usage.output_tokens", totals.output_tokens)
        if record.state is RunState.FAILED:
            run.set_attribute("error.type", record.stop_reason.value)
            run.set_status(Status(StatusCode.ERROR, record.error or record.stop_reason.value))
        run.end(end_time=end)


@attrs.define(eq=False)
class OpenTelemetryMetrics:
    """A `treadle.metrics.MetricsOutput` recording treadle's metrics as OpenTelemetry instruments.

    One instrument per metric of `treadle.metrics.METRICS` (a counter, a synchronous gauge
    or a histogram with the catalogue's bucket bounds as advice), named by `Metric.otel`,
    with the label names as attribute keys (docs/metrics.md, "OpenTelemetry"). Give it to a
    `treadle.metrics.MetricsRecorder`, next to a Prometheus output or instead of it.

    Args:
        meter: where instruments are made; default
            ``opentelemetry.metrics.get_meter("treadle")`` (the global meter provider).
    """

    meter: Meter | None = None
    _counters: dict[str, Counter] = attrs.field(init=False, factory=dict)
    # the API's synchronous gauge type is private
    _gauges: dict[str, Any] = attrs.field(init=False, factory=dict)
    _histograms: dict[str, Histogram] = attrs.field(init=False, factory=dict)

    def __attrs_post_init__(self) -> None:
        meter = self.meter or metrics.get_meter(TRACER_NAME)
        for m in METRICS:
            if m.kind is MetricKind.COUNTER:
                self._counters[m.otel] = meter.create_counter(
                    m.otel, unit=m.unit, description=m.help
                )
            elif m.kind is MetricKind.GAUGE:
                self._gauges[m.otel] = meter.create_gauge(m.otel, unit=m.unit, description=m.help)
            else:
                self._histograms[m.otel] = meter.create_histogram(
                    m.otel,
                    unit=m.unit,
                    description=m.help,
                    explicit_bucket_boundaries_advisory=m.buckets,
                )

    def add(self, metric: Metric, value: float, labels: tuple[str, ...]) -> None:
        """Add to a counter."""
        self._counters[metric.otel].add(value, _attributes(metric, labels))

    def set(self, metric: Metric, value: float, labels: tuple[str, ...]) -> None:
        """Set a gauge."""
        self._gauges[metric.otel].set(value, _attributes(metric, labels))

    def observe(self, metric: Metric, value: float, labels: tuple[str, ...]) -> None:
        """Record one histogram value."""
        self._histograms[metric.otel].record(value, _attributes(metric, labels))


def _attributes(metric: Metric, labels: tuple[str, ...]) -> dict[str, str] | None:
    return dict(zip(metric.labels, labels, strict=True)) if labels else None
