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

from api_schemas.tinker import custom_loss_ops as ops
from api_schemas.tinker.custom_loss import (
    CustomLossProgram,
    ProgramNode,
    check_custom_inputs,
    decode_float,
)
from workers.engine.errors import UserJobError

MAX_ELEMENTS = ops.MAX_ELEMENTS
_MAX_INT = 2**63
_DTYPES = {name: getattr(torch, name) for name in ops.DTYPES}
# Ops whose result size depends on tensor VALUES (boolean masks): meta cannot size them, but their result is never
# bigger than their operands, so they run for real and are counted afterwards.
_DATA_DEPENDENT = frozenset({"operator.getitem", "torch.masked_select", "masked_select"})
_SCALARS = (bool, int, float)
MAX_PIECES = 4096  # tensors one split / chunk / unbind may return (each is a Python object)
_PIECES = frozenset({"split", "torch.functional.split", "chunk", "torch.chunk", "unbind", "torch.unbind"})


class CustomLossError(UserJobError):
    """The custom loss failed on this job's data (bad shapes, a budget exceeded, a non-scalar loss, ...)."""


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
        self.charge_sizes(where, [t.numel() for t in _tensors(value)])

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


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors(v)]
    return []


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
            except Exception as e:  # noqa: BLE001 - a malformed node (the gateway checks them; never trust it)
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
                _check_to(where, rest, kwargs)
            fn: Callable[..., Any] = getattr(self_, node.target)
            call_args: list[Any] = rest
        else:
            if node.target == "getattr":
                return _getattr(where, args, kwargs)
            if node.target not in FUNCTIONS:
                raise CustomLossError(f"{where}: function not allowed")
            fn, call_args = FUNCTIONS[node.target], args
            if node.target.startswith("math."):  # numbers only: math on a tensor would leave autograd
                return _number_op(where, node.target, fn, args, kwargs)
            if node.target in ops.NUMERIC_OPERATORS:
                if not any(isinstance(a, torch.Tensor) for a in args):
                    return _number_op(where, node.target, fn, args, kwargs)
                _check_operands(where, args)
            elif node.target == "operator.getitem":
                _check_getitem(where, args)
        if node.target in ops.FACTORIES:
            kwargs["device"] = self.device
        if "device" in kwargs:
            kwargs["device"] = self.device
        if node.target in _PIECES:
            _check_pieces(where, node.target, args, kwargs)
        if node.target in ("torch.diff", "diff"):
            order = kwargs.get("n", args[1] if len(args) > 1 else 1)
            if not (isinstance(order, int) and order <= ops.MAX_DIFF_ORDER):
                raise CustomLossError(f"{where}: diff's n must be an integer, at most {ops.MAX_DIFF_ORDER}")
        tensor_op = any(isinstance(t, torch.Tensor) for t in _flat([args, kwargs])) or node.target in ops.FACTORIES
        sized = tensor_op and self._size_check(node, where, fn, call_args, kwargs,
                                               args[0] if node.op == "call_method" else None)
        if tensor_op:
            _check_indices(where, node.target, args, kwargs)
        try:
            out = fn(*call_args, **kwargs)
        except Exception as e:
            raise CustomLossError(f"{where}: {type(e).__name__}: {_short(e)}") from e
        if tensor_op and not sized:  # a data-dependent op: never bigger than its operands, counted now
            self.budget.charge(where, out)
        if tensor_op and any(t.requires_grad for t in _tensors(out)):
            # its backward writes a gradient as big as each operand that needs one (x[0]'s backward writes all of x)
            self.budget.charge_sizes(where, [t.numel() for t in _flat([args, kwargs])
                                             if isinstance(t, torch.Tensor) and t.requires_grad])
        return _check_result(where, out)

    def _size_check(self, node: ProgramNode, where: str, fn: Callable[..., Any], args: list[Any],
                    kwargs: dict[str, Any], self_: torch.Tensor | None) -> bool:
        """Size the op's result before running it. Elementwise ops and one-tensor reductions and casts are sized
        from their operands' shapes; anything else runs on the meta device first (shapes only, no memory, but
        ~6x the cost of a small op). False: the op's size depends on tensor values (boolean masks)."""
        sizes = _fast_sizes(node.target, [self_, *_flat([args, kwargs])] if self_ is not None else _flat([args, kwargs]))
        if sizes is not None:
            self.budget.charge_sizes(where, sizes)
            return True
        meta_kwargs = {k: _meta(v) for k, v in kwargs.items()}
        if node.target in ops.FACTORIES:
            meta_kwargs["device"] = "meta"
        meta_args = [_meta(a) for a in args]
        try:
            with torch.no_grad():
                if self_ is not None:
                    out = getattr(_meta(self_), node.target)(*meta_args, **meta_kwargs)
                else:
                    out = fn(*meta_args, **meta_kwargs)
        except Exception as e:
            if node.target in _DATA_DEPENDENT:
                bound = _data_dependent_bound(node.target, [self_, *args] if self_ is not None else args)
                if bound is not None:  # checked now; the real result is counted after the run
                    self.budget.charge_sizes(where, [bound])
                    self.budget.total -= bound
                    return False
            raise CustomLossError(f"{where}: {type(e).__name__}: {_short(e)}") from e
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


