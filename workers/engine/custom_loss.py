"""Runs a server-side custom loss: a small interpreter over the checked node list of a `CustomLossProgram`.

The graph came from a stranger. The gateway already checked it against the allowlist
(`api_schemas/tinker/custom_loss.py`); this interpreter trusts nothing of that and checks again at every step:
it calls only functions it resolved itself from the allowlist's names, Python operators only on tensors and
bounded numbers, `getattr` only for the allowlisted tensor attributes, and it computes every tensor operation
first on the meta device (shapes only, no memory) so that no intermediate may exceed `MAX_ELEMENTS` elements and
one job's intermediates together its budget (`total_budget`: in proportion to its tokens): a graph cannot allocate its way out of its budget with a
huge factory, `repeat` or broadcast. Nothing is eval'd, compiled or unpickled. Every failure is the user's
(`CustomLossError`), so it fails only the job that ran the loss.

Semantics follow the SDK's client-side `run_loss_handle`: the loss runs once per datum on (logprobs, *the
loss_fn_inputs it names); the datum losses are SUMMED; metrics `custom/<name>:sum` are summed over datums and
`custom/<name>:mean` averaged. The loss's backward runs here too, down to the logprobs only (`_own_backward`): the
merged step's backward gets the loss's gradient w.r.t. the logprobs, never the tenant's graph.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from api_schemas import custom_loss_ops as ops
from api_schemas.custom_loss import (
    CustomLossProgram,
    ProgramNode,
    check_custom_inputs,
    decode_float,
)
from workers.engine.custom_loss_checks import (
    DATA_DEPENDENT,
    PIECES,
    CustomLossError,
    check_getitem,
    check_indices,
    check_operands,
    check_pieces,
    check_result,
    check_to,
    data_dependent_bound,
    fast_sizes,
    flat,
    meta,
    number_op,
    short,
    tensor_attribute,
    tensors,
)

MAX_ELEMENTS = ops.MAX_ELEMENTS
_DTYPES = {name: getattr(torch, name) for name in ops.DTYPES}


def _resolve(name: str) -> Callable[..., Any]:
    root, *path = name.split(".")
    obj: Any = {"torch": torch, "operator": operator, "math": math}[root]
    for part in path:
        obj = getattr(obj, part)
    assert callable(obj), name
    return obj  # type: ignore[no-any-return]


# Resolved once from the static allowlist (trusted names), never from request data.
# `getattr` is not among them: the interpreter's own _getattr reads only the allowlisted attributes.
FUNCTIONS: dict[str, Callable[..., Any]] = {name: _resolve(name) for name in sorted(ops.FUNCTIONS - {"getattr"})}


@dataclass
class Budget:
    limit: int
    total: int = 0

    def charge(self, where: str, value: Any) -> None:
        self.charge_sizes(where, [t.numel() for t in tensors(value)])

    def charge_sizes(self, where: str, sizes: list[int]) -> None:
        for n in sizes:
            if n > MAX_ELEMENTS:
                raise CustomLossError(f"{where}: a result of {n} elements exceeds the limit of {MAX_ELEMENTS}")
            self.total += n
            if self.total > self.limit:
                raise CustomLossError(
                    f"{where}: the loss's intermediates and backward exceed {self.limit} elements in all (a job's budget: "
                    f"{ops.TOTAL_ELEMENTS_PER_TOKEN} per logprob, at least {ops.MIN_TOTAL_ELEMENTS}); "
                    "use fewer or smaller operations"
                )


class Interpreter:
    """Runs one program on one datum at a time, charging a budget shared by the job's datums."""

    def __init__(self, program: CustomLossProgram, device: torch.device, budget: Budget) -> None:
        self.program = program
        self.device = device
        self.budget = budget

    def run(self, args: list[torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        env: dict[str, Any] = {}
        placeholders = iter(args)
        for node in self.program.nodes:
            try:
                if node.op == "placeholder":
                    env[node.name] = next(placeholders)
                elif node.op == "output":
                    return self._output(node, env)
                else:
                    env[node.name] = self._call(node, env)
            except CustomLossError:
                raise
            except Exception as e:
                raise CustomLossError(f"{self._where(node)}: malformed node ({type(e).__name__})") from e
        raise CustomLossError(f"custom loss {self.program.name!r} has no output node")

    # --- one node ---
    def _where(self, node: ProgramNode) -> str:
        return f"custom loss {self.program.name!r}, node {node.name!r} ({node.target})"

    def _call(self, node: ProgramNode, env: dict[str, Any]) -> Any:
        where = self._where(node)
        args = [self._decode(a, env, where) for a in node.args]
        kwargs = {k: self._decode(v, env, where) for k, v in node.kwargs.items()}
        if any(k in ops.FORBIDDEN_KWARGS and v is not None and v is not False for k, v in kwargs.items()):
            raise CustomLossError(f"{where}: keyword arguments {sorted(ops.FORBIDDEN_KWARGS)} are not allowed")
        position = ops.FORBIDDEN_POSITIONAL.get(node.target) if node.op == "call_function" else None
        if position is not None and len(args) > position and args[position] is not None and args[position] is not False:
            raise CustomLossError(f"{where}: argument {position} (in-place or out) is not allowed")
        if node.op == "call_method":
            if node.target not in ops.METHODS:
                raise CustomLossError(f"{where}: method not allowed")
            self_, *rest = args
            if not isinstance(self_, torch.Tensor):
                raise CustomLossError(f"{where}: methods may only be called on tensors, got {type(self_).__name__}")
            if node.target == "to":
                check_to(where, rest, kwargs)
            fn: Callable[..., Any] = getattr(self_, node.target)
            call_args: list[Any] = rest
        else:
            if node.target == "getattr":
                return tensor_attribute(where, args, kwargs)
            if node.target not in FUNCTIONS:
                raise CustomLossError(f"{where}: function not allowed")
            fn, call_args = FUNCTIONS[node.target], args
            if node.target.startswith("math."):  # numbers only: math on a tensor would leave autograd
                return number_op(where, node.target, fn, args, kwargs)
            if node.target in ops.NUMERIC_OPERATORS:
                if not any(isinstance(a, torch.Tensor) for a in args):
                    return number_op(where, node.target, fn, args, kwargs)
                check_operands(where, args)
            elif node.target == "operator.getitem":
                check_getitem(where, args)
        if node.target in ops.FACTORIES:
            kwargs["device"] = self.device
        if "device" in kwargs:
            kwargs["device"] = self.device
        if node.target in PIECES:
            check_pieces(where, node.target, args, kwargs)
        if node.target in ("torch.diff", "diff"):
            order = kwargs.get("n", args[1] if len(args) > 1 else 1)
            if not (isinstance(order, int) and order <= ops.MAX_DIFF_ORDER):
                raise CustomLossError(f"{where}: diff's n must be an integer, at most {ops.MAX_DIFF_ORDER}")
        tensor_op = any(isinstance(t, torch.Tensor) for t in flat([args, kwargs])) or node.target in ops.FACTORIES
        sized = tensor_op and self._size_check(node, where, fn, call_args, kwargs,
                                               args[0] if node.op == "call_method" else None)
        if tensor_op:
            check_indices(where, node.target, args, kwargs)
        try:
            out = fn(*call_args, **kwargs)
        except Exception as e:
            raise CustomLossError(f"{where}: {type(e).__name__}: {short(e)}") from e
        if tensor_op and not sized:  # a data-dependent op: never bigger than its operands, counted now
            self.budget.charge(where, out)
        if tensor_op and any(t.requires_grad for t in tensors(out)):
            # its backward writes a gradient as big as each operand that needs one (x[0]'s backward writes all of x)
            self.budget.charge_sizes(where, [t.numel() for t in flat([args, kwargs])
                                             if isinstance(t, torch.Tensor) and t.requires_grad])
        return check_result(where, out)

    def _size_check(self, node: ProgramNode, where: str, fn: Callable[..., Any], args: list[Any],
                    kwargs: dict[str, Any], self_: torch.Tensor | None) -> bool:
        """Size the op's result before running it. Elementwise ops and one-tensor reductions and casts are sized
        from their operands' shapes; anything else runs on the meta device first (shapes only, no memory, but
        ~6x the cost of a small op). False: the op's size depends on tensor values (boolean masks)."""
        sizes = fast_sizes(node.target, [self_, *flat([args, kwargs])] if self_ is not None else flat([args, kwargs]))
        if sizes is not None:
            self.budget.charge_sizes(where, sizes)
            return True
        meta_kwargs = {k: meta(v) for k, v in kwargs.items()}
        if node.target in ops.FACTORIES:
            meta_kwargs["device"] = "meta"
        meta_args = [meta(a) for a in args]
        try:
            with torch.no_grad():
                if self_ is not None:
                    out = getattr(meta(self_), node.target)(*meta_args, **meta_kwargs)
                else:
                    out = fn(*meta_args, **meta_kwargs)
        except Exception as e:
            if node.target in DATA_DEPENDENT:
                bound = data_dependent_bound(node.target, [self_, *args] if self_ is not None else args)
                if bound is not None:  # checked now; the real result is counted after the run
                    self.budget.charge_sizes(where, [bound])
                    self.budget.total -= bound
                    return False
            raise CustomLossError(f"{where}: {type(e).__name__}: {short(e)}") from e
        self.budget.charge(where, out)
        return True

    def _decode(self, arg: Any, env: dict[str, Any], where: str) -> Any:
        if arg is None or isinstance(arg, (bool, int, float, str)):
            return arg
        if isinstance(arg, list):
            return [self._decode(a, env, where) for a in arg]
        if not (isinstance(arg, dict) and len(arg) == 1):
            raise CustomLossError(f"{where}: malformed argument")
        (kind, value), = arg.items()
        if kind == "ref":
            if not isinstance(value, str) or value not in env:
                raise CustomLossError(f"{where}: refers to unknown node {str(value)[:80]!r}")
            return env[value]
        if kind == "tuple":
            return tuple(self._decode(a, env, where) for a in value)
        if kind == "dict":
            return {str(k): self._decode(v, env, where) for k, v in value.items()}
        if kind == "slice":
            return slice(*(self._decode(a, env, where) for a in value))
        if kind == "ellipsis":
            return Ellipsis
        if kind == "float":
            return decode_float(value)
        if kind == "device":
            return self.device  # every tensor of the loss lives where the worker runs it
        if kind == "dtype" and isinstance(value, str) and value in _DTYPES:
            return _DTYPES[value]
        if kind == "layout" and isinstance(value, str) and value in ops.LAYOUTS:
            return torch.strided
        raise CustomLossError(f"{where}: argument {{{str(kind)[:40]!r}: ...}} is not an allowed constant")

    def _output(self, node: ProgramNode, env: dict[str, Any]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        where = self._where(node)
        result = self._decode(node.args[0], env, where)
        if not (isinstance(result, (tuple, list)) and len(result) == 2 and isinstance(result[1], dict)):
            raise CustomLossError(f"{where}: the loss must return (loss, metrics)")
        loss, metrics = result
        if not isinstance(loss, torch.Tensor) or loss.ndim != 0 or not loss.dtype.is_floating_point:
            shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
            raise CustomLossError(f"custom loss {self.program.name!r} must return a scalar float loss, got {shape}")
        for key, value in metrics.items():
            if not isinstance(value, torch.Tensor) or value.numel() != 1:
                raise CustomLossError(f"custom loss {self.program.name!r}: metric {key!r} must be a one-element tensor")
        return loss, metrics


@dataclass
class CustomLossResult:
    loss: torch.Tensor  # SUM over datums
    outputs: list[dict[str, torch.Tensor]]
    metrics: dict[str, float]


def total_budget(logprobs: int) -> int:
    """Elements all of a job's intermediates may hold together, for a job of `logprobs` logprobs."""
    return min(max(ops.TOTAL_ELEMENTS_PER_TOKEN * logprobs, ops.MIN_TOTAL_ELEMENTS), ops.MAX_TOTAL_ELEMENTS)


def run_custom_loss(program: CustomLossProgram, logprobs: list[torch.Tensor],
                    inputs: list[dict[str, torch.Tensor]]) -> CustomLossResult:
    """Run `program` once per datum and sum; raise CustomLossError for anything wrong with the loss or its data."""
    if not logprobs or len(logprobs) != len(inputs):
        raise CustomLossError(f"custom loss: {len(logprobs)} logprob tensors for {len(inputs)} datums")
    shapes = [{k: tuple(v.shape) for k, v in d.items()} for d in inputs]
    try:
        check_custom_inputs(program, shapes)
    except ValueError as e:
        raise CustomLossError(str(e)) from e
    budget = Budget(total_budget(sum(lp.numel() for lp in logprobs)))
    interp = Interpreter(program, logprobs[0].device, budget)
    names = [x.name for x in program.inputs[1:]]
    ranks = [x.rank for x in program.inputs[1:]]
    losses: list[torch.Tensor] = []
    sums: dict[str, torch.Tensor] = {}
    for lp, raw in zip(logprobs, inputs):
        args = [lp] + [raw[n].reshape(()) if r == 0 else raw[n] for n, r in zip(names, ranks)]
        loss, metrics = interp.run(args)
        losses.append(loss.to(lp.dtype))
        for key, value in metrics.items():
            v = value.detach().reshape(()).to(torch.float64)
            sums[key] = v if key not in sums else sums[key] + v
    total = torch.stack(losses).sum()
    if any(lp.requires_grad for lp in logprobs):
        total = _own_backward(program, total, logprobs)
    out_metrics = {k: float(v) / (len(logprobs) if k.endswith(":mean") else 1) for k, v in sums.items()}
    out_metrics["loss:sum"] = float(total.detach())
    return CustomLossResult(total, [{"logprobs": lp.detach()} for lp in logprobs], out_metrics)


def _own_backward(program: CustomLossProgram, total: torch.Tensor, logprobs: list[torch.Tensor]) -> torch.Tensor:
    """Run the loss's backward now, down to the logprobs only, and return a loss of the same value whose gradient
    w.r.t. the logprobs is that one (as the SDK's client-side custom loss sends it, as weights).

    The merged step's backward then never runs a tenant's graph: a backward that raises (an op without a
    derivative, such as floor_divide) fails this job alone, as the user's, instead of faulting the pass that every
    merged tenant shares. The loss's intermediates are freed here, not held until the merged backward."""
    trained = [lp for lp in logprobs if lp.requires_grad]
    try:
        grads = torch.autograd.grad(total, trained, allow_unused=True) if total.requires_grad else [None] * len(trained)
    except Exception as e:
        raise CustomLossError(f"custom loss {program.name!r}: its backward failed: {type(e).__name__}: "
                              f"{short(e)}") from e
    return _KnownGradient.apply(total.detach(), list(grads), *trained)  # type: ignore[no-any-return]


class _KnownGradient(torch.autograd.Function):
    """`value`, whose gradient w.r.t. the logprobs is `grads` (times the incoming gradient). No arithmetic on the
    logprobs' values: a masked-out -inf logprob has gradient 0, where lp * grad would make it NaN."""

    @staticmethod
    def forward(ctx: Any, value: torch.Tensor, grads: list[torch.Tensor | None], *logprobs: torch.Tensor) -> torch.Tensor:
        ctx.grads = grads
        return value.clone()

    @staticmethod
    def backward(ctx: Any, out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return (None, None, *(None if g is None else g * out for g in ctx.grads))

