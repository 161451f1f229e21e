"""OpenTelemetry spans per request, on a TracerProvider owned by one gateway instance.

Off by default (no endpoint): then :func:`make_tracer` returns None and the hot path skips
span creation entirely.
"""

from __future__ import annotations

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.trace import Tracer


def make_provider(
    endpoint: str | None, service_name: str, exporter: SpanExporter | None = None
) -> TracerProvider | None:
    if endpoint is None and exporter is None:
        return None
    provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
    if exporter is None:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        exporter = OTLPSpanExporter(endpoint=endpoint)
    provider.add_span_processor(BatchSpanProcessor(exporter))
    return provider


def make_tracer(provider: TracerProvider | None) -> Tracer | None:
    return None if provider is None else provider.get_tracer("kvgate.gateway")
