"""The functions of the native protocol's server-held DataLoader (twinkle_client.dataloader.DataLoader) and
InputProcessor (twinkle_client.processor.InputProcessor), registered with processor_store's `handles` for
server/services/native/datasets.py's `call`. A DataLoader reads a server-held dataset; a batch is a list of its rows,
which goes straight into `model.forward_backward(inputs=batch)`.

Differences from upstream, on purpose: a DataLoader counts the rows it actually served as consumed (upstream adds
`batch_size` per batch); `skip_consumed_samples` / `resume_from_checkpoint` skip that many rows (modulo the
dataset's length) of the next pass only (upstream skips them in every later pass); `shuffle` orders each pass by a
seeded permutation (`seed`, default 42, plus the pass number); `set_processor` is validated and recorded, batches
stay lists of rows (collation is the model's job); InputProcessor.__call__ is not offered.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from api_schemas.native import datasets as schema
from api_schemas.native.components import ComponentError, resolve
from api_schemas.native.datasets import DataLoaderArgs
from server.errors import BadRequest, Gone
from server.services.context import Context
from server.services.native.processor_store import Held, LoaderObj, Row, Store, bad, dataset_of, handles, lookup, \
    seen_rows

SHUFFLE_SEED = 42  # twinkle's default seed


# --- DataLoader
def _loader(held: Held) -> LoaderObj:
    assert isinstance(held.obj, LoaderObj)
    return held.obj


def _loader_rows(store: Store, held: Held, loader: LoaderObj) -> list[Row]:
    ds_held = lookup(store, held.tenant_id, held.session_id, loader.dataset, "dataset", what="dataset")
    return seen_rows(dataset_of(ds_held))


def _batches(n: int, args: DataLoaderArgs) -> int:
    return n // args.batch_size if args.drop_last else math.ceil(n / args.batch_size)


@handles("dataloader", "__len__")
async def _loader_len(ctx: Context, store: Store, held: Held, args: Any, rest: dict[str, Any]) -> int:
    loader = _loader(held)
    return _batches(len(_loader_rows(store, held, loader)), loader.args)


def _start_pass(store: Store, held: Held, loader: LoaderObj) -> None:
    """A new pass: the dataset's rows as they are now, in order (or a seeded permutation), cut into batches as
    torch's BatchSampler does (drop_last), less the rows a resume skips (whole batches, then the head of the batch
    the skip ends in, as upstream's DeviceMeshSampler does)."""
    rows = _loader_rows(store, held, loader)
    n, bs = len(rows), loader.args.batch_size
    if loader.args.shuffle:
        seed = (loader.args.seed if loader.args.seed is not None else SHUFFLE_SEED) + loader.passes
        order = np.random.default_rng(seed).permutation(n).tolist()
    else:
        order = list(range(n))
    chunks = [order[i:i + bs] for i in range(0, n, bs)]
    if loader.args.drop_last and chunks and len(chunks[-1]) < bs:
        chunks.pop()
    skip = loader.skip % n if n else 0
    batches, skipped = [], 0
    for chunk in chunks:
        if skipped < skip:
            if skipped + len(chunk) <= skip:
                skipped += len(chunk)
                continue
            chunk, skipped = chunk[skip - skipped:], skip
        batches.append(chunk)
    loader.rows, loader.batches, loader.pos, loader.skip = rows, batches, 0, 0
    loader.passes += 1


@handles("dataloader", "__iter__")
async def _iter(ctx: Context, store: Store, held: Held, args: Any, rest: dict[str, Any]) -> str:
    _start_pass(store, held, _loader(held))
    return "ok"


@handles("dataloader", "__next__")
async def _next(ctx: Context, store: Store, held: Held, args: Any, rest: dict[str, Any]) -> list[Row]:
    """One batch (a list of rows); 410 (StopIteration on the client) at the end of the pass."""
    loader = _loader(held)
    if loader.rows is None:
        _start_pass(store, held, loader)  # next() without iter(): the first pass
    assert loader.rows is not None
    if loader.pos >= len(loader.batches):
        raise Gone("the data loader is exhausted; call iter() (a new for loop) for another pass")
    picked = loader.batches[loader.pos]
    if loader.args.min_batch_size is not None and len(picked) < loader.args.min_batch_size:
        loader.pos = len(loader.batches)  # upstream ends the pass at a batch under min_batch_size
        raise Gone("the data loader is exhausted; call iter() (a new for loop) for another pass")
    loader.pos += 1
    loader.consumed += len(picked)
    return [loader.rows[i] for i in picked]


@handles("dataloader", "set_processor")
async def _set_processor(ctx: Context, store: Store, held: Held, args: schema.ProcessorCls,
                         rest: dict[str, Any]) -> None:
    try:
        _, spec = resolve("processor", args.processor_cls,
                          {"padding_side": args.padding_side, "padding_free": args.padding_free,
                           "framework": args.framework})
    except ComponentError as e:
        raise bad(e) from None
    _loader(held).processor = spec.model_dump(mode="json")  # batches stay rows: the model collates them


@handles("dataloader", "skip_consumed_samples", "resume_from_checkpoint")
async def _skip(ctx: Context, store: Store, held: Held, args: schema.Consumed, rest: dict[str, Any]) -> None:
    loader = _loader(held)
    loader.skip = loader.consumed = args.consumed_train_samples
    loader.rows = None  # the next pass (or next()) starts after the skipped rows


@handles("dataloader", "get_state")
async def _get_state(ctx: Context, store: Store, held: Held, args: Any, rest: dict[str, Any]) -> dict[str, int]:
    return {"consumed_train_samples": _loader(held).consumed}


# --- InputProcessor
@handles("processor", "__call__")
async def _collate(ctx: Context, store: Store, held: Held, args: Any, rest: dict[str, Any]) -> None:
    raise BadRequest("InputProcessor.__call__ (collation into tensors) is not offered over HTTP: the model collates "
                     "the rows itself; pass them as model.forward_backward(inputs=batch)")
