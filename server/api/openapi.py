"""The OpenAPI document, made true about errors in one place.

Every error the gateway sends is one of two JSON bodies (server/errors.py, app.py's handlers, the gate):
`ErrorBody` (`detail`, `category`) for every DomainError, and `ValidationErrorBody` (the same plus `errors`) for a
request FastAPI cannot validate (422; not FastAPI's own list form). `install(app)` replaces `app.openapi` with a
builder that adds to each operation the error statuses its route can answer, each with its body's schema:

- 401 where the route takes an API key (the gate authenticates before anything else), and 429 where the tenant's
  request rate counts it (gate.rate_counted: all of those but polling, heartbeats and the native client's routes);
- 413 where it takes a body (the gate's bound), 422 where it has parameters FastAPI validates;
- 400 and 404 where it takes input that names or carries something (a body, path or query parameters);
- the statuses of `EXTRA`, by path, for the errors only some routes raise (403 quota, 410 ended, 429 limits,
  500/503 a worker or a backend that is not there).

`tests/conformance/test_openapi_contract.py` sends real error requests and checks each answer against this
document; tests/conformance/test_fuzz.py runs schemathesis over it.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any, Literal

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from server.api.gate import api_routes, rate_counted, route_keys  # the gate's own reading of the route table


class ErrorBody(BaseModel):
    """Every 4xx/5xx answer but a 422."""

    detail: str
    category: Literal["user", "server", "rate_limited"]


class FieldError(BaseModel):
    loc: list[str | int]
    msg: str


class ValidationErrorBody(BaseModel):
    """A 422: the request did not validate; `errors` says where."""

    detail: str
    category: Literal["user"]
    errors: list[FieldError]


_MODEL = r"/api/v1/model/\{model\}/twinkle/"
_STORAGE = (403, 503)  # a save or copy past the tenant's storage quota; checkpoint storage not configured
# path regex -> statuses some routes add to the rule-based ones (first match wins, so put specific ones first).
EXTRA: list[tuple[str, tuple[int, ...]]] = [
    # 429: a tenant's cap of live sessions, models or sampling sessions (server/services/tenant_caps.py)
    (r"/api/v1/(twinkle/)?create_session$", (429,)),
    (r"/api/v1/(create_model|load_weights|create_sampling_session)$", (410, 429)),
    (_MODEL + r"add_adapter_to_model$", (429, 500)),
    # 410: a released model, or a session that has finished
    (r"/api/v1/(forward_backward|forward|optim_step|load_weights|get_info|create_sampling_session|create_model|"
     r"create_custom_loss)$", (410,)),
    (r"/api/v1/(save_weights|save_weights_for_sampler|save_weights_external)$", (*_STORAGE, 410)),
    (r"/api/v1/copy_weights$", (*_STORAGE, 410)),
    (r"/api/v1/(session_heartbeat|sessions/\{session_id\}/finish)$", (410,)),
    (r"/api/v1/asample$", (429,)),
    (r"/v1/chat/completions$", (429, 500)),
    (r"/api/v1/downloads/", (403, 503)),
    (r"/native/v1/(checkpoints/push|training_runs/\{run_id\}/auto_push|hub/tokens/)", (503,)),
    (_MODEL + r"(save|upload_to_hub)$", (*_STORAGE, 500)),
    (_MODEL, (500,)),  # a worker fault the native client waits on (JobFailed)
    (r"/api/v1/sampler/\{model\}/twinkle/sample$", (429, 500)),
    (r"/api/v1/processor/twinkle/", (410, 429)),  # a data loader's end (StopIteration); the tenant's data limits
]

_REASONS = {400: "Bad request", 401: "Missing, unknown or revoked API key", 403: "Forbidden",
            404: "Not found (or another tenant's)", 410: "Gone (ended)", 413: "Request body too large",
            422: "Request does not validate", 429: "Over a limit (see Retry-After)", 500: "Server error",
            503: "Not available in this deployment"}


def install(app: FastAPI) -> None:
    """Make `app.openapi()` build (once) the document with the error answers of every route."""
    authenticated = set(_authenticated_routes(app))

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            doc = get_openapi(title=app.title, version=app.version, routes=app.routes, description=app.description)
            app.openapi_schema = document_errors(doc, authenticated)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def document_errors(doc: dict[str, Any], authenticated: set[tuple[str, str]]) -> dict[str, Any]:
    schemas = doc.setdefault("components", {}).setdefault("schemas", {})
    schemas["ErrorBody"] = ErrorBody.model_json_schema()
    invalid = ValidationErrorBody.model_json_schema(ref_template="#/components/schemas/{model}")
    schemas.update(invalid.pop("$defs"))
    schemas["ValidationErrorBody"] = invalid
    for name in ("HTTPValidationError", "ValidationError"):  # FastAPI's list form: never sent
        schemas.pop(name, None)
    for path, ops in doc.get("paths", {}).items():
        for method, op in ops.items():
            responses = op.setdefault("responses", {})
            for status in statuses(path, op, (path, method) in authenticated):
                responses[str(status)] = {"description": _REASONS[status], "content": _body(status)}
            for status, answer in responses.items():  # a route's own error statuses (e.g. /metrics' 401)
                if status[0] in "45" and "content" not in answer:
                    answer["content"] = _body(int(status))
    return doc


def _body(status: int) -> dict[str, Any]:
    ref = "ValidationErrorBody" if status == 422 else "ErrorBody"
    return {"application/json": {"schema": {"$ref": f"#/components/schemas/{ref}"}}}


def statuses(path: str, op: dict[str, Any], authenticated: bool) -> list[int]:
    params = op.get("parameters", [])
    takes_input = "requestBody" in op or any(p.get("in") in ("path", "query") for p in params)
    found: set[int] = set()
    if authenticated:
        found.add(401)
        if rate_counted(path, op.get("tags", ())):
            found.add(429)
    if "requestBody" in op:
        found.add(413)
    if "422" in op.get("responses", {}) or takes_input:
        found.add(422)
    if takes_input:
        found.update((400, 404))
    for pattern, extra in EXTRA:
        if re.search(pattern, path):
            found.update(extra)
            break
    return sorted(found)


def _authenticated_routes(app: FastAPI) -> Iterable[tuple[str, str]]:
    """(OpenAPI path, method) of every route that takes a key (depends on deps.Tenant or BearerTenant)."""
    for path, methods, dependant in api_routes(app.router.routes):
        if route_keys(dependant) is not None:
            for method in methods:
                yield _openapi_path(path), method.lower()


def _openapi_path(path: str) -> str:
    return re.sub(r"\{(\w+):\w+\}", r"{\1}", path)  # {model:path} -> {model}, as the document writes it

