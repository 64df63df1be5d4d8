"""Custom losses as the engine runs them: a checked graph (`CustomLossProgram`) and the check of a batch's inputs
against it. Pure (no torch).

A program is made from a client's upload by its edge (the Tinker one: `api_schemas/tinker/custom_loss.py`, which
checks every node against the allowlist in `custom_loss_ops.py`); the worker walks its node list with a small
interpreter (`workers/engine/custom_loss.py`) that calls only allowlisted functions.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from api_schemas import custom_loss_ops as ops

_FLOATS = {"inf": math.inf, "-inf": -math.inf, "nan": math.nan}


class CustomLossInput(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str
    rank: Literal[0, 1, 2]


class ProgramNode(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    op: Literal["placeholder", "call_function", "call_method", "output"]
    name: str
    target: str
    args: list[Any]  # encoded as on the wire, checked: refs name earlier nodes, constants are allowlisted
    kwargs: dict[str, Any]


class CustomLossProgram(BaseModel):
    """A checked custom loss, as stored and as carried in forward_backward jobs (the worker needs no lookup)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    loss_id: str
    name: str
    inputs: list[CustomLossInput]  # logprobs first, then the loss_fn_inputs keys it reads, in call order
    nodes: list[ProgramNode]

    def digest(self) -> str:
        """Identifies what the loss computes (not its id): a retried create must carry the same one."""
        body = json.dumps([self.name, [i.model_dump() for i in self.inputs], [n.model_dump() for n in self.nodes]],
                          sort_keys=True)
        return hashlib.sha256(body.encode()).hexdigest()


def decode_float(value: str) -> float:
    return _FLOATS[value]


def check_custom_inputs(program: CustomLossProgram, shapes: Sequence[Mapping[str, tuple[int, ...]]]) -> None:
    """Each datum has every input the loss reads, at its declared rank (raise ValueError naming what is wrong).

    `logprobs` has the shape of `target_tokens`. On the wire a rank-0 value travels as one value with no shape,
    so it arrives as shape (1,)."""
    runs = len(program.nodes) * len(shapes)
    if runs > ops.MAX_NODE_RUNS:
        raise ValueError(
            f"custom loss {program.name!r}: {len(program.nodes)} nodes x {len(shapes)} datums is over the limit of "
            f"{ops.MAX_NODE_RUNS} node runs per request; send fewer datums per request"
        )
    logprobs, *inputs = program.inputs
    for i, datum in enumerate(shapes):
        for declared, key in [(logprobs, "target_tokens"), *((x, x.name) for x in inputs)]:
            shape = datum.get(key)
            if shape is None:
                raise ValueError(f"custom loss {program.name!r}: datum {i} has no loss_fn_inputs[{key!r}], which it takes")
            rank = len(shape)
            if declared.rank == 0 and shape == (1,):
                continue
            if rank != declared.rank:
                raise ValueError(
                    f"custom loss {program.name!r}: datum {i} loss_fn_inputs[{key!r}] has rank {rank} "
                    f"(shape {list(shape)}), but the loss declared {declared.name} with rank {declared.rank}"
                )
