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

It also adds the OpenAPI `links` of `LINKS`: where one operation's answer (or request) names what another takes
(a session id into create_model, a future into retrieve_future, a run id into its checkpoints, ...), so a client,
and schemathesis' stateful fuzzing (tests/conformance/test_fuzz_stateful.py), can chain the operations.

`tests/conformance/test_openapi_contract.py` sends real error requests and checks each answer against this
document; tests/conformance/test_fuzz.py runs schemathesis over it; tests/unit/test_openapi_links.py holds every link
to the operations, parameters and fields it names.
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

# OpenAPI links, by source ("METHOD path") and the status whose answer they read -> {target: {where: value}}.
# `where` is a target parameter ("path.NAME", "query.NAME", "header.NAME") or a field of its JSON body ("body.NAME",
# "body.A.B" nested); `value` a runtime expression ($response.body#/..., $request.path.NAME, $request.body#/...,
# $request.header.NAME) or a constant. tests/unit/test_openapi_links.py holds each to the document.
_T, _N, _W = "/api/v1/", "/native/v1/", "/api/v1/twinkle/"
_SESSION = "$response.body#/session_id"
_FUTURE = {"body.request_id": "$response.body#/request_id"}
_POLL = {f"POST {_T}retrieve_future": _FUTURE, f"POST {_T}cancel_future": _FUTURE}
_MODEL = "$response.body#/model_id"
_ONE_CKPT = _T + "training_runs/{run_id}/checkpoints/{kind}/{name}"


def _saved(kind: str) -> dict[str, dict[str, str]]:
    """A save names its checkpoint: the run (model_id) and name (path) it was sent, the kind its route saves."""
    where = {"path.run_id": "$request.body#/model_id", "path.kind": kind, "path.name": "$request.body#/path"}
    return {f"POST {_ONE_CKPT}/publish": where, f"DELETE {_ONE_CKPT}/publish": where, f"PUT {_ONE_CKPT}/ttl": where,
            f"DELETE {_ONE_CKPT}": where, **_POLL}


def _checkpoints(path: str, run: str = "", checkpoint: str = "") -> dict[str, dict[str, str]]:
    """A checkpoint list's first checkpoint into the operations that take one: by `tinker://` path, and (where the
    list names its run) by run and checkpoint id ("weights/NAME", one segment of the native routes)."""
    links = {f"POST {_T}weights_info": {"body.tinker_path": path}, f"POST {_T}load_weights": {"body.path": path},
             f"POST {_T}copy_weights": {"body.source_path": path},
             f"POST {_T}create_sampling_session": {"body.model_path": path},
             f"POST {_T}asample": {"body.model_path": path}, f"POST {_N}checkpoints/push": {"body.tinker_path": path}}
    if run:
        by_id = {"path.run_id": run, "path.checkpoint_id": checkpoint}
        links[f"GET {_W}checkpoint_path/{{run_id}}/{{checkpoint_id}}"] = by_id
        links[f"DELETE {_W}training_runs/{{run_id}}/checkpoints/{{checkpoint_id}}"] = by_id
    return links


def _run(run: str) -> dict[str, dict[str, str]]:
    return {f"GET {_T}training_runs/{{run_id}}": {"path.run_id": run},
            f"GET {_T}training_runs/{{run_id}}/checkpoints": {"path.run_id": run},
            f"POST {_T}get_info": {"body.model_id": run}}


