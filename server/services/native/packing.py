"""The iterable and packing dataset classes of the native protocol's processor service (twinkle_client.dataset's
IterableDataset, PackingDataset, IterablePackingDataset), on the same server-held inline rows as Dataset
(server/services/native/datasets.py; the rows, limits and lifetime are processor_store.py's).

- IterableDataset: `__iter__` starts a pass, `__next__` answers the next row and 410 at the end (StopIteration on
  the client), as upstream's streaming dataset iterates.
- PackingDataset: `pack_dataset` groups the encoded rows by first-fit decreasing on their lengths into packs of at
  most the template's max_length tokens (2048 without one), upstream's binpacking.to_constant_volume; `len` and
  `dataset[i]` then read the packs, each joined as upstream's __getitem__ joins it (position_ids start again at 0
  for each row, which is how forward_backward reads a packed row back as its sequences, api_schemas/native/
  features.py). A DataLoader over it batches packs.
- IterablePackingDataset: the same packing within windows of `packing_interval` rows, read by `__iter__` /
  `__next__`; `cyclic` starts again from the first pack instead of ending.
The packs are row indices (no copy is held); a change of the rows (map, encode, add_dataset, ...) drops them.
"""

from __future__ import annotations

from typing import Any

from server.errors import BadRequest, Gone
from server.services.context import Context
from server.services.native.encoding import DEFAULT_MAX_LENGTH
from server.services.native.processor_store import DatasetObj, Held, Row, Store, current_rows, dataset_of, \
    handles, seen_count, seen_row

ITERABLE = ("IterableDataset", "IterablePackingDataset")
PACKING = ("PackingDataset", "IterablePackingDataset")


def pack(lengths: list[int], capacity: int) -> list[list[int]]:
    """First-fit decreasing: indices by length (longest first, ties in order) into bins of at most `capacity`
    tokens; a longer row is a bin of its own."""
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda j: -lengths[j]):
        at = next((b for b, r in enumerate(room) if lengths[i] <= r), None)
        if at is None:
            bins.append([i])
            room.append(capacity - lengths[i])
        else:
            bins[at].append(i)
            room[at] -= lengths[i]
    return bins


def _lengths(rows: list[Row]) -> list[int]:
    if any(not isinstance(r.get("input_ids"), list) or not r["input_ids"] for r in rows):
        raise BadRequest("pack_dataset packs encoded rows: call encode() first (every row needs input_ids)")
    return [len(r["input_ids"]) for r in rows]


def _only(held: Held, classes: tuple[str, ...], function: str) -> DatasetObj:
    if held.class_name not in classes:
        raise BadRequest(f"{function} is a function of {' and '.join(classes)}, not of {held.class_name}")
    return dataset_of(held)


@handles("dataset", "pack_dataset")
async def _pack_dataset(ctx: Context, store: Store, held: Held, args: Any, rest: dict[str, Any]) -> None:
    ds = _only(held, PACKING, "pack_dataset")
    if ds.template is None:
        raise BadRequest("pack_dataset needs the template's max_length: call set_template() and encode() first")
    lengths = _lengths(current_rows(ds))
    capacity = ds.template.max_length or DEFAULT_MAX_LENGTH
    window = held.options.get("packing_interval") or len(lengths) or 1
    ds.packs = [[start + i for i in b] for start in range(0, len(lengths), window)
                for b in pack(lengths[start:start + window], capacity)]
    ds.cursor = 0


@handles("dataset", "__iter__")
async def _iter(ctx: Context, store: Store, held: Held, args: Any, rest: dict[str, Any]) -> str:
    ds = _only(held, ITERABLE, "__iter__")
    if held.class_name in PACKING and ds.packs is None:
        raise BadRequest("call pack_dataset() before iterating an IterablePackingDataset")
    ds.cursor = 0
    return "ok"


@handles("dataset", "__next__")
async def _next(ctx: Context, store: Store, held: Held, args: Any, rest: dict[str, Any]) -> Row:
    ds = _only(held, ITERABLE, "__next__")
    n = seen_count(ds)
    if ds.cursor >= n and held.options.get("cyclic") and n:
        ds.cursor = 0
    if ds.cursor >= n:  # 410: the end of the pass (StopIteration on the client)
        raise Gone(f"the dataset's {n} rows have all been read; call __iter__ to start again")
    ds.cursor += 1
    return seen_row(ds, ds.cursor - 1)
