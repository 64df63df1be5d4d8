"""Arrays as the job contract carries them (api_schemas/jobs.py): dense little-endian bytes with a dtype and a shape,
so tensors cross the queue without any client's format. `Column` holds one array per datum of a batch, end to end:
one object for a whole batch, since building a pydantic model per array costs more than the arrays themselves on
the per-step path (and the layout is also Tinker's BatchedTensor)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict

_NUMPY: dict[str, np.dtype[Any]] = {"int64": np.dtype("<i8"), "float32": np.dtype("<f4")}


def _kind(a: np.ndarray | None) -> Literal["int64", "float32"]:
    """int64 for integer (and bool) arrays, float32 for everything else: the two dtypes the contract carries."""
    return "int64" if a is not None and a.dtype.kind in "iub" else "float32"


class _Bytes(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", ser_json_bytes="base64", val_json_bytes="base64")


class Array(_Bytes):
    """A dense tensor as bytes (little-endian, C order)."""

    dtype: Literal["int64", "float32"]
    shape: tuple[int, ...]
    data: bytes

    @classmethod
    def of(cls, a: np.ndarray) -> Array:
        kind = _kind(a)
        a = np.ascontiguousarray(a, dtype=_NUMPY[kind])
        return cls(dtype=kind, shape=a.shape, data=a.tobytes())

    def numpy(self) -> np.ndarray:
        """A read-only view of the bytes (no copy)."""
        return np.frombuffer(self.data, dtype=_NUMPY[self.dtype]).reshape(self.shape)


class Column(_Bytes):
    """One named array per datum, stored end to end: datum i's array has shape `shapes[i]` (None: that datum has
    none) and starts where datum i-1's ended."""

    dtype: Literal["int64", "float32"]  # int64 when the first array is of integers, else float32 (all converted)
    shapes: tuple[tuple[int, ...] | None, ...]
    data: bytes

    @classmethod
    def of(cls, arrays: Sequence[np.ndarray | None]) -> Column:
        kind = _kind(next((a for a in arrays if a is not None), None))
        dtype = _NUMPY[kind]
        shapes: list[tuple[int, ...] | None] = []
        parts = []
        for a in arrays:
            if a is None:
                shapes.append(None)
                continue
            a = np.ascontiguousarray(a, dtype=dtype)
            shapes.append(a.shape)
            parts.append(a.tobytes())
        return cls(dtype=kind, shapes=tuple(shapes), data=b"".join(parts))

    def arrays(self) -> list[np.ndarray | None]:
        """Each datum's array: read-only views of the bytes (no copy)."""
        flat = np.frombuffer(self.data, dtype=_NUMPY[self.dtype])
        out: list[np.ndarray | None] = []
        at = 0
        for shape in self.shapes:
            if shape is None:
                out.append(None)
                continue
            n = int(np.prod(shape, dtype=np.int64))
            out.append(flat[at : at + n].reshape(shape))
            at += n
        return out


def present(columns: Mapping[str, list[np.ndarray | None]], i: int) -> dict[str, np.ndarray]:
    """Datum i's arrays of `columns` (Column.arrays() by name), leaving out the names it has none of."""
    out = {}
    for name, arrays in columns.items():
        a = arrays[i]
        if a is not None:
            out[name] = a
    return out
