"""The fuzzing driver of test_fuzz.py: schemathesis cases for every operation of a server's OpenAPI document, sent
with one of several tenants' keys, each answer checked; failures collected (not raised) so one run reports them all."""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field

import hypothesis.strategies as st
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis.checks import not_a_server_error
from schemathesis.core.failures import Failure, FailureGroup
from schemathesis.generation.modes import GenerationMode
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]


@dataclass
class Report:
    cases: int = 0
    statuses: Counter[int] = field(default_factory=Counter)
    failures: list[str] = field(default_factory=list)  # "<check title>: METHOD path -> status: body"
    ungenerated: list[str] = field(default_factory=list)  # "mode METHOD path": nothing of that mode exists

    def summary(self) -> str:
        head = (f"{self.cases} cases, statuses {dict(sorted(self.statuses.items()))}, {len(self.failures)} failures,"
                f" {len(self.ungenerated)} (operation, mode) pairs without cases")
        return "\n".join([head, *self.failures[:40], "without cases: " + ", ".join(self.ungenerated)])


def fuzz(base_url: str, keys: list[str], examples: int, report: Report, known: dict[str, str] | None = None,
         modes: tuple[GenerationMode, ...] = (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)) -> None:
    """`examples` cases per operation and generation mode, each sent with one of `keys` (X-API-Key). With
    `known` (path parameter or top-level body field name -> a real id or path of the first key's tenant), one more
    positive pass per operation sends those values in place of generated ones, so cases get past the lookups."""
    schema = schemathesis.openapi.from_url(f"{base_url}/openapi.json", timeout=30)
    for result in schema.get_all_operations():
        operation = result.ok()
        for mode in modes:
            _run(operation, mode, base_url, keys, examples, report)
        if known:
            _run(operation, GenerationMode.POSITIVE, base_url, keys[:1], examples, report, known)


def _run(operation: object, mode: GenerationMode, base_url: str, keys: list[str], examples: int,
         report: Report, known: dict[str, str] | None = None) -> None:
    fixed = {name: known[name] for name in re.findall(r"\{(\w+)\}", operation.path)  # type: ignore[attr-defined]
             if name in known} if known else {}
    strategy = operation.as_strategy(generation_mode=mode, path_parameters=fixed)  # type: ignore[attr-defined]

    @settings(max_examples=examples, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck), phases=[Phase.explicit, Phase.generate])
    @given(case=strategy, key=st.sampled_from(keys))
    def one(case: schemathesis.Case, key: str) -> None:
        if known and isinstance(case.body, dict):
            case.body = {k: known.get(k, v) for k, v in case.body.items()}
        headers = {"X-API-Key": key}
        if case.headers:  # a generated key header would replace ours: keep ours, the fuzzer's other headers
            case.headers = {k: v for k, v in case.headers.items()
                            if k.lower() not in ("x-api-key", "authorization", "twinkle-authorization")}
        response = case.call(base_url=base_url, headers=headers, timeout=60)
        report.cases += 1
        report.statuses[response.status_code] += 1
        try:
            case.validate_response(response, checks=CHECKS, headers=headers)
        except (Failure, FailureGroup) as e:
            failures = e.exceptions if isinstance(e, FailureGroup) else [e]
            for f in failures:
                report.failures.append(f"{f.title}: {case.method} {case.formatted_path} -> {response.status_code}: "
                                       f"{response.text[:200]}")

    try:
        one()
    except Unsatisfiable:  # e.g. no negative case of a body that takes any bytes (forward_backward's protobuf)
        where = f"{operation.method.upper()} {operation.path}"  # type: ignore[attr-defined]
        report.ungenerated.append(f"{mode.value}{' known ids' if known else ''} {where}")
