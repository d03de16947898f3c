"""Metrics: one recorder the runtime reports to, and outputs that export its figures.

A `MetricsRecorder` is the single place where treadle's figures are counted
(docs/metrics.md, "What is counted"): the event writer of each run hands it every record it
appended to the run's log, a store's commit engine reports each committed batch and each
barrier's wait, and a fleet worker reports the runs it drives and what the store's run index
holds. The recorder turns these into updates of the metrics in `METRICS` and hands each
update to its outputs:

* `treadle.sinks.prometheus.PrometheusOutput` (extra ``treadle[metrics]``): a Prometheus
  registry, served over HTTP by ``treadle worker --metrics-port N``;
* `treadle.sinks.otel.OpenTelemetryMetrics` (extra ``treadle[otel]``): OpenTelemetry
  instruments of a meter.

Without a recorder (``metrics=None``, the default everywhere) the runtime does one ``is None``
test per record written and per committed batch, and nothing else.

Every method of the recorder is synchronous and must be called from the trio thread that
runs treadle (outputs are free to be read from other threads: the Prometheus registry is
scraped from its HTTP server's thread). An output that raises never reaches a run: the
recorder logs it and goes on (docs/metrics.md, "When an output fails").
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Container, Iterable, Mapping, Sequence
from typing import Final, Literal, Protocol

import attrs

from treadle.types import (
    ActionResult,
    Liveness,
    ModelResult,
    Record,
    RunFinished,
    RunStarted,
    StepRecord,
)


class MetricKind(enum.StrEnum):
    """How a metric's value moves.

    COUNTER: only grows (by the amount added). GAUGE: set to the value now. HISTOGRAM: each
    observation falls into a bucket; the sum and count grow.
    """

    COUNTER = "counter"
    GAUGE = "gauge"
    HISTOGRAM = "histogram"


@attrs.frozen(kw_only=True)
class Metric:
    """One metric of the catalogue (`METRICS`), as every output names it.

    Attributes:
        prometheus: the Prometheus name (a counter's ``_total`` suffix is added by the
            client library and is not part of it).
        otel: the OpenTelemetry instrument name.
        kind: counter, gauge or histogram.
        help: what it counts.
        unit: the UCUM unit for OpenTelemetry (``s`` for seconds, ``{run}`` for a count).
        labels: label (attribute) names, in the order label values are passed.
        buckets: histogram bucket upper bounds, ascending (empty for other kinds).
    """

    prometheus: str
    otel: str
    kind: MetricKind
    help: str
    unit: str
    labels: tuple[str, ...] = ()
    buckets: tuple[float, ...] = ()


RUNS_STARTED: Final = Metric(
    prometheus="treadle_runs_started",
    otel="treadle.runs.started",
    kind=MetricKind.COUNTER,
    help="Runs started here (their run-started record written).",
    unit="{run}",
)
RUNS_FINISHED: Final = Metric(
    prometheus="treadle_runs_finished",
    otel="treadle.runs.finished",
    kind=MetricKind.COUNTER,
    help="Runs finished here (their run-finished record written), by state and stop reason.",
    unit="{run}",
    labels=("state", "stop_reason"),
)
STEPS: Final = Metric(
    prometheus="treadle_steps",
    otel="treadle.steps",
    kind=MetricKind.COUNTER,
    help="Steps completed (step records written).",
    unit="{step}",
)
MODEL_ATTEMPTS: Final = Metric(
    prometheus="treadle_model_attempts",
    otel="treadle.model.attempts",
    kind=MetricKind.COUNTER,
    help="Model call attempts with a result, by outcome (ok, abandoned, or the error kind).",
    unit="{attempt}",
    labels=("outcome",),
)
TOKENS: Final = Metric(
    prometheus="treadle_tokens",
    otel="treadle.tokens",
    kind=MetricKind.COUNTER,
    help="Tokens as reported by the provider, by kind (input, output, reasoning).",
    unit="{token}",
    labels=("kind",),
)
TOOL_CALLS: Final = Metric(
    prometheus="treadle_tool_calls",
    otel="treadle.tool.calls",
    kind=MetricKind.COUNTER,
    help="Tool calls with a result, by tool and outcome (the action status).",
    unit="{call}",
    labels=("tool", "outcome"),
)
RUNNING: Final = Metric(
    prometheus="treadle_worker_running_runs",
    otel="treadle.worker.running_runs",
    kind=MetricKind.GAUGE,
    help="Runs this worker drives now (claimed and not yet done), those waiting on a child too.",
    unit="{run}",
)
WAITING: Final = Metric(
    prometheus="treadle_worker_waiting_runs",
    otel="treadle.worker.waiting_runs",
    kind=MetricKind.GAUGE,
    help="Runs this worker drives that wait on a child run queued in the fleet, slots freed.",
    unit="{run}",
)
STORE_RUNS: Final = Metric(
    prometheus="treadle_store_runs",
    otel="treadle.store.runs",
    kind=MetricKind.GAUGE,
    help="Runs of the store by liveness (queued, driven, parked ...), from its run index.",
    unit="{run}",
    labels=("liveness",),
)
COMMIT_BATCH: Final = Metric(
    prometheus="treadle_commit_batch_writes",
    otel="treadle.commit.batch_writes",
    kind=MetricKind.HISTOGRAM,
    help="Store operations committed per batch of the commit engine (group commit).",
    unit="{write}",
    buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512),
)
BARRIER_LATENCY: Final = Metric(
    prometheus="treadle_barrier_latency_seconds",
    otel="treadle.barrier.latency",
    kind=MetricKind.HISTOGRAM,
    help="Seconds a barrier write waited from being queued until its batch was durable.",
    unit="s",
    buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0),
)

METRICS: Final = (
    RUNS_STARTED,
    RUNS_FINISHED,
    STEPS,
    MODEL_ATTEMPTS,
    TOKENS,
    TOOL_CALLS,
    RUNNING,
    WAITING,
    STORE_RUNS,
    COMMIT_BATCH,
    BARRIER_LATENCY,
)
"""Every metric treadle reports, in the order docs/metrics.md lists them."""


class MetricsOutput(Protocol):
    """Where a `MetricsRecorder` sends its updates (Prometheus, OpenTelemetry, a test's list).

    Label values come in the order of `Metric.labels`. The methods are called from the trio
    thread and must not block.
    """

    def add(self, metric: Metric, value: float, labels: tuple[str, ...]) -> None:
        """Add ``value`` (>= 0) to a counter."""
        ...

    def set(self, metric: Metric, value: float, labels: tuple[str, ...]) -> None:
        """Set a gauge to ``value``."""
        ...

    def observe(self, metric: Metric, value: float, labels: tuple[str, ...]) -> None:
        """Record one observation of a histogram."""
        ...


_TOKEN_KINDS: Final = ("input", "output", "reasoning")

UNKNOWN_TOOL: Final = "(unknown)"
"""The ``tool`` label of a call to a tool the run does not have: the model names tools, and
each name it makes up would otherwise be a new series (docs/metrics.md, "What is counted")."""

_LOG: Final = logging.getLogger("treadle.metrics")


@attrs.define(eq=False)
class MetricsRecorder:
    """The one source of treadle's figures; each update goes to every output.

    Pass it as ``metrics=`` to `treadle.open_fleet`, `treadle.open_run` or `treadle.run`;
    ``treadle worker --metrics-port N`` makes one with a Prometheus output
    (docs/metrics.md, "Exporting").

    Args:
        outputs: where updates go, each in turn. An output that raises (an `Exception`)
            does not stop the update from reaching the others, and never reaches the run
            that wrote the record: its first failure is logged with its traceback on the
            ``treadle.metrics`` logger, every failure counts in `failures`
            (docs/metrics.md, "When an output fails").

    Attributes:
        failures: how many updates an output failed to take (raised), over all outputs.
    """

    outputs: Sequence[MetricsOutput] = ()
    failures: int = attrs.field(default=0, init=False)
    _failed: set[int] = attrs.field(factory=set, init=False, repr=False)

    def records(self, records: Iterable[Record], tools: Container[str] | None = None) -> None:
        """Count log records one run's event writer appended (docs/metrics.md, "What is counted").

        Run-started, run-finished (state, stop reason), step, model-call result (outcome and
        tokens as reported; an unreported count adds nothing) and action result (tool and
        status) records count; the others (intents, approvals, cancels) do not. ``tools``:
        the names of the run's tools; a call to any other name is counted under the tool
        `UNKNOWN_TOOL` (``None``: every name as it is).
        """
        for record in records:
            if isinstance(record, StepRecord):
                self._add(STEPS, 1, ())
            elif isinstance(record, ModelResult):
                self._model_result(record)
            elif isinstance(record, ActionResult):
                name = record.tool if tools is None or record.tool in tools else UNKNOWN_TOOL
                self._add(TOOL_CALLS, 1, (name, record.outcome.status.value))
            elif isinstance(record, RunStarted):
                self._add(RUNS_STARTED, 1, ())
            elif isinstance(record, RunFinished):
                labels = (record.state.value, record.stop_reason.value)
                self._add(RUNS_FINISHED, 1, labels)

    def _model_result(self, record: ModelResult) -> None:
        if record.abandoned:
            outcome = "abandoned"
        elif record.error is not None:
            outcome = record.error.kind
        else:
            outcome = "ok"
        self._add(MODEL_ATTEMPTS, 1, (outcome,))
        usage = record.usage
        for kind, count in zip(
            _TOKEN_KINDS,
            (usage.input_tokens, usage.output_tokens, usage.reasoning_tokens),
            strict=True,
        ):
            if count:
                self._add(TOKENS, count, (kind,))

    def watch(self, store: object) -> bool:
        """Count the commits of ``store`` from now on: batch sizes and barrier waits.

        A store whose writes go through the commit engine (SQLite, PostgreSQL, JSONL) is
        watched by one recorder at a time (the last given); `treadle.open_fleet` watches its
        store itself. Returns whether the store has a commit engine (`treadle.MemoryStore`
        has none: it commits nothing).
        """
        from treadle.stores import EngineStore

        if not isinstance(store, EngineStore):
            return False
        store.observe_commits(self)
        return True

    def commit(self, writes: int) -> None:
        """One batch of the commit engine committed ``writes`` store operations (>= 1)."""
        self._observe(COMMIT_BATCH, writes, ())

    def barrier(self, seconds: float) -> None:
        """A barrier write waited ``seconds`` (monotonic clock) for its batch to be durable."""
        self._observe(BARRIER_LATENCY, seconds, ())

    def running(self, runs: int, waiting: int = 0) -> None:
        """The worker drives ``runs`` runs now, ``waiting`` of them waiting on a child run.

        A run waiting on a child run queued in the fleet holds no slot: the slots taken are
        ``runs - waiting``, at most the worker's ``max_running`` (docs/metrics.md, "A
        dashboard"; docs/child-runs.md, "In a fleet").
        """
        self._update("set", RUNNING, runs, ())
        self._update("set", WAITING, waiting, ())

    def store_runs(self, counts: Mapping[Liveness, int]) -> None:
        """The store's run index holds ``counts`` runs of each liveness (absent ones: 0)."""
        for liveness in Liveness:
            self._update("set", STORE_RUNS, counts.get(liveness, 0), (liveness.value,))

    def _add(self, metric: Metric, value: float, labels: tuple[str, ...]) -> None:
        self._update("add", metric, value, labels)

    def _observe(self, metric: Metric, value: float, labels: tuple[str, ...]) -> None:
        self._update("observe", metric, value, labels)

    def _update(
        self,
        method: Literal["add", "set", "observe"],
        metric: Metric,
        value: float,
        labels: tuple[str, ...],
    ) -> None:
        for output in self.outputs:
            try:
                getattr(output, method)(metric, value, labels)
            except Exception:
                self.failures += 1
                if id(output) not in self._failed:
                    self._failed.add(id(output))
                    _LOG.exception(
                        "metrics output %s failed to take %s; the run goes on, and this "
                        "output's later failures are only counted (MetricsRecorder.failures)",
                        type(output).__qualname__,
                        metric.prometheus,
                    )


__all__ = [
    "BARRIER_LATENCY",
    "COMMIT_BATCH",
    "METRICS",
    "MODEL_ATTEMPTS",
    "RUNNING",
    "RUNS_FINISHED",
    "RUNS_STARTED",
    "STEPS",
    "STORE_RUNS",
    "TOKENS",
    "TOOL_CALLS",
    "UNKNOWN_TOOL",
    "WAITING",
    "Metric",
    "MetricKind",
    "MetricsOutput",
    "MetricsRecorder",
]
