"""A tiny OTLP/HTTP trace receiver for tests: records every POST to /v1/traces (protobuf, gzip or not) and
answers 200, as a collector does; `spans()` decodes what arrived into plain dicts."""

from __future__ import annotations

import gzip
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class OtlpReceiver:
    def __init__(self) -> None:
        self.posts: list[tuple[str, bytes]] = []
        self._lock = threading.Lock()
        received = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                with received._lock:
                    received.posts.append((self.path, body))
                self.send_response(200 if self.path == "/v1/traces" else 404)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> OtlpReceiver:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()

    def spans(self) -> list[dict[str, Any]]:
        """Every span received: name, kind, ids as hex, parent id ('' for a root), attributes, resource attributes."""
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

        out = []
        with self._lock:
            posts = list(self.posts)
        for path, body in posts:
            if path != "/v1/traces":
                continue
            request = ExportTraceServiceRequest.FromString(body)
            for rs in request.resource_spans:
                resource = {a.key: _value(a.value) for a in rs.resource.attributes}
                for ss in rs.scope_spans:
                    for s in ss.spans:
                        out.append({"name": s.name, "kind": s.kind, "trace_id": s.trace_id.hex(),
                                    "span_id": s.span_id.hex(), "parent_span_id": s.parent_span_id.hex(),
                                    "attributes": {a.key: _value(a.value) for a in s.attributes},
                                    "resource": resource, "links": [link.span_id.hex() for link in s.links]})
        return out


def _value(v: Any) -> Any:
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind else None
