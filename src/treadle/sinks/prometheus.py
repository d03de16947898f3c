"""A `treadle.metrics.MetricsOutput` into a Prometheus registry (extra ``treadle[metrics]``).

`PrometheusOutput` makes one ``prometheus_client`` instrument per metric of
`treadle.metrics.METRICS` in its own registry (so that two outputs in one process do not
clash), and `PrometheusOutput.serve` exposes the registry over HTTP in the text exposition
format (docs/metrics.md, "Exporting"). The client library is thread-safe: the recorder
updates the instruments from the trio thread while the HTTP server's thread reads them.
"""

from __future__ import annotations

from wsgiref.simple_server import WSGIServer

import attrs
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from treadle._exceptions import UsageError
from treadle.metrics import METRICS, Metric, MetricKind

_Instrument = Counter | Gauge | Histogram


def _instrument(metric: Metric, registry: CollectorRegistry) -> _Instrument:
    if metric.kind is MetricKind.COUNTER:
        return Counter(metric.prometheus, metric.help, metric.labels, registry=registry)
    if metric.kind is MetricKind.GAUGE:
        return Gauge(metric.prometheus, metric.help, metric.labels, registry=registry)
    return Histogram(
        metric.prometheus, metric.help, metric.labels, registry=registry, buckets=metric.buckets
    )


@attrs.define(eq=False)
class PrometheusOutput:
    """Prometheus instruments for every treadle metric, in ``registry``.

    Args:
        registry: where the instruments are registered; a fresh `CollectorRegistry` by
            default (pass ``prometheus_client.REGISTRY`` to join the process's default one).

    Raises:
        ValueError: ``registry`` already has a metric of one of treadle's names.
    """

    registry: CollectorRegistry = attrs.Factory(CollectorRegistry)
    _instruments: dict[str, _Instrument] = attrs.Factory(dict)
    _children: dict[tuple[str, tuple[str, ...]], _Instrument] = attrs.Factory(dict)
    _server: WSGIServer | None = None

    def __attrs_post_init__(self) -> None:
        for metric in METRICS:
            self._instruments[metric.prometheus] = _instrument(metric, self.registry)

    def _get(self, metric: Metric, labels: tuple[str, ...]) -> _Instrument:
        key = (metric.prometheus, labels)
        child = self._children.get(key)
        if child is None:  # a labelled child is looked up (under a lock) once, then kept
            instrument = self._instruments[metric.prometheus]
            child = self._children[key] = instrument.labels(*labels) if labels else instrument
        return child

    def add(self, metric: Metric, value: float, labels: tuple[str, ...]) -> None:
        """Increment a counter by ``value``."""
        instrument = self._get(metric, labels)
        assert isinstance(instrument, Counter)
        instrument.inc(value)

    def set(self, metric: Metric, value: float, labels: tuple[str, ...]) -> None:
        """Set a gauge."""
        instrument = self._get(metric, labels)
        assert isinstance(instrument, Gauge)
        instrument.set(value)

    def observe(self, metric: Metric, value: float, labels: tuple[str, ...]) -> None:
        """Observe one histogram value."""
        instrument = self._get(metric, labels)
        assert isinstance(instrument, Histogram)
        instrument.observe(value)

    def serve(self, port: int, host: str = "127.0.0.1") -> int:
        """Serve the registry at ``http://HOST:PORT/metrics`` from a daemon thread.

        Args:
            port: the TCP port; 0 picks a free one.
            host: the address to listen on (loopback by default: put a proxy or the
                scraper on the same machine, or pass ``0.0.0.0`` deliberately).

        Returns:
            The port listened on.

        Raises:
            UsageError: the output serves already.
            OSError: the port cannot be bound.
        """
        if self._server is not None:
            raise UsageError("this Prometheus output serves already")
        server, _thread = start_http_server(port, addr=host, registry=self.registry)
        self._server = server
        return int(server.server_port)

    def close(self) -> None:
        """Stop serving (a no-op when not serving)."""
        server, self._server = self._server, None
        if server is not None:
            server.shutdown()
            server.server_close()


__all__ = ["PrometheusOutput"]
