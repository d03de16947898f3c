"""An event sink that turns a run's events into OpenTelemetry spans (extra ``treadle[otel]``).

Spans follow the OpenTelemetry semantic conventions for generative AI (``gen_ai.*``)::

    invoke_agent <agent>                 one per run (the root)
      step <n>                           one per step (treadle's own span)
        chat <model>                     one per model call attempt, with token usage
        execute_tool <tool>              one per action

Span start and end times are the records' timestamps, so a sink that lags behind the run (it is
fed through a bounded buffer, docs/concepts.md, "Actors") still draws the run as it happened.
Approvals and the
cancel request are span events. Text and reasoning deltas are not exported.

The sink only needs ``opentelemetry-api``; the application configures the SDK (exporters,
processors) and may pass its own tracer.

`OpenTelemetryMetrics` is the same package's metrics output: a `treadle.metrics.MetricsOutput`
that records treadle's figures (docs/metrics.md) as OpenTelemetry instruments of a meter.
"""

from __future__ import annotations

import datetime as dt
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
class OpenTelemetrySink:
    """A `treadle.ports.EventSink` exporting one run's events as OpenTelemetry spans.

    Use one sink object per run (it keeps that run's open spans). Attributes set:

    * run: ``gen_ai.operation.name=invoke_agent``, ``gen_ai.agent.name``,
      ``gen_ai.conversation.id`` (the run id), ``treadle.run.state``,
      ``treadle.run.stop_reason``, ``gen_ai.usage.input_tokens`` / ``output_tokens`` (totals,
      only when reported);
    * model call: ``gen_ai.operation.name=chat``, ``gen_ai.provider.name``,
      ``gen_ai.request.model``, ``gen_ai.response.id``, ``gen_ai.response.finish_reasons``,
      ``gen_ai.usage.input_tokens`` / ``output_tokens`` (only when the server reported them),
      ``error.type`` for a failed attempt;
    * tool call: ``gen_ai.operation.name=execute_tool``, ``gen_ai.tool.name``,
      ``gen_ai.tool.call.id``, ``gen_ai.tool.type=function``, ``treadle.action.status``,
      ``error.type`` when the action did not execute.

    Args:
        tracer: where spans go; default ``opentelemetry.trace.get_tracer("treadle")``.
        agent_name: the ``gen_ai.agent.name`` of the run span.
        provider: the ``gen_ai.provider.name`` of model spans (e.g. ``openai``), when known.
        model: the ``gen_ai.request.model`` of model spans until the run-started record
            names the agent's model. A resumed run sends its sinks only the records it
            writes, never its run-started record: give ``model`` to a sink of a run that may
            be resumed, or its model spans name no model (docs/events.md, "OpenTelemetry").
    """

    tracer: Tracer | None = None
    agent_name: str = "treadle"
    provider: str | None = None
    model: str = ""
    _run: Span | None = None
    _run_id: str = ""
    _model: str = attrs.field(default="", init=False)

    def __attrs_post_init__(self) -> None:
        self._model = self.model

    _steps: dict[int, Span] = attrs.Factory(dict)
    _calls: dict[str, Span] = attrs.Factory(dict)

    async def send(self, event: Event) -> None:
        """Turn one event into span starts, ends or span events (deltas are ignored)."""
        if event.record is not None:
            self.record(event.run_id, event.record)

    def record(self, run_id: str, record: Record) -> None:
        """Apply one log record (synchronous; `send` calls it)."""
        if isinstance(record, RunStarted):
            self._model = str(record.snapshot.get("model") or "") or self.model
            self._start_run(run_id, record.ts)
        elif isinstance(record, ModelIntent):
            self._start_model(run_id, record)
        elif isinstance(record, ModelResult):
            self._end_model(record)
        elif isinstance(record, ActionIntent):
            self._start_tool(
                run_id, record.step, record.intent_id, record.tool, record.call_id, record.ts
            )
        elif isinstance(record, ActionResult):
            self._end_tool(run_id, record)
        elif isinstance(record, StepRecord):
            step = self._steps.pop(record.step, None)
            if step is not None:
                step.set_attribute("treadle.step.decision", str(record.decision or "model_failed"))
                step.end(end_time=_ns(record.ts))
        elif isinstance(record, ApprovalRequested | ApprovalDecided):
            self._approval(run_id, record)
        elif isinstance(record, CancelRequested):
            self._run_span(run_id, record.ts).add_event(
                "treadle.cancel_requested",
                {
                    "treadle.cancel.reason": record.reason,
                    "treadle.cancel.canceller": record.canceller,
                },
                timestamp=_ns(record.ts),
            )
        elif isinstance(record, RunFinished):
            self._end_run(run_id, record)

    def _start_run(self, run_id: str, ts: str) -> Span:
        tracer = self.tracer or trace.get_tracer(TRACER_NAME)
        self._run_id = run_id
        self._run = tracer.start_span(
            f"invoke_agent {self.agent_name}",
            kind=SpanKind.INTERNAL,
            start_time=_ns(ts),
            attributes={
                "gen_ai.operation.name": "invoke_agent",
                "gen_ai.agent.name": self.agent_name,
                "gen_ai.conversation.id": run_id,
            },
        )
        return self._run

    def _run_span(self, run_id: str, ts: str) -> Span:
        """The run span; started here when the sink joined a resumed run."""
        return self._run if self._run is not None else self._start_run(run_id, ts)

    def _step_span(self, run_id: str, step: int, ts: str) -> Span:
        span = self._steps.get(step)
        if span is None:
            parent = trace.set_span_in_context(self._run_span(run_id, ts))
            span = self._tracer().start_span(
                f"step {step}",
                context=parent,
                kind=SpanKind.INTERNAL,
                start_time=_ns(ts),
                attributes={"treadle.step": step},
            )
            self._steps[step] = span
        return span

    def _tracer(self) -> Tracer:
        return self.tracer or trace.get_tracer(TRACER_NAME)

    def _start_model(self, run_id: str, record: ModelIntent) -> None:
        parent = trace.set_span_in_context(self._step_span(run_id, record.step, record.ts))
        attributes: dict[str, Any] = {
            "gen_ai.operation.name": "chat",
            "gen_ai.request.model": self._model,
            "treadle.attempt": record.attempt,
        }
        if self.provider:
            attributes["gen_ai.provider.name"] = self.provider
        self._calls[record.intent_id] = self._tracer().start_span(
            f"chat {self._model}".strip(),
            context=parent,
            kind=SpanKind.CLIENT,
            start_time=_ns(record.ts),
            attributes=attributes,
        )

    def _end_model(self, record: ModelResult) -> None:
        span = self._calls.pop(record.intent_id, None)
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
        self, run_id: str, step: int, intent_id: str, tool: str, call_id: str, ts: str
    ) -> Span:
        parent = trace.set_span_in_context(self._step_span(run_id, step, ts))
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
        self._calls[intent_id] = span
        return span

    def _end_tool(self, run_id: str, record: ActionResult) -> None:
        span = self._calls.pop(record.intent_id, None)
        if span is None:  # never started (rejected by a human): a span of no duration
            span = self._start_tool(
                run_id, record.step, record.intent_id, record.tool, record.call_id, record.ts
            )
            self._calls.pop(record.intent_id)
        status = record.outcome.status
        span.set_attribute("treadle.action.status", status.value)
        if record.late:
            span.set_attribute("treadle.action.late", True)
        if status is not ActionStatus.EXECUTED:
            span.set_attribute("error.type", status.value)
            span.set_status(Status(StatusCode.ERROR, record.outcome.detail or status.value))
        span.end(end_time=_ns(record.ts))

    def _approval(self, run_id: str, record: ApprovalRequested | ApprovalDecided) -> None:
        span = self._step_span(run_id, record.step, record.ts)
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
        end = _ns(record.ts)
        for span in (*self._calls.values(), *self._steps.values()):
            span.end(end_time=end)  # cut by the end of the run
        self._calls.clear()
        self._steps.clear()
        run = self._run_span(run_id, record.ts)
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
        self._run = None


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
    _counters: dict[str, Counter] = attrs.Factory(dict)
    _gauges: dict[str, Any] = attrs.Factory(dict)  # the API's synchronous gauge type is private
    _histograms: dict[str, Histogram] = attrs.Factory(dict)

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
