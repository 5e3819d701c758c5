"""What the ecosystem's tools see of phalanx: Prometheus metrics read from the run DB
(``observe.metrics``) and OpenTelemetry spans of runs, stages, attempts, ranks and exchanges
(``observe.tracing``).  Both are optional: their libraries come with the ``ui`` and ``otel``
extras, and nothing here is imported unless asked for (docs/observe.md)."""
