"""The objects the native protocol's server holds for a client (server/services/native/datasets.py's Dataset,
server/services/native/dataloader.py's DataLoader and InputProcessor), the store they live in, its limits and the
`handles` registry of the functions a client may call on them.

Storage: an in-memory store in this gateway process (lost when it restarts; with several gateways a client's
requests must reach the same one, which Ray Serve's sticky `serve_multiplexed_model_id` header the client sends is
for). Each object is bound to the caller's tenant AND its `X-Twinkle-Session-Id` session: another tenant's or
another session's `pid:` is a 404, as is any call once the session has ended. Objects of ended sessions (finished,
or no heartbeat within `session_timeout_seconds`) are dropped by a sweep that runs at the first processor request
after at most SWEEP_SECONDS (and by the maintenance loop's drop_ended). Per tenant at most
`native_processor_objects_per_tenant` objects, `native_processor_rows_per_tenant` rows and
`native_processor_bytes_per_tenant` bytes of rows (as JSON) are held (429 with the numbers beyond them; the
operation that would pass a limit changes nothing).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from api_schemas.native.datasets import DataLoaderArgs, ProcessorKind
from server.db import repositories as repo
from server.db.models import utcnow
from server.errors import BadRequest, NotFound, OverLimit
from server.services.context import Context
from server.services.native.encoding import TemplateOptions

Row = dict[str, Any]
SWEEP_SECONDS = 30.0
_STORE_KEY = "_native_processor_store"


class ProcessorLimit(OverLimit):
    """A tenant's server-held data would pass one of its limits (objects, rows, bytes)."""


# --- what is held
@dataclass
class DatasetObj:
    parts: dict[str, list[Row]] = field(default_factory=dict)  # added datasets, by their DatasetMeta's key
    mixed: list[Row] | None = None  # mix_dataset's result; then every operation acts on it
    template: TemplateOptions | None = None
    model: str | None = None  # the served model whose tokenizer encodes the rows (set_template)
    packs: list[list[int]] | None = None  # pack_dataset's groups of row indices (PackingDataset); None: unpacked
    cursor: int = 0  # the next row (or pack) of __next__ (IterableDataset, IterablePackingDataset)

    def current(self) -> list[Row] | None:
        """The rows len / getitem / encode / a DataLoader see (upstream's `self.dataset`): the mixed rows, else the
        first dataset added."""
        if self.mixed is not None:
            return self.mixed
        return next(iter(self.parts.values()), None)

    def measure(self) -> tuple[int, int]:
        lists = list(self.parts.values()) + ([self.mixed] if self.mixed is not None else [])
        rows = sum(len(r) for r in lists)
        size = sum(len(json.dumps(row, separators=(",", ":"), ensure_ascii=False)) for r in lists for row in r)
        return rows, size


@dataclass
class LoaderObj:
    dataset: str  # the pid of the dataset it reads
    args: DataLoaderArgs
    processor: dict[str, Any] | None = None
    rows: list[Row] | None = None  # the current pass: a snapshot of the dataset's rows at __iter__
    batches: list[list[int]] = field(default_factory=list)  # the current pass's batches, as row indices
    pos: int = 0  # the next batch
    passes: int = 0
    skip: int = 0  # rows to skip at the start of the next pass
    consumed: int = 0


@dataclass
class ProcessorObj:
    args: dict[str, Any]


@dataclass
class Held:
    pid: str
    tenant_id: str
    session_id: str
    kind: ProcessorKind
    class_name: str
    obj: Any
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    rows: int = 0
    bytes: int = 0
    options: dict[str, Any] = field(default_factory=dict)  # the class's own ctor kwargs (IterablePackingDataset's)


class Store:
    def __init__(self) -> None:
        self.objects: dict[str, Held] = {}
        self.last_sweep = 0.0

    def usage(self, tenant_id: str, without: str | None = None) -> tuple[int, int, int]:
        mine = [h for h in self.objects.values() if h.tenant_id == tenant_id and h.pid != without]
        return len(mine), sum(h.rows for h in mine), sum(h.bytes for h in mine)


async def drop_ended(ctx: Context) -> None:
    """Maintenance: drop the objects of ended sessions even when no processor request comes."""
    await sweep(ctx, store_of(ctx), force=True)


def store_of(ctx: Context) -> Store:
    """The gateway's store (one per app context)."""
    store = ctx.__dict__.get(_STORE_KEY)
    if store is None:
        store = ctx.__dict__[_STORE_KEY] = Store()
    return store


