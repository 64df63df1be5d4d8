"""Tracing into memory for tests: jobqueue/tracing.py's own `setup` with opentelemetry-sdk's InMemorySpanExporter
(each span exported as it ends), turned off again afterwards."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest

from jobqueue import tracing


@contextlib.contextmanager
def recorded_spans() -> Iterator[Any]:
    """The exporter (`get_finished_spans()`) while tracing is on in this process; skips without the otel extra."""
    pytest.importorskip("opentelemetry.sdk")
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    tracing.setup(exporter=exporter, service_name="twinkle-test", batch=False)
    try:
        yield exporter
    finally:
        tracing.shutdown()


def by_name(spans: Any, name: str) -> list[Any]:
    return [s for s in spans if s.name == name]
