"""The stateful fuzzing driver of test_fuzz_stateful.py: schemathesis' state machine over the links of the server's
OpenAPI document (server/api/openapi.py `LINKS`). A scenario starts at an operation that needs nothing from an
earlier answer (create_session, a list, ...) and follows links, each value taken from a real answer (a session into
create_model, its future into retrieve_future, its run into the checkpoint routes, ...), so cases get past the
lookups into the services in the order a client calls them.

Two tenants: each scenario has a home tenant (A and B in turn) whose key most steps carry; a step carries the other
tenant's key with probability `SWITCH`. A step that follows a link with a value another tenant owns (a session, run,
future, ...) must not succeed (`cross-tenant` failures; the published-checkpoint reads are the one exception).
Every answer is checked (`STATEFUL_CHECKS`) and failures are collected, not raised, so one run reports them all."""

from __future__ import annotations

import itertools
import random
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any
from unittest import mock

import hypothesis
import schemathesis
from hypothesis import HealthCheck, Phase, settings
from hypothesis.errors import FlakyStrategyDefinition
from schemathesis.checks import CHECKS as CHECK_REGISTRY
from schemathesis.checks import load_all_checks
from schemathesis.core.failures import Failure, FailureGroup
from schemathesis.core.parameters import ParameterLocation
from schemathesis.engine.errors import is_inconsistent_replay
from schemathesis.generation.stateful.state_machine import APIStateMachine, StepInput, StepOutput
from schemathesis.specs.openapi import stateful
from schemathesis.specs.openapi.checks import ensure_resource_availability, use_after_free

from tests.conformance.fuzzing import CHECKS, Report

# Every check schemathesis has: the stateless ones (fuzzing.CHECKS); those that read a scenario's history (a
# resource deleted must then answer 404: use_after_free; one just created must not: ensure_resource_availability);
# negative_data_rejection (a request the document rules out must not succeed); and the coverage-phase ones, which
# have no case here (missing_required_header, unsupported_method). All but these, each with its reason:
NOT_APPLIED = {
    # a schema-valid request can still break a rule the document cannot say ("a tinker:// path of one of your
    # checkpoints", "session_id + model_seq_id or model_id + seq_id"): a 400, which is declared
    "positive_data_acceptance",
    # both need the document to declare security schemes (and WFC identities): the key is a header parameter here;
    # the cross-tenant check below (and test_isolation_matrix.py) holds what object_level_authorization would
    "ignored_auth", "object_level_authorization",
}
load_all_checks()
STATEFUL_CHECKS = [check for check in CHECK_REGISTRY.get_all() if check.__name__ not in NOT_APPLIED]
assert {*CHECKS, use_after_free, ensure_resource_availability} <= set(STATEFUL_CHECKS)
SWITCH = 0.25  # the chance that a step carries the other tenant's key
AUTH_HEADERS = frozenset({"x-api-key", "authorization", "twinkle-authorization"})
# Link-carried values that belong to the tenant whose answer held them (a checkpoint path is not among them: a
# published checkpoint is readable by every tenant). "target" is retrieve_futures' {sampling_session_id}.
OWNED = frozenset({"session_id", "request_id", "model_id", "run_id", "sampling_session_id", "sampler_id", "target",
                   "push_id", "processor_id", "X-Twinkle-Session-Id"})
# (operation, value) pairs another tenant may read: a run with a published checkpoint (access_scope=accessible).
SHARED = frozenset({("GET /api/v1/training_runs/{run_id}", "run_id")})
# Operations whose answer after a DELETE of the same path is a state, not a resource: use_after_free does not apply.
# GET /native/v1/hub/tokens/{provider} answers {"configured": false} once the token is deleted (test_hub_push).
STATES = frozenset({"GET /native/v1/hub/tokens/{provider}"})
# Searches: another tenant's id is a filter like any other, answered from the caller's own (none match), so the
# answer may succeed but must not hold the value.
SEARCHES = frozenset({"POST /api/v1/sessions/search"})


@dataclass
class StatefulReport(Report):
    scenarios: int = 0
    linked: int = 0  # steps that used a value from an earlier answer
    linked_ok: int = 0  # ... and were answered 2xx
    crossed: Counter[int] = field(default_factory=Counter)  # statuses of steps with another tenant's values
    crossed_ops: Counter[str] = field(default_factory=Counter)  # "operation status" of those
    links: Counter[str] = field(default_factory=Counter)  # link followed -> times
    depth: int = 0  # the longest chain of linked steps (a root step is 1)
    restarts: int = 0  # fresh Hypothesis sessions after a scenario replayed differently
    by_operation: dict[str, Counter[int]] = field(default_factory=dict)  # operation -> its statuses

    def summary(self) -> str:
        head = (f"{self.scenarios} scenarios, {self.cases} steps, statuses {dict(sorted(self.statuses.items()))}, "
                f"{self.linked} linked steps ({self.linked_ok} 2xx) over {len(self.links)} of the links, longest "
                f"chain {self.depth}, other tenant's values: {dict(sorted(self.crossed.items()))}, "
                f"{self.restarts} restarts, {len(self.failures)} failures")
        return "\n".join([head, *self.failures[:40]])


