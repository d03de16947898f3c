"""Event sinks shipped with treadle (`treadle.ports.EventSink` implementations).

* `treadle.sinks.otel.OpenTelemetrySink`: OpenTelemetry spans following the GenAI semantic
  conventions; needs the optional extra ``treadle[otel]``.
"""
