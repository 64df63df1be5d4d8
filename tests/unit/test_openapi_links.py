"""The OpenAPI document's links (server/api/openapi.py `LINKS`) hold: each names an operation of the document, the
target's parameters and JSON body fields it fills exist, and each runtime expression reads a parameter the source
takes or a field its answer (or request body) declares. A renamed route, parameter or field cannot leave a
dangling link. schemathesis (which the stateful fuzzing, tests/conformance/test_fuzz_stateful.py, runs) reads
every link as a transition."""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import pytest
import schemathesis
from schemathesis.specs.openapi.stateful import collect_transitions

from api_schemas.models import ServedModel
from jobqueue.local_queue import LocalQueue
from server.api.openapi import LINKS, unplaced
from server.app import create_app
from server.config import Settings

Doc = dict[str, Any]


@pytest.fixture(scope="module")
def doc(tmp_path_factory: pytest.TempPathFactory) -> Doc:
    served = ServedModel(name="org/model", vocab_size=100, max_context=64, tokenizer_id="org/model")
    app = create_app(Settings(data_dir=Path(tmp_path_factory.mktemp("links"))), LocalQueue(), {"org/model": served})
    return app.openapi()


def _links(doc: Doc) -> list[tuple[str, str, str, str, dict[str, Any], dict[str, Any]]]:
    """(path, method, status, name, link, source operation) of every link in `doc`."""
    return [(path, method, status, name, link, op) for path, ops in doc["paths"].items() for method, op in ops.items()
            for status, answer in op.get("responses", {}).items() for name, link in answer.get("links", {}).items()]


def _resolve(doc: Doc, schema: Any) -> Any:
    while isinstance(schema, dict) and "$ref" in schema:
        schema = doc["components"]["schemas"][schema["$ref"].rsplit("/", 1)[1]]
    return schema


def _declares(doc: Doc, schema: Any, pointer: list[str]) -> bool:
    """Whether a value at `pointer` (field names, array indices) can be there under `schema`; a free-form object
    (the native protocol's bodies and answers: no properties, additional ones allowed) may hold anything."""
    schema = _resolve(doc, schema)
    if not pointer:
        return True
    if not isinstance(schema, dict):
        return False
    branches = schema.get("anyOf", []) + schema.get("oneOf", []) + schema.get("allOf", [])
    if branches:
        return any(_declares(doc, branch, pointer) for branch in branches)
    head, rest = pointer[0], pointer[1:]
    if head.isdigit() and "items" in schema:
        return _declares(doc, schema["items"], rest)
    if head in schema.get("properties", {}):
        return _declares(doc, schema["properties"][head], rest)
    free = schema.get("type", "object") == "object" and "properties" not in schema and "items" not in schema
    return free and schema.get("additionalProperties", True) is not False


def _json_body(op: dict[str, Any]) -> Any:
    """The schema of `op`'s JSON body: None if it takes none, {} (anything) if it declares no schema (the
    forward_backward / forward JSON batches of older SDKs)."""
    media = op.get("requestBody", {}).get("content", {}).get("application/json")
    return None if media is None else media.get("schema", {})


def _has_parameter(op: dict[str, Any], location: str, name: str) -> bool:
    same = (lambda a, b: a.lower() == b.lower()) if location == "header" else (lambda a, b: a == b)
    return any(p["in"] == location and same(p["name"], name) for p in op.get("parameters", []))


def _expression_problem(doc: Doc, op: dict[str, Any], status: str, expr: Any) -> str | None:
    """What is wrong with a link value read from the source operation `op` (None: nothing)."""
    if not isinstance(expr, str) or not expr.startswith("$"):
        return None  # a constant
    if m := re.fullmatch(r"\$response\.body#/(.*)", expr):
        schema = op["responses"][status].get("content", {}).get("application/json", {}).get("schema")
        return None if schema is not None and _declares(doc, schema, m[1].split("/")) else f"{expr}: not in the answer"
    if m := re.fullmatch(r"\$request\.body#/(.*)", expr):
        schema = _json_body(op)
        return None if schema is not None and _declares(doc, schema, m[1].split("/")) else f"{expr}: not in the request"
    if m := re.fullmatch(r"\$request\.(path|query|header)\.([\w-]+)", expr):
        return None if _has_parameter(op, m[1], m[2]) else f"{expr}: the source takes no such parameter"
    return f"{expr}: not an expression this document uses"


