"""The custom-loss interpreter against direct torch (float64, 1e-12), its runtime guards, the static check of
graphs and the allowlist's names (each resolves, and is what torch.fx names that function)."""

from __future__ import annotations

import math
import subprocess
import sys
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from tinker.lib.public_interfaces.custom_loss import encode_graph, trace_loss
from torch.fx.node import _get_qualified_name

from api_schemas import custom_loss_ops as ops
from api_schemas.tinker.custom_loss import (
    CreateCustomLossRequest,
    CustomLossProgram,
    CustomLossRejected,
    check_custom_inputs,
    validate_custom_loss,
)
from workers.engine.custom_loss import FUNCTIONS, CustomLossError, run_custom_loss, total_budget


def dpo(logprobs, ref, chosen, rejected):  # type: ignore[no-untyped-def]
    delta = logprobs - ref
    margin = (delta * chosen).sum() - (delta * rejected).sum()
    loss = -F.logsigmoid(0.5 * margin)
    return loss, {"custom/margin:mean": margin, "custom/dpo:sum": loss.detach()}


def ppo(logprobs, old, adv, scale):  # type: ignore[no-untyped-def]
    ratio = torch.exp(logprobs - old)
    clipped = torch.clamp(ratio, 0.8, 1.2)
    obj = torch.min(ratio * adv, clipped * adv)
    frac = ((ratio - 1.0).abs() > 0.2).float().mean()
    n = logprobs.shape[0]
    return -obj.sum() * scale / n + 1e-3 * torch.where(adv > 0, logprobs, torch.zeros_like(logprobs)).square().sum(), {
        "custom/clipfrac:mean": frac}


def shapes(logprobs, w):  # type: ignore[no-untyped-def]
    n = logprobs.shape[0]
    d = logprobs[1:] - logprobs[:-1]
    both = torch.cat([d, d.flip(0)], dim=0)
    st = torch.stack([logprobs, w], dim=1).transpose(0, 1).reshape(2, n)
    pos = torch.arange(n, dtype=logprobs.dtype, device=logprobs.device) / n
    cum = torch.cumsum(logprobs * w, dim=0).roll(1)
    ones = torch.ones(n, dtype=logprobs.dtype, device=logprobs.device)
    top = torch.topk(logprobs, k=2).values.sum() + logprobs.sort(descending=True)[0][0]
    mx = logprobs.max(dim=0)[0] + torch.amax(w) * 0
    masked = logprobs[w > 0].sum()
    loss = (both.square().mean() + st[0].unsqueeze(0).sum() * 0.1 + (pos * logprobs).sum() + cum.mean()
            + (ones * logprobs).std() + logprobs.var() + logprobs.square().sum().sqrt() + top + mx + masked
            + n ** 0.5)
    return loss, {"custom/masked:sum": masked}


def topk_kl(logprobs, target_probs):  # type: ignore[no-untyped-def]
    """Rank-2 logprobs [T, K]: renormalise over the K candidates, KL to a target distribution."""
    logq = F.log_softmax(logprobs, dim=-1)
    kl = F.kl_div(logq, target_probs, reduction="sum")
    ent = -(logq.exp() * logq).sum(dim=-1).mean()
    lse = torch.logsumexp(logprobs, dim=-1).sum()
    return kl + 0.1 * ent - 0.01 * lse, {"custom/entropy:mean": ent}


RANK1 = {"logprobs": 1}
CASES: dict[str, tuple[Any, dict[str, int]]] = {
    "dpo": (dpo, {**RANK1, "ref": 1, "chosen": 1, "rejected": 1}),
    "ppo": (ppo, {**RANK1, "old": 1, "adv": 1, "scale": 0}),
    "shapes": (shapes, {**RANK1, "w": 1}),
    "topk_kl": (topk_kl, {"logprobs": 2, "target_probs": 2}),
}


def program(fn: Any, ranks: dict[str, int], loss_id: str = "custom-loss-test") -> CustomLossProgram:
    handle = trace_loss(fn, ranks, "session")  # type: ignore[arg-type]
    body = {"session_id": "session", "custom_loss_seq_id": 0, "name": handle.name,
            "inputs": [x.model_dump() for x in handle.inputs], "graph": encode_graph(handle).model_dump(mode="json")}
    return validate_custom_loss(CreateCustomLossRequest.model_validate(body), loss_id)


