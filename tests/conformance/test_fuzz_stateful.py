"""Stateful fuzzing: schemathesis' state machine over the links of the server's own /openapi.json with two tenants'
keys (tests/conformance/stateful_fuzzing.py). Scenarios chain operations with values from real answers (a session
into create_model, its future into retrieve_future, its run into the checkpoint routes, ...). Target: no 5xx, no
answer the document does not declare (status, content type, schema), a deleted resource gone and a created one
there, and no step that uses another tenant's session, run, future, ... answered with success.

Bounded: TWINKLE_FUZZ_SCENARIOS scenarios (default 100) of at most TWINKLE_FUZZ_STEPS steps (default 25), on the
tiny model and the fuzzers' own server (conftest.fuzz_server). Run it alone:
    .venv/bin/python -m pytest -q tests/conformance/test_fuzz_stateful.py -s     (prints the figures)
"""

from __future__ import annotations

import os

from tests.conformance.stateful_fuzzing import StatefulReport, fuzz_stateful
from tests.support.server import ServerProcess

SCENARIOS = int(os.environ.get("TWINKLE_FUZZ_SCENARIOS", "100"))
STEPS = int(os.environ.get("TWINKLE_FUZZ_STEPS", "25"))


def test_linked_scenarios_find_no_server_error_no_contract_violation_no_cross_tenant_success(
        fuzz_server: ServerProcess) -> None:
    report = StatefulReport()
    keys = [fuzz_server.api_key_a, fuzz_server.api_key_b]  # type: ignore[attr-defined]
    fuzz_stateful(fuzz_server.base_url, keys, fuzz_server.base_model, SCENARIOS, STEPS, report)
    print("\nstateful fuzz:", report.summary())
    print("links followed:", dict(report.links.most_common()))
    print("with the other tenant's values:", dict(report.crossed_ops.most_common()))
    for op, st in sorted(report.by_operation.items()):
        print(" ", op, dict(st))
    assert report.scenarios >= SCENARIOS, report.summary()
    assert report.depth >= 3 and report.linked_ok > 0, report.summary()  # chains reached past the lookups
    assert sum(report.crossed.values()) > 0, report.summary()  # other tenant's values were tried
    assert fuzz_server.running(), fuzz_server.log()
    assert not report.failures, report.summary()