def link_problems(doc: Doc) -> list[str]:
    """Every way a link of `doc` does not fit the operations it joins."""
    by_id = {op["operationId"]: op for ops in doc["paths"].values() for op in ops.values()}
    problems = []
    for path, method, status, name, link, source in _links(doc):
        where = f"{method.upper()} {path} [{status}] {name}"
        if not status.startswith("2"):
            problems.append(f"{where}: a link from an error answer")
        target = by_id.get(link.get("operationId", ""))
        if target is None:
            problems.append(f"{where}: no operation {link.get('operationId')!r}")
            continue
        values: list[Any] = []
        for qualified, value in link.get("parameters", {}).items():
            location, _, param = qualified.partition(".")
            if not _has_parameter(target, location, param):
                problems.append(f"{where}: the target takes no {location} parameter {param!r}")
            values.append(value)
        stack = [([], link["requestBody"])] if "requestBody" in link else []
        while stack:
            at, body = stack.pop()
            for key, value in body.items():
                schema = _json_body(target)
                if schema is None or not _declares(doc, schema, [*at, key]):
                    problems.append(f"{where}: the target's body has no field {'.'.join([*at, key])!r}")
                if isinstance(value, dict):
                    stack.append(([*at, key], value))
                else:
                    values.append(value)
        problems += [f"{where}: {p}" for v in values if (p := _expression_problem(doc, source, status, v))]
    return problems


def test_every_link_of_the_table_is_in_the_document(doc: Doc) -> None:
    assert unplaced(doc) == []
    assert len(_links(doc)) == sum(len(targets) for targets in LINKS.values())


def test_every_link_names_operations_parameters_and_fields_that_exist(doc: Doc) -> None:
    assert link_problems(doc) == []


def test_schemathesis_reads_every_link_as_a_transition(doc: Doc) -> None:
    schema = schemathesis.openapi.from_dict(copy.deepcopy(doc))
    transitions = collect_transitions([result.ok() for result in schema.get_all_operations()])  # raises on a bad link
    assert sum(len(t.outgoing) for t in transitions.operations.values()) == len(_links(doc))


def _first_link(doc: Doc, source: str, target_summary: str) -> dict[str, Any]:
    method, path = source.split(" ", 1)
    return doc["paths"][path][method.lower()]["responses"]["200"]["links"][target_summary]


def test_a_renamed_route_parameter_or_field_is_a_dangling_link(doc: Doc) -> None:
    """The checks above catch each way a link can go stale."""
    renamed = copy.deepcopy(doc)
    renamed["paths"]["/api/v1/create_model"]["post"]["operationId"] = "create_model_v2"
    assert any("no operation 'create_model_api_v1_create_model_post'" in p for p in link_problems(renamed))

    param = copy.deepcopy(doc)
    for p in param["paths"]["/api/v1/sessions/{session_id}"]["get"]["parameters"]:
        if p["name"] == "session_id":
            p["name"] = "id"
    assert any("takes no path parameter 'session_id'" in p for p in link_problems(param))

    field = copy.deepcopy(doc)
    field["components"]["schemas"]["SessionHeartbeatRequest"]["properties"]["sid"] = (
        field["components"]["schemas"]["SessionHeartbeatRequest"]["properties"].pop("session_id"))
    assert any("body has no field 'session_id'" in p for p in link_problems(field))

    answer = copy.deepcopy(doc)
    answer["components"]["schemas"]["CreateSessionResponse"]["properties"].pop("session_id")
    assert any("$response.body#/session_id: not in the answer" in p for p in link_problems(answer))

    source = copy.deepcopy(doc)
    _first_link(source, "POST /api/v1/save_weights", "PublishCheckpoint")["parameters"]["path.name"] = (
        "$request.body#/name")
    assert any("$request.body#/name: not in the request" in p for p in link_problems(source))