def _data_dependent_bound(target: str, args: list[Any]) -> int | None:
    """An upper bound of the result size of a boolean-mask selection, from shapes only; None: not such a one."""
    if target == "operator.getitem" and len(args) == 2 and isinstance(args[0], torch.Tensor):
        index = args[1] if isinstance(args[1], tuple) else (args[1],)
        tensors = [i for i in index if isinstance(i, torch.Tensor)]
        plain = all(i is None or i is Ellipsis or isinstance(i, (int, slice, torch.Tensor)) for i in index)
        if plain and len(tensors) == 1 and tensors[0].dtype == torch.bool:
            return args[0].numel()  # x[mask]: a subset of x's elements
        return None
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    if target in ("torch.masked_select", "masked_select") and len(tensors) == 2:
        try:
            return math.prod(torch.broadcast_shapes(*(t.shape for t in tensors)))
        except RuntimeError:
            return None
    return None


def _bare(target: str) -> str:
    return target.removeprefix("torch.").removeprefix("operator.").removeprefix("torch._C._special.special_")


# Result = the broadcast of the tensor operands (numbers broadcast trivially).
_BROADCAST = frozenset(ops.ELEMENTWISE) | frozenset(
    "add sub mul truediv floordiv mod pow neg pos abs invert eq ne lt le gt ge and_ or_ xor expit".split())
# With ONE tensor operand: at most two results (values and indices), neither bigger than the operand.
_NOT_BIGGER = frozenset(ops.REDUCTIONS) | frozenset(
    "float double half bfloat16 long int bool detach clone contiguous type_as to".split())


def _fast_sizes(target: str, operands: list[Any]) -> list[int] | None:
    """Upper bounds of the result sizes of `target` from its operands' shapes alone, or None (ask meta)."""
    tensors = [t for t in operands if isinstance(t, torch.Tensor)]
    name = _bare(target)
    if name in _BROADCAST and tensors and not (name == "where" and len(tensors) == 1):
        try:
            return [math.prod(torch.broadcast_shapes(*(t.shape for t in tensors)))]
        except RuntimeError:
            return None  # meta (or the real op) reports the mismatch
    if name in _NOT_BIGGER and len(tensors) == 1 and (name != "type_as"):
        return [tensors[0].numel()] * 2
    return None


def _short(e: Exception) -> str:
    return str(e).splitlines()[0][:300] if str(e) else ""


def _flat(value: Any) -> list[Any]:
    if isinstance(value, (list, tuple)):
        return [x for v in value for x in _flat(v)]
    if isinstance(value, dict):
        return [x for v in value.values() for x in _flat(v)]
    return [value]


