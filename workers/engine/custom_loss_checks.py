"""The guards the custom-loss interpreter (`workers/engine/custom_loss.py`) runs around every operation.

Each one looks at an operation's arguments before it runs (or at its result after) and raises `CustomLossError`
for what the allowlist alone cannot rule out: result sizes computed from shapes, index values out of range (on
CUDA a device-side assert would break the worker for every tenant), how many pieces a split makes, in-place
device or dtype moves, Python numbers that grow without bound, and results that are not tensors or numbers.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from api_schemas import custom_loss_ops as ops
from workers.engine.errors import UserJobError

_MAX_INT = 2**63
# Ops whose result size depends on tensor VALUES (boolean masks): meta cannot size them, but their result is never
# bigger than their operands, so they run for real and are counted afterwards.
DATA_DEPENDENT = frozenset({"operator.getitem", "torch.masked_select", "masked_select"})
_SCALARS = (bool, int, float)
MAXPIECES = 4096  # tensors one split / chunk / unbind may return (each is a Python object)
PIECES = frozenset({"split", "torch.functional.split", "chunk", "torch.chunk", "unbind", "torch.unbind"})


class CustomLossError(UserJobError):
    """The custom loss failed on this job's data (bad shapes, a budget exceeded, a non-scalar loss, ...)."""


def tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in tensors(v)]
    return []


def data_dependent_bound(target: str, args: list[Any]) -> int | None:
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
    ["add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "neg", "pos", "abs", "invert", "eq", "ne", "lt", "le", "gt", "ge", "and_", "or_", "xor", "expit"])
# With ONE tensor operand: at most two results (values and indices), neither bigger than the operand.
_NOT_BIGGER = frozenset(ops.REDUCTIONS) | frozenset(
    ["float", "double", "half", "bfloat16", "long", "int", "bool", "detach", "clone", "contiguous", "type_as", "to"])


def fast_sizes(target: str, operands: list[Any]) -> list[int] | None:
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


def short(e: Exception) -> str:
    return str(e).splitlines()[0][:300] if str(e) else ""


def flat(value: Any) -> list[Any]:
    if isinstance(value, (list, tuple)):
        return [x for v in value for x in flat(v)]
    if isinstance(value, dict):
        return [x for v in value.values() for x in flat(v)]
    return [value]


def meta(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().to("meta")
    if isinstance(value, list):
        return [meta(v) for v in value]
    if isinstance(value, tuple) and not isinstance(value, torch.Size):
        return tuple(meta(v) for v in value)
    if isinstance(value, dict):
        return {k: meta(v) for k, v in value.items()}
    if isinstance(value, slice):
        return slice(meta(value.start), meta(value.stop), meta(value.step))
    return value


def tensor_attribute(where: str, args: list[Any], kwargs: dict[str, Any]) -> Any:
    if len(args) == 2 and not kwargs and isinstance(args[1], str):
        obj, attr = args
        if isinstance(obj, torch.Tensor) and attr in ops.TENSOR_ATTRIBUTES:
            return getattr(obj, attr)
        # the named tuples of torch.return_types (max, sort, topk, ...): tuples with fixed field names
        if isinstance(obj, tuple) and type(obj).__module__ == "torch.return_types" and attr in ops.RESULT_FIELDS:
            return getattr(obj, attr)
    raise CustomLossError(f"{where}: getattr may only read {sorted(ops.TENSOR_ATTRIBUTES)} of a tensor, or "
                          f"{sorted(ops.RESULT_FIELDS)} of a reduction's result")


def check_pieces(where: str, target: str, args: list[Any], kwargs: dict[str, Any]) -> None:
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
    if count > MAXPIECES:
        raise CustomLossError(f"{where}: {count} pieces; split, chunk and unbind may make at most {MAXPIECES}")


# Positional parameter names of the ops that index with tensor values (the same for a method: `input` is self).
_INDEX_PARAMS = {
    "gather": ("input", "dim", "index"), "index_select": ("input", "dim", "index"),
    "take_along_dim": ("input", "indices", "dim"), "one_hot": ("input", "num_classes"),
    "nll_loss": ("input", "target", "weight", "size_average", "ignore_index"),
    "cross_entropy": ("input", "target", "weight", "size_average", "ignore_index"),
}


def check_indices(where: str, target: str, args: list[Any], kwargs: dict[str, Any]) -> None:
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


def check_to(where: str, args: list[Any], kwargs: dict[str, Any]) -> None:
    """`to` only converts the dtype (a device argument already names the worker's own device)."""
    allowed = (torch.dtype, torch.device, torch.Tensor)
    if any(not isinstance(a, allowed) for a in args) or set(kwargs) - {"dtype", "device"}:
        raise CustomLossError(f"{where}: to() may only take a dtype, a device or a tensor")


def _is_number(v: Any) -> bool:
    return isinstance(v, _SCALARS)


def check_operands(where: str, args: list[Any]) -> None:
    for a in args:
        if not (isinstance(a, torch.Tensor) or _is_number(a)):
            raise CustomLossError(f"{where}: operands must be tensors or numbers, got {type(a).__name__}")


def number_op(where: str, target: str, fn: Callable[..., Any], args: list[Any], kwargs: dict[str, Any]) -> Any:
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
        raise CustomLossError(f"{where}: {type(e).__name__}: {short(e)}") from e
    if isinstance(out, int) and abs(out) > _MAX_INT:
        raise CustomLossError(f"{where}: integer result beyond +-2**63")
    if not _is_number(out):
        raise CustomLossError(f"{where}: unexpected result type {type(out).__name__}")
    return out


def check_getitem(where: str, args: list[Any]) -> None:
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


def check_result(where: str, out: Any) -> Any:
    """Only values a loss computes with may flow on: tensors, numbers, shapes, dtypes, devices and tuples of them."""
    if out is None or isinstance(out, (torch.Tensor, torch.dtype, torch.device, torch.Size, *_SCALARS)):
        return out
    if isinstance(out, (tuple, list)):
        for v in out:
            check_result(where, v)
        return out
    raise CustomLossError(f"{where}: produced a {type(out).__name__}, which a custom loss cannot use")