LINKS: dict[tuple[str, str], dict[str, dict[str, str]]] = {
    # Tinker sessions
    (f"POST {_T}create_session", "200"): {
        **{f"POST {_T}{op}": {"body.session_id": _SESSION} for op in (
            "session_heartbeat", "create_model", "create_sampling_session", "load_weights", "copy_weights",
            "create_custom_loss", "sessions/search")},
        **{f"{method} {_T}sessions/{{session_id}}{tail}": {"path.session_id": _SESSION} for method, tail in (
            ("GET", ""), ("POST", "/finish"), ("PUT", "/project"), ("GET", "/trace_export"))},
    },
    (f"POST {_T}sessions/{{session_id}}/finish", "200"): {  # a finished session: 410 where it would be used
        f"POST {_T}session_heartbeat": {"body.session_id": "$request.path.session_id"},
        f"POST {_T}create_model": {"body.session_id": "$request.path.session_id"},
        f"GET {_T}sessions/{{session_id}}": {"path.session_id": "$request.path.session_id"},
    },
    (f"GET {_T}sessions", "200"): {
        f"GET {_T}sessions/{{session_id}}": {"path.session_id": "$response.body#/sessions/0"}},
    (f"POST {_T}sessions/search", "200"): {
        f"GET {_T}sessions/{{session_id}}{tail}": {"path.session_id": "$response.body#/sessions/0/session_id"}
        for tail in ("", "/trace_export")},
    (f"GET {_T}sessions/{{session_id}}", "200"): {
        f"GET {_T}training_runs/{{run_id}}": {"path.run_id": "$response.body#/training_run_ids/0"},
        f"GET {_T}samplers/{{sampler_id}}": {"path.sampler_id": "$response.body#/sampler_ids/0"},
    },
    # Tinker models, training and their futures
    (f"POST {_T}create_model", "200"): {
        **_POLL, **_run(_MODEL),
        **{f"POST {_T}{op}": {"body.model_id": _MODEL} for op in (
            "forward_backward", "forward", "optim_step", "save_weights", "save_weights_for_sampler",
            "save_weights_external", "load_weights")},
        **{f"{method} {_N}training_runs/{{run_id}}/auto_push": {"path.run_id": _MODEL} for method in ("PUT", "GET")},
    },
    **{(f"POST {_T}{op}", "200"): _POLL for op in (
        "forward_backward", "forward", "optim_step", "load_weights", "create_custom_loss", "asample")},
    (f"POST {_T}save_weights", "200"): _saved("weights"),
    (f"POST {_T}save_weights_for_sampler", "200"): _saved("sampler_weights"),
    (f"POST {_T}save_weights_external", "200"): {
        f"GET {_T}training_runs/{{run_id}}/checkpoints/external_weights/{{name}}/external_weights_urls": {
            "path.run_id": "$request.body#/model_id", "path.name": "$request.body#/path"}, **_POLL},
    (f"POST {_ONE_CKPT}/publish", "204"): {f"DELETE {_ONE_CKPT}/publish": {
        f"path.{p}": f"$request.path.{p}" for p in ("run_id", "kind", "name")}},
    (f"DELETE {_ONE_CKPT}", "204"): {
        f"GET {_T}training_runs/{{run_id}}/checkpoints": {"path.run_id": "$request.path.run_id"}},
    # Tinker sampling
    (f"POST {_T}create_sampling_session", "200"): {
        f"POST {_T}asample": {"body.sampling_session_id": "$response.body#/sampling_session_id"},
        f"GET {_T}samplers/{{sampler_id}}": {"path.sampler_id": "$response.body#/sampling_session_id"},
        f"POST {_T}retrieve_futures": {"body.target.sampling_session_id": "$response.body#/sampling_session_id"},
    },
    # Tinker REST: runs and checkpoints
    (f"GET {_T}training_runs", "200"): _run("$response.body#/training_runs/0/training_run_id"),
    (f"GET {_T}training_runs/{{run_id}}", "200"): {
        f"GET {_T}training_runs/{{run_id}}/checkpoints": {"path.run_id": "$response.body#/training_run_id"},
        f"POST {_T}weights_info": {"body.tinker_path": "$response.body#/last_checkpoint/tinker_path"},
    },
    (f"GET {_T}training_runs/{{run_id}}/checkpoints", "200"): _checkpoints(
        "$response.body#/checkpoints/0/tinker_path", "$request.path.run_id",
        "$response.body#/checkpoints/0/checkpoint_id"),
    (f"GET {_T}checkpoints", "200"): _checkpoints("$response.body#/checkpoints/0/tinker_path"),
    (f"POST {_T}copy_weights", "200"): {f"POST {_T}weights_info": {"body.tinker_path": "$response.body#/tinker_path"}},
    # hub pushes (native/v1)
    (f"PUT {_N}hub/tokens/{{provider}}", "200"): {
        f"{method} {_N}hub/tokens/{{provider}}": {"path.provider": "$request.path.provider"}
        for method in ("GET", "DELETE")},
    (f"POST {_N}checkpoints/push", "202"): {f"GET {_N}pushes/{{push_id}}": {"path.push_id": "$response.body#/push_id"}},
    (f"PUT {_N}training_runs/{{run_id}}/auto_push", "200"): {
        f"{method} {_N}training_runs/{{run_id}}/auto_push": {"path.run_id": "$request.path.run_id"}
        for method in ("GET", "DELETE")},
    (f"DELETE {_N}training_runs/{{run_id}}/auto_push", "204"): {  # gone: 404
        f"GET {_N}training_runs/{{run_id}}/auto_push": {"path.run_id": "$request.path.run_id"}},
    # twinkle-kit's native protocol: its session travels in the X-Twinkle-Session-Id header
    (f"POST {_W}create_session", "200"): {
        f"POST {_W}session_heartbeat": {"body.session_id": _SESSION},
        **{f"POST {_T}model/{{model}}/twinkle/{op}": {"header.X-Twinkle-Session-Id": _SESSION}
           for op in ("add_adapter_to_model", "save")},
        f"POST {_T}processor/twinkle/create": {"header.X-Twinkle-Session-Id": _SESSION},
    },
    (f"GET {_W}training_runs", "200"): {
        f"GET {_W}training_runs/{{run_id}}{tail}": {"path.run_id": "$response.body#/training_runs/0/training_run_id"}
        for tail in ("", "/checkpoints")},
    (f"GET {_W}training_runs/{{run_id}}", "200"): {
        f"GET {_W}training_runs/{{run_id}}/checkpoints": {"path.run_id": "$response.body#/training_run_id"}},
    (f"GET {_W}training_runs/{{run_id}}/checkpoints", "200"): {
        f"POST {_W}weights_info": {"body.twinkle_path": "$response.body#/checkpoints/0/twinkle_path"},
        f"POST {_T}model/{{model}}/twinkle/upload_to_hub": {
            "body.checkpoint_dir": "$response.body#/checkpoints/0/twinkle_path"},
        **{f"{method} {_W}{path}": {"path.run_id": "$request.path.run_id",
                                    "path.checkpoint_id": "$response.body#/checkpoints/0/checkpoint_id"}
           for method, path in (("GET", "checkpoint_path/{run_id}/{checkpoint_id}"),
                                ("DELETE", "training_runs/{run_id}/checkpoints/{checkpoint_id}"))}},
    (f"DELETE {_W}training_runs/{{run_id}}/checkpoints/{{checkpoint_id}}", "200"): {  # gone: 404
        f"GET {_W}checkpoint_path/{{run_id}}/{{checkpoint_id}}": {
            f"path.{p}": f"$request.path.{p}" for p in ("run_id", "checkpoint_id")}},
    (f"POST {_T}model/{{model}}/twinkle/save", "200"): {
        f"POST {_W}weights_info": {"body.twinkle_path": "$response.body#/twinkle_path"},
        f"POST {_T}model/{{model}}/twinkle/upload_to_hub": {
            "path.model": "$request.path.model", "body.checkpoint_dir": "$response.body#/twinkle_path"}},
    (f"POST {_T}model/{{model}}/twinkle/upload_to_hub", "200"): {
        f"GET {_T}model/{{model}}/twinkle/upload_status/{{request_id}}": {
            "path.model": "$request.path.model", "path.request_id": "$response.body#/request_id"}},
    (f"POST {_T}processor/twinkle/create", "200"): {f"POST {_T}processor/twinkle/call": {
        "header.X-Twinkle-Session-Id": "$request.header.X-Twinkle-Session-Id",
        "body.processor_id": "$response.body#/processor_id"}},
}