def _meta(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().to("meta")
    if isinstance(value, list):
        return [_meta(v) for v in value]
    if isinstance(value, tuple) and not isinstance(value, torch.Size):
        return tuple(_meta(v) for v in value)
    if isinstance(value, dict):
        return {k: _meta(v) for k, v in value.items()}
    if isinstance(value, slice):
        return slice(_meta(value.start), _meta(value.stop), _meta(value.step))
    return value


def _getattr(where: str, args: list[Any], kwargs: dict[str, Any]) -> Any:
    if len(args) == 2 and not kwargs and isinstance(args[1], str):
        obj, attr = args
        if isinstance(obj, torch.Tensor) and attr in ops.TENSOR_ATTRIBUTES:
            return getattr(obj, attr)
        # the named tuples of torch.return_types (max, sort, topk, ...): tuples with fixed field names
        if isinstance(obj, tuple) and type(obj).__module__ == "torch.return_types" and attr in ops.RESULT_FIELDS:
            return getattr(obj, attr)
    raise CustomLossError(f"{where}: getattr may only read {sorted(ops.TENSOR_ATTRIBUTES)} of a tensor, or "
                          f"{sorted(ops.RESULT_FIELDS)} of a reduction's result")


def _check_pieces(where: str, target: str, args: list[Any], kwargs: dict[str, Any]) -> None:
    """split / chunk / unbind return one tensor per piece: bound their number before making them (on meta too)."""
    x, *rest = args
    if not isinstance(x, torch.Tensor):
        return  # torch itself refuses
    kind = target.rsplit(".", 1)[-1]
    dim = kwargs.get("dim", rest[0] if kind == "unbind" and rest else rest[1] if kind != "unbind" and len(rest) > 1 else 0)
    try:
        length = x.shape[dim] if isinstance(dim, int) else x.numel()
    except IndexError:
        return  # torch itself refuses
    if kind == "unbind":
        count = length
    elif kind == "chunk":
        chunks = kwargs.get("chunks", rest[0] if rest else 1)
        count = min(chunks, length) if isinstance(chunks, int) else length
    else:
        size = kwargs.get("split_size_or_sections", kwargs.get("split_size", rest[0] if rest else None))
        count = len(size) if isinstance(size, (list, tuple)) else -(-length // size) if isinstance(size, int) and size > 0 else 0
    if count > MAX_PIECES:
        raise CustomLossError(f"{where}: {count} pieces; split, chunk and unbind may make at most {MAX_PIECES}")


# Positional parameter names of the ops that index with tensor values (the same for a method: `input` is self).
_INDEX_PARAMS = {
    "gather": ("input", "dim", "index"), "index_select": ("input", "dim", "index"),
    "take_along_dim": ("input", "indices", "dim"), "one_hot": ("input", "num_classes"),
    "nll_loss": ("input", "target", "weight", "size_average", "ignore_index"),
    "cross_entropy": ("input", "target", "weight", "size_average", "ignore_index"),
}


def _check_indices(where: str, target: str, args: list[Any], kwargs: dict[str, Any]) -> None:
    """Index values must be in range BEFORE an indexing op runs: on CUDA an index out of range is not an
    exception but a device-side assert, after which the worker's CUDA context is unusable for every tenant.
    One host sync per index tensor. (Shapes, dims and index dtypes are checked by torch on the host.)"""
    name = target.rsplit(".", 1)[-1]
    checks: list[tuple[Any, int, int | None, int | None]] = []  # (index, low, high or None, also allowed)
    if target == "operator.getitem":
        if len(args) == 2 and isinstance(args[0], torch.Tensor):
            checks = _getitem_checks(where, args[0], args[1])
    elif name in _INDEX_PARAMS:
        names = _INDEX_PARAMS[name]

        def param(key: str, default: Any = None) -> Any:
            i = names.index(key)
            return args[i] if len(args) > i else kwargs.get(key, default)

        x = param("input")
        if not isinstance(x, torch.Tensor):
            return
        if name == "one_hot":
            classes = param("num_classes", -1)
            checks = [(x, 0, classes if isinstance(classes, int) and classes >= 0 else None, None)]
        elif name in ("nll_loss", "cross_entropy"):
            ignore = param("ignore_index", -100)
            classes = x.shape[1] if x.ndim >= 2 else x.shape[0] if x.ndim == 1 else 1
            checks = [(param("target"), 0, classes, ignore if isinstance(ignore, int) else None)]
        else:
            dim, index = param("dim"), param("indices" if name == "take_along_dim" else "index")
            if dim is None and name == "take_along_dim":
                size = x.numel()
            elif isinstance(dim, int) and -max(x.ndim, 1) <= dim < max(x.ndim, 1):
                size = x.shape[dim] if x.ndim else 1
            else:
                return  # torch refuses the dim on the host
            checks = [(index, 0, size, None)]
    for index, low, high, also in checks:
        if not isinstance(index, torch.Tensor) or index.dtype.is_floating_point or index.dtype.is_complex \
                or index.dtype in (torch.bool, torch.uint8) or index.numel() == 0:
            continue  # masks, float "targets" (probabilities) and empty indices index nothing
        bad = index < low if high is None else (index < low) | (index >= high)
        if also is not None:
            bad &= index != also
        if bool(bad.any()):
            span = f"[{low}, {high})" if high is not None else f"[{low}, ...)"
            extra = f" (or {also})" if also is not None else ""
            raise CustomLossError(f"{where}: index out of range: the indices here must lie in {span}{extra}")


def _getitem_checks(where: str, x: torch.Tensor, index: Any) -> list[tuple[Any, int, int | None, int | None]]:
    """x[index]: each integer index tensor against the size of the dim it indexes."""
    items = index if isinstance(index, tuple) else (index,)
    if not all(i is None or i is Ellipsis or isinstance(i, (int, slice, torch.Tensor)) for i in items):
        raise CustomLossError(f"{where}: a tensor index is made of ints, slices, None, ... and tensors "
                              "(not lists or nested tuples, which torch turns into index tensors)")
    # True/False and boolean masks index ndim dims (0 for a Python bool), None and ... none of their own
    masks = [i for i in items if isinstance(i, bool) or isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8)]
    consumed = sum(getattr(m, "ndim", 0) for m in masks) + sum(
        1 for i in items if i is not None and i is not Ellipsis and not any(i is m for m in masks))
    if sum(1 for i in items if i is Ellipsis) > 1:
        return []  # torch refuses it on the host
    checks: list[tuple[Any, int, int | None, int | None]] = []
    dim = 0
    for i in items:
        if i is Ellipsis:
            dim += max(x.ndim - consumed, 0)
        elif i is None:
            continue
        elif any(i is m for m in masks):
            dim += getattr(i, "ndim", 0)
        else:
            if isinstance(i, torch.Tensor) and dim < x.ndim:
                checks.append((i, -x.shape[dim], x.shape[dim], None))
            dim += 1
    return checks


def _check_to(where: str, args: list[Any], kwargs: dict[str, Any]) -> None:
    """`to` only converts the dtype (a device argument already names the worker's own device)."""
    allowed = (torch.dtype, torch.device, torch.Tensor)
    if any(not isinstance(a, allowed) for a in args) or set(kwargs) - {"dtype", "device"}:
        raise CustomLossError(f"{where}: to() may only take a dtype, a device or a tensor")


def _is_number(v: Any) -> bool:
    return isinstance(v, _SCALARS)


def _check_operands(where: str, args: list[Any]) -> None:
    for a in args:
        if not (isinstance(a, torch.Tensor) or _is_number(a)):
            raise CustomLossError(f"{where}: operands must be tensors or numbers, got {type(a).__name__}")


def _number_op(where: str, target: str, fn: Callable[..., Any], args: list[Any], kwargs: dict[str, Any]) -> Any:
    """Python arithmetic on numbers (e.g. on a tensor's shape), bounded: no unbounded integers, no strings."""
    if kwargs or not all(_is_number(a) for a in args):
        raise CustomLossError(f"{where}: operands must be tensors or numbers")
    if target == "operator.pow" and all(isinstance(a, int) for a in args):
        base, exp = args
        if exp > 64 or abs(base) > 2**32:
            args = [float(base), float(exp)]
    try:
        out = fn(*args)
    except (ArithmeticError, ValueError) as e:
        raise CustomLossError(f"{where}: {type(e).__name__}: {_short(e)}") from e
    if isinstance(out, int) and abs(out) > _MAX_INT:
        raise CustomLossError(f"{where}: integer result beyond +-2**63")
    if not _is_number(out):
        raise CustomLossError(f"{where}: unexpected result type {type(out).__name__}")
    return out


def _check_getitem(where: str, args: list[Any]) -> None:
    if len(args) != 2:
        raise CustomLossError(f"{where}: getitem takes a container and an index")
    container, index = args
    if isinstance(container, torch.Tensor):
        return  # tensor indexing; its size is checked like every tensor op
    if not isinstance(container, (tuple, list, torch.Size)):
        raise CustomLossError(f"{where}: can only index tensors, shapes and tuples, got {type(container).__name__}")
    if not (isinstance(index, int) or (isinstance(index, slice) and all(
            v is None or isinstance(v, int) for v in (index.start, index.stop, index.step)))):
        raise CustomLossError(f"{where}: a shape or tuple takes an integer or slice index")


def _check_result(where: str, out: Any) -> Any:
    """Only values a loss computes with may flow on: tensors, numbers, shapes, dtypes, devices and tuples of them."""
    if out is None or isinstance(out, (torch.Tensor, torch.dtype, torch.device, torch.Size, *_SCALARS)):
        return out
    if isinstance(out, (tuple, list)):
        for v in out:
            _check_result(where, v)
        return out
    raise CustomLossError(f"{where}: produced a {type(out).__name__}, which a custom loss cannot use")


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
    except Exception as e:  # noqa: BLE001 - anything the loss's own backward raises is the loss's fault
        raise CustomLossError(f"custom loss {program.name!r}: its backward failed: {type(e).__name__}: "
                              f"{_short(e)}") from e
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