@contextmanager
def _roots_without_incoming_links() -> Iterator[None]:
    """Scenarios start at the entry points: the operations with links out and none in (create_session, the lists,
    ...); everything else is reached through links. schemathesis (4.32.5) picks its own with a dependency analysis
    that reads create_session's free-form `project_id` as a reference to a project nothing creates, so no scenario
    would ever create a session, and that starts them at operations whose ids links bring (create_custom_loss)."""
    def roots(operations: Any, transitions: Any, graph: Any) -> Any:
        found = stateful.RootTransitions()
        found.reliable = {label for label, links in transitions.operations.items()
                          if links.outgoing and not links.incoming}
        return found

    with mock.patch.object(stateful, "classify_root_transitions", roots):
        yield


def _prepare(case: schemathesis.Case, model: str) -> None:
    """Our key, not a generated one; the served model where a positive case names one (no fuzzer guesses it)."""
    if case.headers:
        case.headers = {k: v for k, v in case.headers.items() if k.lower() not in AUTH_HEADERS}
    meta = case.meta
    if case.path_parameters and "model" in case.path_parameters and not (
            meta and meta.is_negative_at(ParameterLocation.PATH)):
        case.path_parameters["model"] = model
    if isinstance(case.body, dict) and isinstance(case.body.get("base_model"), str) and not (
            meta and meta.is_negative_at(ParameterLocation.BODY)):
        case.body["base_model"] = model


def _sent(case: schemathesis.Case, name: str) -> str:
    """The value `case` sent as its parameter or top-level body field `name`."""
    for container in (case.path_parameters, case.query, case.headers, case.body):
        if isinstance(container, dict) and name in container:
            return str(container[name])
    return "<not sent>"


def state_machine(base_url: str, keys: list[str], model: str, report: StatefulReport,
                  seed: int = 19) -> type[APIStateMachine]:
    schema = schemathesis.openapi.from_url(f"{base_url}/openapi.json", timeout=30)
    schema.config.phases.stateful.inference.algorithms = []  # the document's own links, none inferred
    with _roots_without_incoming_links():
        base = schema.as_state_machine()
    rng = random.Random(seed)
    turns = itertools.count()

    class Machine(base):  # type: ignore[valid-type, misc]
        def setup(self) -> None:
            self.home = next(turns) % len(keys)
            self.owner: dict[str, int] = {}  # case id -> the tenant whose values its answer holds
            self.chain: dict[str, int] = {}  # case id -> linked steps up to it
            report.scenarios += 1

        def step(self, input: StepInput) -> StepOutput:
            case = input.case
            tenant = self.home if rng.random() >= SWITCH else (self.home + 1) % len(keys)
            _prepare(case, model)
            headers = {"X-API-Key": keys[tenant]}
            kwargs: dict[str, Any] = {"base_url": base_url, "headers": headers, "timeout": 60}
            response = case.call(**kwargs)
            self.after_call(response, case)  # the recorder: the history the stateful checks read

            parent = input.transition.parent_id if input.transition is not None and input.is_applied else None
            owned = [name for _, name in input.applied_parameters if name in OWNED]
            owner = self.owner.get(parent, tenant) if parent is not None and owned else tenant
            self.owner[case.id] = owner
            self.chain[case.id] = self.chain.get(parent, 0) + 1 if parent is not None else 1
            status = response.status_code
            report.cases += 1
            report.statuses[status] += 1
            report.by_operation.setdefault(case.operation.label, Counter())[status] += 1
            report.depth = max(report.depth, self.chain[case.id])
            if parent is not None and input.transition is not None:
                report.linked += 1
                report.linked_ok += 200 <= status < 300
                report.links[input.transition.id] += 1
            where = f"{case.method} {case.formatted_path} -> {status}: {response.text[:200]}"
            try:
                checks = [c for c in STATEFUL_CHECKS if c is not use_after_free or case.operation.label not in STATES]
                case.validate_response(response, checks=checks, headers=headers, transport_kwargs=kwargs,
                                       recorder=self.recorder)
            except (Failure, FailureGroup) as e:
                for f in e.exceptions if isinstance(e, FailureGroup) else [e]:
                    report.failures.append(f"{f.title}: {where}")
            if owner != tenant:
                report.crossed[status] += 1
                report.crossed_ops[f"{case.operation.label} {status}"] += 1
                label = case.operation.label
                shared = all((label, name) in SHARED for name in owned) or (
                    label in SEARCHES and not any(_sent(case, name) in response.text for name in owned))
                if 200 <= status < 300 and not shared:
                    report.failures.append(f"cross-tenant: tenant {'AB'[tenant]} used {owned} of tenant "
                                           f"{'AB'[owner]}: {where}")
            return StepOutput(response, case)

    return Machine


def fuzz_stateful(base_url: str, keys: list[str], model: str, scenarios: int, steps: int,
                  report: StatefulReport, seed: int = 19) -> None:
    """`scenarios` scenarios of at most `steps` steps each. The server's answers differ between runs (fresh ids,
    jobs done or not yet), so Hypothesis may find a scenario it replays drawing differently (FlakyStrategyDefinition);
    as schemathesis' own runner does, the run then goes on in a fresh session with the next seed (about one in 50
    scenarios here)."""
    machine = state_machine(base_url, keys, model, report)
    for restart in range(20 + scenarios // 10):
        left = scenarios - report.scenarios
        if left <= 0:
            return
        try:
            hypothesis.seed(seed + restart)(machine).run(settings=settings(
                max_examples=left, stateful_step_count=steps, deadline=None, database=None,
                suppress_health_check=list(HealthCheck), phases=[Phase.generate]))
            return
        except Exception as e:
            if not (isinstance(e, FlakyStrategyDefinition) or is_inconsistent_replay(e)):
                raise
            report.restarts += 1