def _inputs(name: str, gen: torch.Generator, n: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    def r(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    targets = torch.zeros(n, dtype=torch.long)
    if name == "dpo":
        return -r(n).abs(), {"target_tokens": targets, "ref": -r(n).abs(),
                             "chosen": (r(n) > 0).double(), "rejected": (r(n) > 0).double()}
    if name == "ppo":
        return -r(n).abs(), {"target_tokens": targets, "old": -r(n).abs(), "adv": r(n), "scale": r(1).abs()}
    if name == "shapes":
        return -r(n).abs(), {"target_tokens": targets, "w": r(n)}
    k = 3
    return -r(n, k).abs(), {"target_tokens": torch.zeros(n, k, dtype=torch.long),
                            "target_probs": torch.softmax(r(n, k), dim=-1)}


@pytest.mark.parametrize("name", sorted(CASES))
def test_interpreter_matches_direct_torch_in_float64(name: str) -> None:
    fn, ranks = CASES[name]
    prog = program(fn, ranks)
    gen = torch.Generator().manual_seed(hash(name) % 2**31)
    for trial in range(3):
        datums = [_inputs(name, gen, n) for n in (5, 9, 7)[: trial + 1]]
        lps = [lp.clone().requires_grad_() for lp, _ in datums]
        got = run_custom_loss(prog, lps, [x for _, x in datums])
        ref_lps = [lp.clone().requires_grad_() for lp, _ in datums]
        total, sums = torch.zeros((), dtype=torch.float64), {}
        for lp, (_, x) in zip(ref_lps, datums):
            args = [x[i.name].reshape(()) if i.rank == 0 else x[i.name] for i in prog.inputs[1:]]
            loss, metrics = fn(lp, *args)
            total = total + loss
            for k, v in metrics.items():
                sums[k] = sums.get(k, 0.0) + float(v.detach())
        assert abs(got.metrics["loss:sum"] - float(total.detach())) <= 1e-12 * max(1.0, abs(float(total.detach())))
        for k, v in sums.items():
            expect = v / len(datums) if k.endswith(":mean") else v
            assert got.metrics[k] == pytest.approx(expect, rel=1e-12, abs=1e-12), k
        grads = torch.autograd.grad(got.loss, lps)
        expect_grads = torch.autograd.grad(total, ref_lps)
        for g, e in zip(grads, expect_grads):
            assert (g - e).abs().max().item() <= 1e-12 * max(1.0, e.abs().max().item())
        assert [o["logprobs"].shape for o in got.outputs] == [lp.shape for lp in lps]


def _run(fn: Any, ranks: dict[str, int], lps: list[torch.Tensor], extra: list[dict[str, torch.Tensor]] | None = None):  # type: ignore[no-untyped-def]
    inputs = extra or [{"target_tokens": torch.zeros(lp.shape, dtype=torch.long)} for lp in lps]
    return run_custom_loss(program(fn, ranks), lps, inputs)


def test_size_bombs_are_refused_before_allocating() -> None:
    def repeat_bomb(logprobs):  # type: ignore[no-untyped-def]
        return logprobs.repeat(logprobs.shape[0] * 10**6, 10**6).sum(), {}

    def broadcast_bomb(logprobs):  # type: ignore[no-untyped-def]
        x = logprobs.reshape(-1)
        cube = x.reshape(-1, 1, 1) + x.reshape(1, -1, 1) + x.reshape(1, 1, -1)  # T**3
        return cube.sum(), {}

    def factory_bomb(logprobs):  # type: ignore[no-untyped-def]
        n = logprobs.shape[0]
        return torch.zeros((n * 10**5, n * 10**5), device=logprobs.device).sum() + logprobs.sum(), {}

    def expand_bomb(logprobs):  # type: ignore[no-untyped-def]
        return logprobs.expand(10**7, logprobs.shape[0]).exp().sum(), {}

    def many_medium(logprobs):  # type: ignore[no-untyped-def]
        big = logprobs.repeat(4000)  # 4000 * 1000 = 4M elements: under the per-tensor limit
        s = big
        for _ in range(40):  # 40 x 4M = 160M elements in all: over the job's total (16M for 1000 logprobs)
            s = s * 1.0001
        return s.sum(), {}

    def masked_select_bomb(logprobs):  # type: ignore[no-untyped-def]
        row = logprobs.reshape(1, -1).repeat(1, 10)  # (1, 10T)
        mask = (logprobs.reshape(-1, 1).repeat(10, 1) <= 0)  # (10T, 1): broadcasts to (10T, 10T)
        return torch.masked_select(row, mask).sum(), {}

    def double_index(logprobs):  # type: ignore[no-untyped-def]
        idx = torch.zeros_like(logprobs, dtype=torch.long)  # a bool mask and an index tensor together
        m = logprobs.reshape(-1, 1).repeat(1, 4)
        return m[logprobs <= 0, idx[:1]].sum(), {}

    lp = [torch.zeros(1000, requires_grad=True)]
    for fn in (repeat_bomb, broadcast_bomb, factory_bomb, expand_bomb, masked_select_bomb):
        with pytest.raises(CustomLossError, match="exceeds the limit"):
            _run(fn, RANK1, lp)
    with pytest.raises(CustomLossError, match="in all"):
        _run(many_medium, RANK1, lp)
    with pytest.raises(CustomLossError, match="double_index"):
        _run(double_index, RANK1, lp)
    # a job's total grows with its logprobs, between a floor and a ceiling
    assert total_budget(1000) == ops.MIN_TOTAL_ELEMENTS
    assert total_budget(1 << 18) == ops.TOTAL_ELEMENTS_PER_TOKEN << 18
    assert total_budget(1 << 30) == ops.MAX_TOTAL_ELEMENTS


def test_many_pieces_are_refused() -> None:
    def unbind_bomb(logprobs):  # type: ignore[no-untyped-def]
        return logprobs.repeat(100).unbind(0)[0], {}

    def split_bomb(logprobs):  # type: ignore[no-untyped-def]
        return logprobs.repeat(100).split(1)[0].sum(), {}

    def fine(logprobs):  # type: ignore[no-untyped-def]
        halves = logprobs.chunk(2)
        return halves[0].sum() - halves[1].sum() + logprobs.split(50)[3].sum(), {}

    lp = [torch.zeros(1000, requires_grad=True)]
    for fn in (unbind_bomb, split_bomb):
        with pytest.raises(CustomLossError, match="at most 4096"):
            _run(fn, RANK1, lp)
    assert _run(fine, RANK1, lp).metrics["loss:sum"] == 0.0


def test_python_number_arithmetic_is_bounded() -> None:
    def huge_int(logprobs):  # type: ignore[no-untyped-def]
        n = logprobs.shape[0]
        return logprobs.sum() * (n ** 1000000 > 0), {}  # a 1-million-digit integer, if computed as one

    with pytest.raises(CustomLossError, match="OverflowError"):
        _run(huge_int, RANK1, [torch.zeros(7, requires_grad=True)])


def test_handcrafted_operator_abuse_is_refused() -> None:
    prog = program(lambda logprobs: (logprobs.sum(), {}), RANK1)  # type: ignore[arg-type, return-value]
    nodes = [n.model_dump() for n in prog.nodes]

    def with_call(target: str, args: list[Any]) -> CustomLossProgram:
        call = {"op": "call_function", "name": "evil", "target": target, "args": args, "kwargs": {}}
        return CustomLossProgram.model_validate({**prog.model_dump(), "nodes": [nodes[0], call, *nodes[1:]]})

    lp = [torch.zeros(4, requires_grad=True)]
    inputs = [{"target_tokens": torch.zeros(4, dtype=torch.long)}]
    for target, args, match in [
        ("operator.mul", [[0], 10**9], "tensors or numbers"),  # a 10**9-element list
        ("operator.mul", ["x", 10**9], "tensors or numbers"),  # a gigabyte string
        ("operator.getitem", ["abc", 0], "can only index"),
        ("getattr", [{"ref": "logprobs"}, "__class__"], "getattr may only read"),
        ("builtins.eval", ["1"], "not allowed"),
        ("operator.pow", [2, 10**9], None),  # computed as a float: an OverflowError, not a huge int
    ]:
        with pytest.raises(CustomLossError, match=match):
            run_custom_loss(with_call(target, args), lp, inputs)


def test_loss_shape_and_gradient_edge_cases() -> None:
    def vector_loss(logprobs):  # type: ignore[no-untyped-def]
        return logprobs * 2, {}

    def ignores_logprobs(logprobs, w):  # type: ignore[no-untyped-def]
        return w.sum(), {}

    with pytest.raises(CustomLossError, match="scalar"):
        _run(vector_loss, RANK1, [torch.zeros(3, requires_grad=True)])
    lp = torch.zeros(3, requires_grad=True)
    out = _run(ignores_logprobs, {**RANK1, "w": 1}, [lp],
               [{"target_tokens": torch.zeros(3, dtype=torch.long), "w": torch.ones(3)}])
    assert out.loss.requires_grad and out.metrics["loss:sum"] == 3.0  # a zero gradient, not a crash
    with pytest.raises(CustomLossError, match="rank"):
        _run(ignores_logprobs, {**RANK1, "w": 1}, [lp], [{"target_tokens": torch.zeros(3, dtype=torch.long),
                                                          "w": torch.ones(3, 2)}])


def test_masked_infinite_logprobs_keep_a_finite_loss_and_gradient() -> None:
    """A loss that masks out -inf logprobs is finite and so is its gradient (0 there): the loss handed to the
    merged step must not multiply the logprobs by their gradient (-inf * 0 is NaN)."""
    def masked(logprobs):  # type: ignore[no-untyped-def]
        return torch.where(torch.isfinite(logprobs), logprobs, 0.0).sum(), {}

    lp = torch.tensor([-1.0, -math.inf, -2.0], requires_grad=True)
    out = _run(masked, RANK1, [lp])
    assert out.metrics["loss:sum"] == -3.0 and float(out.loss.detach()) == -3.0
    (grad,) = torch.autograd.grad(out.loss, lp)
    assert grad.tolist() == [1.0, 0.0, 1.0]


def test_static_check_of_sdk_graphs() -> None:
    for fn, ranks in CASES.values():
        prog = program(fn, ranks)
        assert prog.nodes[-1].op == "output" and [i.name for i in prog.inputs][0] == "logprobs"
    assert program(dpo, CASES["dpo"][1]).digest() == program(dpo, CASES["dpo"][1], "other-id").digest()
    handle = trace_loss(dpo, CASES["dpo"][1], "s")  # type: ignore[arg-type]
    body = {"session_id": "s", "custom_loss_seq_id": 0, "name": "dpo",
            "inputs": [x.model_dump() for x in handle.inputs], "graph": encode_graph(handle).model_dump(mode="json")}
    swapped = {**body, "inputs": [body["inputs"][0], body["inputs"][2], body["inputs"][1], body["inputs"][3]]}
    with pytest.raises(CustomLossRejected, match="placeholder"):
        validate_custom_loss(CreateCustomLossRequest.model_validate(swapped), "x")
    bad_metric = CreateCustomLossRequest.model_validate(body)
    bad_metric.graph.nodes[-1].args[0]["tuple"][1]["dict"]["loss:sum"] = {"ref": "neg"}
    with pytest.raises(CustomLossRejected, match="custom/<name>"):
        validate_custom_loss(bad_metric, "x")


def test_superlinear_ops_and_too_many_node_runs_are_refused() -> None:
    def nuclear(logprobs):  # type: ignore[no-untyped-def]
        return torch.norm(logprobs.reshape(2, -1), p="nuc"), {}  # an SVD

    def matmul(logprobs):  # type: ignore[no-untyped-def]
        m = logprobs.reshape(2, -1)
        return (m @ m.T).sum(), {}

    for fn, target in ((nuclear, "torch.functional.norm"), (matmul, "operator.matmul")):
        with pytest.raises(CustomLossRejected, match=target):
            program(fn, RANK1)
    prog = program(dpo, CASES["dpo"][1])
    shapes = {"target_tokens": (3,), "ref": (3,), "chosen": (3,), "rejected": (3,)}
    check_custom_inputs(prog, [shapes] * (ops.MAX_NODE_RUNS // len(prog.nodes)))
    with pytest.raises(ValueError, match="node runs per request"):
        check_custom_inputs(prog, [shapes] * (ops.MAX_NODE_RUNS // len(prog.nodes) + 1))


def test_allowlist_names_resolve_and_match_torch_fx_naming() -> None:
    assert set(FUNCTIONS) == ops.FUNCTIONS - {"getattr"}
    for name, fn in FUNCTIONS.items():
        if name.startswith("math."):
            continue
        qualified = _get_qualified_name(fn)
        assert qualified.replace("_operator.", "operator.", 1) == name
    for method in ops.METHODS:
        assert hasattr(torch.Tensor, method) and not method.endswith("_"), method
    names = {n for n in ops.FUNCTIONS | ops.METHODS if not n.startswith("operator.")}
    assert not any(n.endswith("_") or "empty" in n or "rand" in n or "load" in n for n in names)
    assert all(callable(getattr(math, n.split(".")[1])) for n in ops.FUNCTIONS if n.startswith("math."))


def test_gateway_side_modules_do_not_import_torch() -> None:
    code = "import sys, api_schemas.jobs, api_schemas.tinker.custom_loss; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


def test_fuzzed_graphs_are_refused_or_run_but_never_crash() -> None:
    """Random mutations of real graphs: the gateway's check refuses (CustomLossRejected / a pydantic error, both a
    400) or accepts; an accepted graph runs or fails with CustomLossError (category user). Nothing else escapes."""
    import json
    import random

    from pydantic import ValidationError

    rng = random.Random(0)
    junk: list[Any] = [None, True, 0, -1, 2**60, 1.5, "", "x" * 70, "logprobs", "shape", "__class__", [], [[[]]], {},
                       {"ref": []}, {"ref": "logprobs"}, {"float": ["inf"]}, {"dtype": {"a": 1}}, {"slice": [1, 2]},
                       {"tuple": {"a": 1}}, {"dict": []}, {"ellipsis": 1}, {"device": 3}, {"layout": []},
                       {"a": 1, "b": 2}, ["torch.load"], "torch.load", "operator.getitem", "getattr", "sum"]

    def mutate(value: Any) -> Any:
        if isinstance(value, list) and value and rng.random() < 0.7:
            i = rng.randrange(len(value))
            value[i] = mutate(value[i])
            return value
        if isinstance(value, dict) and value and rng.random() < 0.7:
            k = rng.choice(list(value))
            value[k] = mutate(value[k])
            return value
        return json.loads(json.dumps(rng.choice(junk)))

    gen = torch.Generator().manual_seed(0)
    bases = {name: (fn, ranks, trace_loss(fn, ranks, "s")) for name, (fn, ranks) in CASES.items()}  # type: ignore[arg-type]
    accepted = 0
    for trial in range(1500):
        name = rng.choice(sorted(bases))
        fn, ranks, handle = bases[name]
        body = {"session_id": "s", "custom_loss_seq_id": 0, "name": handle.name,
                "inputs": [x.model_dump() for x in handle.inputs],
                "graph": encode_graph(handle).model_dump(mode="json")}
        for _ in range(rng.randint(1, 3)):
            graph = body.get("graph")
            nodes = graph.get("nodes") if isinstance(graph, dict) else None
            mutate(nodes if isinstance(nodes, list) and rng.random() < 0.9 else body)
        try:
            prog = validate_custom_loss(CreateCustomLossRequest.model_validate(body), "custom-loss-fuzz")
        except (CustomLossRejected, ValidationError):
            continue
        accepted += 1
        lp, x = _inputs(name, gen, 6)
        try:
            run_custom_loss(prog, [lp.requires_grad_()], [x])
        except CustomLossError:
            pass
    assert accepted > 50  # the mutations also reach the interpreter


def _handcrafted(calls: list[dict[str, Any]], loss: str) -> tuple[CreateCustomLossRequest, CustomLossProgram]:
    """A graph written by hand (not traced): logprobs, `calls` (op, name, target, args[, kwargs]), output `loss`.
    Returns the upload and the same graph as a program that skipped the gateway's check (the worker trusts none)."""
    nodes = [{"op": "placeholder", "name": "logprobs", "target": "logprobs", "args": [], "kwargs": {}},
             *({"kwargs": {}, **c} for c in calls),
             {"op": "output", "name": "output", "target": "output", "args": [{"tuple": [{"ref": loss}, {"dict": {}}]}],
              "kwargs": {}}]
    body = {"session_id": "s", "custom_loss_seq_id": 0, "name": "handcrafted",
            "inputs": [{"name": "logprobs", "rank": 1}], "graph": {"nodes": nodes}}
    unchecked = CustomLossProgram.model_validate({"loss_id": "custom-loss-x", "name": "handcrafted",
                                                  "inputs": body["inputs"], "nodes": nodes})
    return CreateCustomLossRequest.model_validate(body), unchecked


def _fn(name: str, target: str, *args: Any, **kwargs: Any) -> dict[str, Any]:
    return {"op": "call_function", "name": name, "target": target, "args": list(args), "kwargs": kwargs}


def _method(name: str, target: str, *args: Any, **kwargs: Any) -> dict[str, Any]:
    return {"op": "call_method", "name": name, "target": target, "args": list(args), "kwargs": kwargs}


LP, EXP = {"ref": "logprobs"}, {"ref": "e"}


def test_writes_into_existing_tensors_are_refused() -> None:
    """In-place and out= forms smuggled past the keyword check: F.relu(x, True) and F.silu(x, inplace=True) edit x
    (here a value exp saved for its backward), F.normalize's fifth positional parameter is `out` (here the
    logprobs' own storage, through detach), and repeat_interleave's output_size is trusted by the CUDA kernel (a
    wrong one is a device-side assert, which kills the worker's CUDA context for every tenant)."""
    exp = _fn("e", "torch.exp", LP)
    total = _method("s", "sum", EXP)
    detached = _method("d", "detach", LP)
    cases = [
        [exp, _fn("r", "torch.nn.functional.relu", EXP, True), total],
        [exp, _fn("r", "torch.nn.functional.silu", EXP, inplace=True), total],
        [exp, detached, _fn("r", "torch.nn.functional.normalize", {"ref": "d"}, 2.0, 0, 1e-12, {"ref": "d"}), total],
        [exp, _fn("ones", "torch.ones_like", LP, dtype={"dtype": "int64"}),
         _method("r", "repeat_interleave", EXP, {"ref": "ones"}, 0, output_size=3), _method("s", "sum", {"ref": "r"})],
    ]
    lp = torch.zeros(4, requires_grad=True)
    for calls in cases:
        req, unchecked = _handcrafted(calls, "s")
        with pytest.raises(CustomLossRejected, match="not allowed"):
            validate_custom_loss(req, "custom-loss-x")
        with pytest.raises(CustomLossError, match="not allowed"):
            run_custom_loss(unchecked, [lp], [{"target_tokens": torch.zeros(4, dtype=torch.long)}])
        assert lp.grad is None and bool((lp == 0).all())
    fine, _ = _handcrafted([exp, _fn("r", "torch.nn.functional.relu", EXP, False),
                            _fn("s", "torch.sum", {"ref": "r"})], "s")
    validate_custom_loss(fine, "custom-loss-x")  # fx records the default, inplace=False


def test_indices_out_of_range_are_refused_before_the_op_runs() -> None:
    """On CUDA an index out of range is not an exception but a device-side assert, after which the worker's CUDA
    context is unusable for every tenant: the interpreter checks index values itself before any indexing op runs
    (torch's own CPU error would come too late on a GPU, so the message must be the interpreter's)."""
    def bad(n: int) -> Any:  # an index tensor of value n, computed from the logprobs (so no check can see it)
        return lambda logprobs: (logprobs * 0 + n).long()

    lp2 = lambda logprobs: logprobs.reshape(2, -1)  # noqa: E731
    cases = [
        lambda logprobs: (logprobs.gather(0, bad(4)(logprobs)).sum(), {}),
        lambda logprobs: (torch.take_along_dim(logprobs, bad(-1)(logprobs)).sum(), {}),
        lambda logprobs: (logprobs.index_select(0, bad(9)(logprobs)).sum(), {}),
        lambda logprobs: (logprobs[bad(4)(logprobs)].sum(), {}),
        lambda logprobs: (lp2(logprobs)[1:, bad(-3)(logprobs)[:1]].sum(), {}),
        lambda logprobs: (F.cross_entropy(lp2(logprobs), bad(2)(logprobs)[:2]), {}),
        lambda logprobs: (F.nll_loss(lp2(logprobs), bad(-1)(logprobs)[:2]), {}),
        lambda logprobs: (F.one_hot(bad(5)(logprobs), 5).float().sum() + logprobs.sum(), {}),
        lambda logprobs: (logprobs[..., None][bad(-5)(logprobs), 0].sum(), {}),
        lambda logprobs: (logprobs.reshape(1, -1)[True, bad(2)(logprobs)].sum(), {}),  # True adds a dim, uses none
    ]
    inputs = [{"target_tokens": torch.zeros(4, dtype=torch.long)}]
    for fn in cases:
        with pytest.raises(CustomLossError, match="indices .* must lie in"):
            run_custom_loss(program(fn, RANK1), [torch.zeros(4, requires_grad=True)], inputs)

    for fn in (lambda logprobs: (logprobs[((0, 7),)].sum(), {}), lambda logprobs: (logprobs[[0, 7]].sum(), {})):
        with pytest.raises(CustomLossError, match="not lists or nested tuples"):  # sequences become index tensors
            run_custom_loss(program(fn, RANK1), [torch.zeros(4, requires_grad=True)], inputs)

    def in_range(logprobs):  # type: ignore[no-untyped-def]
        m = logprobs.reshape(2, -1)
        i = (logprobs * 0).long()
        return (logprobs.gather(0, i + 3).sum() + logprobs[i - 4].sum() + m[:, i[:1] - 2].sum()
                + F.cross_entropy(m, i[:2] + 1) + F.nll_loss(m, i[:2] - 100, reduction="sum") + F.one_hot(i, 2).sum()), {}

    out = run_custom_loss(program(in_range, RANK1), [torch.arange(4.0).requires_grad_()], inputs)
    assert math.isfinite(out.metrics["loss:sum"])


def test_sparse_gradients_are_refused() -> None:
    """gather(sparse_grad=True) makes the logprobs' gradient a sparse tensor, which the merged backward through
    the base model does not take."""
    i = _method("i", "long", {"ref": "z"})
    calls = [_method("z", "mul", LP, 0), i, _fn("g", "torch.gather", LP, 0, {"ref": "i"}, sparse_grad=True),
             _method("s", "sum", {"ref": "g"})]
    req, unchecked = _handcrafted(calls, "s")
    with pytest.raises(CustomLossRejected, match="not allowed"):
        validate_custom_loss(req, "custom-loss-x")
    with pytest.raises(CustomLossError, match="not allowed"):
        run_custom_loss(unchecked, [torch.zeros(4, requires_grad=True)], [{"target_tokens": torch.zeros(4, dtype=torch.long)}])


def test_diff_order_is_bounded() -> None:
    """torch.diff(x, n) differences n times: n passes over x (on meta too), charged as one result. An n in the
    thousands costs O(n * len(x)): seconds of the shared step for a loss under every element budget."""
    def constant(logprobs):  # type: ignore[no-untyped-def]
        return torch.diff(logprobs.repeat(50), n=5000).sum(), {}

    def computed(logprobs):  # type: ignore[no-untyped-def]
        return logprobs.repeat(50).diff(logprobs.shape[0] * 1000).sum(), {}

    def fine(logprobs):  # type: ignore[no-untyped-def]
        return torch.diff(logprobs, n=2).sum() + logprobs.diff().sum(), {}

    with pytest.raises(CustomLossRejected, match="diff"):
        program(constant, RANK1)
    lp = [torch.zeros(1000, requires_grad=True)]
    with pytest.raises(CustomLossError, match=f"at most {ops.MAX_DIFF_ORDER}"):
        _run(computed, RANK1, lp)
    assert _run(fine, RANK1, lp).metrics["loss:sum"] == 0.0


def test_backward_cost_is_charged() -> None:
    """x[i:i+1] is a view (no forward cost) but its backward writes a gradient as big as x: each op is charged
    the operands its backward writes, or many slices of one big tensor cost far more than the job's budget."""
    def slices(logprobs):  # type: ignore[no-untyped-def]
        x = logprobs.repeat(4000)  # 4M elements
        s = x[0:1]
        for i in range(1, 20):
            s = s + x[i:i + 1]  # 20 backwards writing 4M each: 80M, over the job's 16M
        return s.sum(), {}

    with pytest.raises(CustomLossError, match="in all"):
        _run(slices, RANK1, [torch.zeros(1000, requires_grad=True)])
    out = _run(slices, RANK1, [torch.zeros(1000)])  # forward only: no backward to pay for
    assert out.metrics["loss:sum"] == 0.0