async def sweep(ctx: Context, store: Store, force: bool = False) -> None:
    """Drop the objects of sessions that ended (or that the database no longer knows)."""
    now = time.monotonic()
    if not store.objects or (not force and now - store.last_sweep < SWEEP_SECONDS):
        return
    store.last_sweep = now
    sessions = {h.session_id for h in store.objects.values()}
    stale_before = utcnow() - timedelta(seconds=ctx.settings.session_timeout_seconds)
    async with ctx.db.session() as s:
        live = await repo.live_session_ids(s, sessions, stale_before)
    for pid in [p for p, h in store.objects.items() if h.session_id not in live]:
        del store.objects[pid]


def check_limits(ctx: Context, store: Store, tenant_id: str, pid: str | None, rows: int, size: int,
                 new_object: bool = False) -> None:
    st = ctx.settings
    count, held_rows, held_bytes = store.usage(tenant_id, without=pid)
    if new_object and count + 1 > st.native_processor_objects_per_tenant:
        raise ProcessorLimit(f"a tenant holds at most {st.native_processor_objects_per_tenant} datasets, data "
                             "loaders and processors at a time; they are dropped when their session ends")
    if held_rows + rows > st.native_processor_rows_per_tenant:
        raise ProcessorLimit(f"this would hold {held_rows + rows} rows; a tenant holds at most "
                             f"{st.native_processor_rows_per_tenant} rows of server-held datasets at a time")
    if held_bytes + size > st.native_processor_bytes_per_tenant:
        raise ProcessorLimit(f"this would hold {held_bytes + size} bytes of rows (as JSON); a tenant holds at "
                             f"most {st.native_processor_bytes_per_tenant} bytes of server-held datasets at a time")


def bad(e: Exception) -> BadRequest:
    return BadRequest(str(e))


def lookup(store: Store, tenant_id: str, session_id: str, pid: object, kind: ProcessorKind | None = None,
           what: str = "processor") -> Held:
    if not isinstance(pid, str) or not pid.startswith("pid:"):
        raise BadRequest(f"{what} must be a processor id (pid:...) returned by processor/twinkle/create")
    held = store.objects.get(pid)
    if held is None or held.tenant_id != tenant_id or held.session_id != session_id:
        raise NotFound(f"{what} {pid} not found in this session (objects live as long as the session that "
                       "created them)")
    if kind is not None and held.kind != kind:
        raise BadRequest(f"{pid} is a {held.class_name}, not a {kind}")
    return held


def dataset_of(held: Held) -> DatasetObj:
    assert isinstance(held.obj, DatasetObj)
    return held.obj


def current_rows(ds: DatasetObj) -> list[Row]:
    rows = ds.current()
    if rows is None:
        raise BadRequest("this dataset holds no rows yet: create it with a DatasetMeta or call add_dataset")
    return rows


def seen_rows(ds: DatasetObj) -> list[Row]:
    """What a DataLoader reads: the packed rows once pack_dataset ran, else the rows."""
    return [seen_row(ds, i) for i in range(seen_count(ds))] if ds.packs is not None else current_rows(ds)


def seen_count(ds: DatasetObj) -> int:
    return len(current_rows(ds)) if ds.packs is None else len(ds.packs)


def seen_row(ds: DatasetObj, i: int) -> Row:
    """Row (or pack) i of what len / getitem / iteration read."""
    rows = current_rows(ds)
    return rows[i] if ds.packs is None else packed_row([rows[j] for j in ds.packs[i]])


def packed_row(rows: list[Row]) -> Row:
    """Rows joined as twinkle's PackingDataset.__getitem__ joins them: lists of numbers (input_ids, labels,
    attention_mask) and position_ids concatenated, every other column as the list of the rows' values."""
    out: Row = {}
    for key in rows[0]:
        values = [r.get(key) for r in rows]
        first = values[0]
        numbers = isinstance(first, list) and bool(first) and isinstance(first[0], (int, float))
        joined = key == "position_ids" or numbers
        out[key] = [v for lst in values for v in (lst if isinstance(lst, list) else [lst])] if joined else values
    return out


# --- the functions a client may call: (kind, function) -> handler
Handler = Callable[[Context, Store, Held, Any, dict[str, Any]], Any]
HANDLERS: dict[tuple[str, str], Handler] = {}


def handles(kind: str, *functions: str) -> Callable[[Handler], Handler]:
    def register(fn: Handler) -> Handler:
        for f in functions:
            HANDLERS[(kind, f)] = fn
        return fn

    return register

