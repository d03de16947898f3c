"""A `treadle.metrics.MetricsOutput` into a Prometheus registry (extra ``treadle[metrics]``).

`PrometheusOutput` makes one ``prometheus_client`` instrument per metric of
`treadle.metrics.METRICS` in its own registry (so that two outputs in one process do not
clash), and `PrometheusOutput.serve` exposes the registry over HTTP in the text exposition
format (docs/metrics.md, "Exporting"). The client library is thread-safe: the recorder
updates the instruments from the trio thread while the HTTP server's threads read them.
"""

from __future__ import annotations

import socket
import threading
from typing import Any, Final
from wsgiref.simple_server import WSGIRequestHandler

import attrs
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer

from treadle._clock import seconds_out_of_range
from treadle._exceptions import UsageError
from treadle.metrics import METRICS, Metric, MetricKind

IDLE_TIMEOUT_S: Final = 10.0
"""Seconds the metrics endpoint waits on a silent client (for its request, or for it to take
the answer) before hanging up (docs/metrics.md, "Exporting")."""

MAX_CONNECTIONS: Final = 32
"""Connections the metrics endpoint serves at once; another is closed unanswered until one
of them ends (docs/metrics.md, "Exporting")."""

_Instrument = Counter | Gauge | Histogram


def _instrument(metric: Metric, registry: CollectorRegistry) -> _Instrument:
    if metric.kind is MetricKind.COUNTER:
        return Counter(metric.prometheus, metric.help, metric.labels, registry=registry)
    if metric.kind is MetricKind.GAUGE:
        return Gauge(metric.prometheus, metric.help, metric.labels, registry=registry)
    return Histogram(
        metric.prometheus, metric.help, metric.labels, registry=registry, buckets=metric.buckets
    )


class _Handler(WSGIRequestHandler):
    """Answers one request of a connection, logging nothing; hangs up on a silent client.

    Its socket times out after the server's ``idle_timeout_s`` without a byte moving (what
    `socketserver.StreamRequestHandler.timeout` does for a whole class); the server then
    closes the connection.
    """

    server: _Server

    def setup(self) -> None:
        """Bound every read and write of the connection by the server's idle timeout."""
        self.request.settimeout(self.server.idle_timeout_s)
        super().setup()

    def handle(self) -> None:
        """Answer the request; a client silent past the timeout is no error, only closed."""
        try:
            super().handle()
        except TimeoutError:
            return

    def log_message(self, format: str, *args: Any) -> None:
        """Log nothing: a scrape is no news."""


class _Server(ThreadingWSGIServer):
    """prometheus_client's thread-per-connection server, with connections bounded.

    At most ``max_connections`` connections at once (each holds a thread and a socket until
    answered or silent for ``idle_timeout_s``); the server closes another unanswered.

    Raises:
        OSError: ``address`` cannot be bound.
    """

    def __init__(
        self, address: tuple[str, int], *, idle_timeout_s: float, max_connections: int
    ) -> None:
        self.address_family = _family(*address)
        self.idle_timeout_s = idle_timeout_s
        self._slots = threading.BoundedSemaphore(max_connections)
        super().__init__(address, _Handler)

    def verify_request(self, request: Any, client_address: Any) -> bool:
        """Take a connection slot; ``False`` (the connection is closed) when none is free."""
        return self._slots.acquire(blocking=False)

    def process_request(self, request: Any, client_address: Any) -> None:
        """Serve the connection in a thread of its own, which gives its slot back."""
        try:
            super().process_request(request, client_address)
        except BaseException:  # no thread started: nobody else gives the slot back
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        """Serve the connection, close it and free its slot."""
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()


def _family(host: str, port: int) -> socket.AddressFamily:
    """The address family of ``host`` (IPv6 for ``::1``), as prometheus_client picks it."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    return infos[0][0]


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
    _instruments: dict[str, _Instrument] = attrs.field(init=False, factory=dict)
    _children: dict[tuple[str, tuple[str, ...]], _Instrument] = attrs.field(
        init=False, factory=dict
    )
    _server: _Server | None = attrs.field(init=False, default=None)

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

    def serve(
        self,
        port: int,
        host: str = "127.0.0.1",
        *,
        idle_timeout_s: float = IDLE_TIMEOUT_S,
        max_connections: int = MAX_CONNECTIONS,
    ) -> int:
        """Serve the registry at ``http://HOST:PORT/metrics`` from daemon threads.

        Each connection is served by a thread of its own (one request, then closed); a
        client that sends or takes nothing for ``idle_timeout_s`` is hung up on, and at most
        ``max_connections`` are served at once: one more is closed unanswered (docs/metrics.md,
        "Exporting").

        Args:
            port: the TCP port; 0 picks a free one.
            host: the address to listen on (loopback by default: put a proxy or the
                scraper on the same machine, or pass ``0.0.0.0`` deliberately).
            idle_timeout_s: seconds a connection may stay silent (`IDLE_TIMEOUT_S`).
            max_connections: connections served at once (`MAX_CONNECTIONS`).

        Returns:
            The port listened on.

        Raises:
            UsageError: the output serves already, ``idle_timeout_s`` is not a finite
                number of seconds above 0, or ``max_connections`` is below 1.
            OSError: the port cannot be bound.
        """
        if self._server is not None:
            raise UsageError("this Prometheus output serves already")
        why = seconds_out_of_range(idle_timeout_s, above_zero=True)
        if why is not None:
            raise UsageError(f"idle_timeout_s {why}")
        if max_connections < 1:
            raise UsageError(f"max_connections must be at least 1, not {max_connections}")
        server = _Server(
            (host, port), idle_timeout_s=idle_timeout_s, max_connections=max_connections
        )
        server.set_app(make_wsgi_app(self.registry))
        threading.Thread(target=server.serve_forever, name="treadle metrics", daemon=True).start()
        self._server = server
        return int(server.server_port)

    def close(self) -> None:
        """Stop serving (a no-op when not serving)."""
        server, self._server = self._server, None
        if server is not None:
            server.shutdown()
            server.server_close()


__all__ = ["PrometheusOutput"]
