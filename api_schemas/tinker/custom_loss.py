"""Server-side custom losses (SDK 0.38 `ServiceClient.create_custom_loss`): the wire types, the static check of an
uploaded graph, and the check of a forward_backward's inputs against the loss. Pure (no torch).

An uploaded graph is untrusted data from strangers. It is never imported, unpickled, eval'd or compiled: the
gateway checks every node against the allowlist in `custom_loss_ops.py` and stores the result as a frozen
`CustomLossProgram`; the worker walks its node list with a small interpreter (`workers/engine/custom_loss.py`)
that calls only allowlisted functions and checks each result's size before allocating it.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from collections.abc import Set
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from api_schemas import custom_loss_ops as ops
from api_schemas.custom_loss import (  # noqa: F401 - re-exported: the Tinker upload builds these
    _FLOATS,
    CustomLossInput,
    CustomLossProgram,
    ProgramNode,
    check_custom_inputs,
    decode_float,
)

__all__ = [
    "CreateCustomLossRequest",
    "CreateCustomLossResponse",
    "CustomLossInput",
    "CustomLossNode",
    "CustomLossProgram",
    "CustomLossRejected",
    "check_custom_inputs",
    "validate_custom_loss",
]

MAX_INPUTS = 16  # the SDK's limit, logprobs included
MAX_NODES = 512
MAX_METRICS = 64
MAX_NAME_CHARS = 128
MAX_STRING_CHARS = 64
MAX_ARG_DEPTH = 6
MAX_ARG_LEAVES = 256  # constants and refs in one node's args + kwargs
MAX_INT = 2**53
MAX_REQUEST_BYTES = 512 * 1024

INPUT_NAME = re.compile(r"[a-z_][a-z0-9_]{0,63}")
NODE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,127}")
METRIC_KEY = re.compile(r"custom/[a-z0-9_./-]{1,64}:(sum|mean)")
_CONSTANT_KINDS = {"dtype": ops.DTYPES, "layout": ops.LAYOUTS}


class _Tolerant(BaseModel):
    model_config = ConfigDict(extra="ignore")


class CustomLossNode(_Tolerant):
    op: str
    name: str
    target: str
    args: list[Any] = Field(default_factory=list)
    kwargs: dict[str, Any] = Field(default_factory=dict)


class CustomLossGraph(_Tolerant):
    format: Literal[1] = 1
    nodes: list[CustomLossNode]


class CreateCustomLossRequest(_Tolerant):
    session_id: str
    custom_loss_seq_id: int = Field(ge=0, lt=2**31)  # an SQL INTEGER (32 bits in Postgres)
    name: str
    inputs: list[CustomLossInput]
    graph: CustomLossGraph


class CreateCustomLossResponse(BaseModel):
    loss_id: str
    type: Literal["create_custom_loss"] = "create_custom_loss"


class CustomLossRejected(ValueError):
    """The graph does something a custom loss may not; the message names the node and its target."""

    def __init__(self, reason: str, node: CustomLossNode | None = None) -> None:
        where = f"node {node.name[:MAX_NAME_CHARS]!r} ({node.op} {node.target[:MAX_NAME_CHARS]!r}): " if node else ""
        super().__init__(f"custom loss rejected: {where}{reason}")
        self.node = node.name if node else None
        self.target = node.target if node else None


def validate_custom_loss(req: CreateCustomLossRequest, loss_id: str) -> CustomLossProgram:
    """Check an uploaded loss against the allowlist; raise CustomLossRejected naming the first offending node."""
    if not (0 < len(req.name) <= MAX_NAME_CHARS):
        raise CustomLossRejected(f"the loss name must have 1 to {MAX_NAME_CHARS} characters")
    _check_inputs(req.inputs)
    nodes = req.graph.nodes
    if len(nodes) > MAX_NODES:
        raise CustomLossRejected(f"the graph has {len(nodes)} nodes; a custom loss may have at most {MAX_NODES}")
    seen: set[str] = set()
    checked: list[ProgramNode] = []
    for i, node in enumerate(nodes):
        if not NODE_NAME.fullmatch(node.name):
            raise CustomLossRejected("node names are identifiers of at most 128 characters", node)
        if node.name in seen:
            raise CustomLossRejected("a node name is used twice", node)
        if len(node.target) > MAX_NAME_CHARS:
            raise CustomLossRejected("target name too long", node)
        if i < len(req.inputs):
            _check_placeholder(node, req.inputs[i])
        elif node.op == "placeholder":
            raise CustomLossRejected(f"the graph takes more than the {len(req.inputs)} declared inputs", node)
        elif i == len(nodes) - 1:
            _check_output(node, seen)
        else:
            _check_call(node, seen)
        seen.add(node.name)
        checked.append(ProgramNode(op=node.op, name=node.name, target=node.target, args=node.args,  # type: ignore[arg-type]
                                   kwargs=node.kwargs))
    if len(nodes) <= len(req.inputs):
        raise CustomLossRejected("the graph has no output node")
    return CustomLossProgram(loss_id=loss_id, name=req.name, inputs=list(req.inputs), nodes=checked)


def _check_inputs(inputs: Sequence[CustomLossInput]) -> None:
    if not inputs or inputs[0].name != "logprobs" or inputs[0].rank not in (1, 2):
        raise CustomLossRejected("the first input must be logprobs, of rank 1 ([T]) or 2 ([T, K])")
    if len(inputs) > MAX_INPUTS:
        raise CustomLossRejected(f"{len(inputs)} inputs; a custom loss takes at most {MAX_INPUTS}, logprobs included")
    names = [x.name for x in inputs]
    for name in names:
        if not INPUT_NAME.fullmatch(name):
            raise CustomLossRejected(f"input name {name[:80]!r} must be lowercase letters, digits and underscores")
    if len(set(names)) != len(names):
        raise CustomLossRejected("an input name is used twice")


def _check_placeholder(node: CustomLossNode, declared: CustomLossInput) -> None:
    if node.op != "placeholder":
        raise CustomLossRejected(f"expected the placeholder of input {declared.name!r} here", node)
    if node.name != declared.name or node.target != declared.name or node.args or node.kwargs:
        raise CustomLossRejected(f"placeholder must be input {declared.name!r}, with no arguments", node)


def _check_output(node: CustomLossNode, seen: set[str]) -> None:
    if node.op != "output" or node.target != "output" or node.kwargs or len(node.args) != 1:
        raise CustomLossRejected("the last node must be the output, returning (loss, metrics)", node)
    result = node.args[0]
    pair = result.get("tuple") if isinstance(result, dict) and len(result) == 1 else result
    if not (isinstance(pair, list) and len(pair) == 2):
        raise CustomLossRejected("the loss must return (loss, metrics)", node)
    loss, metrics = pair
    if not _is_ref(loss, seen):
        raise CustomLossRejected("the loss must be a tensor computed by the graph", node)
    if not (isinstance(metrics, dict) and set(metrics) == {"dict"} and isinstance(metrics["dict"], dict)):
        raise CustomLossRejected("metrics must be a dict of tensors", node)
    if len(metrics["dict"]) > MAX_METRICS:
        raise CustomLossRejected(f"at most {MAX_METRICS} metrics", node)
    for key, value in metrics["dict"].items():
        if not METRIC_KEY.fullmatch(key):
            raise CustomLossRejected(f"metric {key[:80]!r} must be named custom/<name>:sum or custom/<name>:mean", node)
        if not _is_ref(value, seen):
            raise CustomLossRejected(f"metric {key!r} must be a tensor computed by the graph", node)


def _is_ref(value: Any, seen: set[str]) -> bool:
    return isinstance(value, dict) and set(value) == {"ref"} and _has(seen, value["ref"])


def _has(names: Set[str], value: Any) -> bool:
    """`value in names` for untrusted JSON: a list or dict is never a member (and must not raise TypeError)."""
    return isinstance(value, str) and value in names


def _check_call(node: CustomLossNode, seen: set[str]) -> None:
    if node.op == "call_function":
        if node.target not in ops.FUNCTIONS:
            raise CustomLossRejected("this function is not allowed in a custom loss (pure torch tensor math only)", node)
    elif node.op == "call_method":
        if node.target not in ops.METHODS:
            raise CustomLossRejected("this tensor method is not allowed in a custom loss", node)
        if not node.args or not _is_ref(node.args[0], seen):
            raise CustomLossRejected("a method call needs a tensor computed by the graph as its first argument", node)
    elif node.op == "output":
        raise CustomLossRejected("the output must be the last node", node)
    else:
        raise CustomLossRejected(f"{node.op!r} nodes are not allowed (only placeholders, calls and the output)", node)
    if node.target == "getattr":
        if len(node.args) != 2 or node.kwargs or not _is_ref(node.args[0], seen) or not _has(ops.ATTRIBUTES, node.args[1]):
            raise CustomLossRejected(f"getattr may only read {sorted(ops.ATTRIBUTES)} of a tensor", node)
    position = ops.FORBIDDEN_POSITIONAL.get(node.target)
    if position is not None and len(node.args) > position and node.args[position] is not None \
            and node.args[position] is not False:
        raise CustomLossRejected(f"argument {position} (in-place or out) is not allowed", node)
    if node.target in ("torch.diff", "diff"):
        order = node.kwargs.get("n", node.args[1] if len(node.args) > 1 else 1)
        if isinstance(order, int) and order > ops.MAX_DIFF_ORDER:
            raise CustomLossRejected(f"diff of order {order}; at most {ops.MAX_DIFF_ORDER}", node)
    for key in node.kwargs:
        if not NODE_NAME.fullmatch(key):
            raise CustomLossRejected("keyword names must be identifiers", node)
        value = node.kwargs[key]
        if key in ops.FORBIDDEN_KWARGS and value is not None and value is not False:  # fx records defaults
            raise CustomLossRejected(f"keyword argument {key!r} is not allowed", node)
    leaves = [0]
    for arg in [*node.args, *node.kwargs.values()]:
        _check_arg(node, arg, seen, 0, leaves)
    if node.target in ops.FACTORIES:
        _check_constant_size(node)


def _check_constant_size(node: CustomLossNode) -> None:
    """A factory with a constant size (torch.ones(10**9)) is refused here; a size computed from the inputs is
    checked by the worker before it allocates."""
    if node.target.endswith("_like"):
        return  # the size of an existing tensor
    args = node.args[1:] if node.op == "call_method" else node.args
    if node.target == "torch.arange":
        nums = [a for a in args if isinstance(a, (int, float)) and not isinstance(a, bool)]
        if len(nums) == len(args) and 1 <= len(nums) <= 3:
            start, end, step = (0, nums[0], 1) if len(nums) == 1 else (*nums[:2], nums[2] if len(nums) == 3 else 1)
            if step and (end - start) / step > ops.MAX_ELEMENTS:
                raise CustomLossRejected(f"torch.arange of more than {ops.MAX_ELEMENTS} elements", node)
        return
    if node.target in ("torch.linspace",):
        steps = node.kwargs.get("steps", args[2] if len(args) > 2 else None)
        if isinstance(steps, int) and steps > ops.MAX_ELEMENTS:
            raise CustomLossRejected(f"torch.linspace of more than {ops.MAX_ELEMENTS} elements", node)
        return
    size: Any = node.kwargs.get("size")
    if size is None:
        if node.target in ("torch.full", "new_full"):
            size = args[0] if args else None
        else:
            size = args[0] if len(args) == 1 and isinstance(args[0], list) else args
    if isinstance(size, dict) and set(size) == {"tuple"}:
        size = size["tuple"]
    if isinstance(size, list) and size and all(isinstance(d, int) and not isinstance(d, bool) for d in size):
        numel = 1
        for d in size:
            numel *= max(d, 0)
        if numel > ops.MAX_ELEMENTS:
            raise CustomLossRejected(f"a tensor of {numel} elements; the limit is {ops.MAX_ELEMENTS}", node)


def _check_arg(node: CustomLossNode, arg: Any, seen: set[str], depth: int, leaves: list[int]) -> None:
    leaves[0] += 1
    if leaves[0] > MAX_ARG_LEAVES or depth > MAX_ARG_DEPTH:
        raise CustomLossRejected("arguments are too large or too deeply nested", node)
    if arg is None or isinstance(arg, bool):
        return
    if isinstance(arg, int):
        if abs(arg) > MAX_INT:
            raise CustomLossRejected("integer constant beyond +-2**53", node)
        return
    if isinstance(arg, float):
        if not math.isfinite(arg):
            raise CustomLossRejected("non-finite numbers are sent as {\"float\": ...}", node)
        return
    if isinstance(arg, str):
        if len(arg) > MAX_STRING_CHARS:
            raise CustomLossRejected(f"string constant longer than {MAX_STRING_CHARS} characters", node)
        return
    if isinstance(arg, list):
        for a in arg:
            _check_arg(node, a, seen, depth + 1, leaves)
        return
    if not (isinstance(arg, dict) and len(arg) == 1):
        raise CustomLossRejected(f"unknown argument encoding {type(arg).__name__}", node)
    (kind, value), = arg.items()
    if kind == "ref":
        if not _has(seen, value):
            raise CustomLossRejected(f"argument refers to {str(value)[:80]!r}, which is not an earlier node", node)
    elif kind == "tuple" and isinstance(value, list):
        for a in value:
            _check_arg(node, a, seen, depth + 1, leaves)
    elif kind == "dict" and isinstance(value, dict):
        for key, a in value.items():
            if len(key) > MAX_STRING_CHARS:
                raise CustomLossRejected("dict key too long", node)
            _check_arg(node, a, seen, depth + 1, leaves)
    elif kind == "slice" and isinstance(value, list) and len(value) == 3:
        for a in value:
            if a is not None and not _is_ref(a, seen) and not (isinstance(a, int) and not isinstance(a, bool)):
                raise CustomLossRejected("slice bounds must be integers, None or graph values", node)
            _check_arg(node, a, seen, depth + 1, leaves)
    elif kind == "ellipsis" and value is True or kind == "float" and _has(_FLOATS.keys(), value):
        pass
    elif kind == "device" and isinstance(value, str) and len(value) <= MAX_STRING_CHARS:
        pass  # any device names where the worker runs: the worker puts every tensor on its own device
    elif kind in _CONSTANT_KINDS and _has(_CONSTANT_KINDS[kind], value):
        pass
    else:
        raise CustomLossRejected(f"argument {{{kind[:40]!r}: ...}} is not an allowed constant", node)