def install(app: FastAPI) -> None:
    """Make `app.openapi()` build (once) the document with the error answers of every route."""
    authenticated = set(_authenticated_routes(app))

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            doc = get_openapi(title=app.title, version=app.version, routes=app.routes, description=app.description)
            app.openapi_schema = document_links(document_errors(doc, authenticated))
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


def document_links(doc: dict[str, Any]) -> dict[str, Any]:
    """Add `LINKS` to the responses they read, each named by its target's summary (e.g. `CreateModel`) and pointing
    at it by operationId. A link whose source, status or target the document lacks is left out (see `unplaced`)."""
    paths = doc.get("paths", {})
    for (source, status), targets in LINKS.items():
        answer = _operation(paths, source).get("responses", {}).get(status)
        if answer is None:
            continue
        links = answer.setdefault("links", {})
        for target, values in targets.items():
            op = _operation(paths, target)
            if "operationId" not in op:
                continue
            link: dict[str, Any] = {"operationId": op["operationId"]}
            for where, value in values.items():
                kind, _, name = where.partition(".")
                if kind == "body":
                    *outer, field = name.split(".")
                    body = link.setdefault("requestBody", {})
                    for key in outer:
                        body = body.setdefault(key, {})
                    body[field] = value
                else:
                    link.setdefault("parameters", {})[where] = value
            name = re.sub(r"\W", "", str(op.get("summary") or op["operationId"]).title())
            links[op["operationId"] if name in links else name] = link
        if not links:
            del answer["links"]
    return doc


def unplaced(doc: dict[str, Any]) -> list[str]:
    """The links of `LINKS` that `document_links` could not place: a source, status or target not in `doc`."""
    paths = doc.get("paths", {})
    missing = []
    for (source, status), targets in LINKS.items():
        if status not in _operation(paths, source).get("responses", {}):
            missing.append(f"{source} {status}")
            continue
        missing += [f"{source} {status} -> {target}" for target in targets
                    if "operationId" not in _operation(paths, target)]
    return missing


def _operation(paths: dict[str, Any], route: str) -> dict[str, Any]:
    method, _, path = route.partition(" ")
    op = paths.get(path, {}).get(method.lower(), {})
    return op if isinstance(op, dict) else {}


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

