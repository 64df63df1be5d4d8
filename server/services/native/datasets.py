"""Server-held datasets of the native protocol (twinkle_client.dataset.Dataset, twinkle_client.dataloader.DataLoader,
twinkle_client.processor.InputProcessor): `/api/v1/processor/twinkle/create` and `/call`.

What a client may create and call is api_schemas/native/datasets.py's allow-list. The rows come only from the client
(DatasetMeta `data`, optionally sliced by `data_slice`); `map` runs one of server/services/native/preprocessors.py's
reimplementations of twinkle's preprocessors; `encode` turns each row's `messages` into the InputFeature fields
with the served model's tokenizer and chat template as twinkle's Template does (server/services/native/encoding.py),
so a DataLoader batch (a list of rows) goes straight into `model.forward_backward(inputs=batch)`. Nothing is
written to or read from the server's disk, nothing is downloaded, no client-named class is imported.

Storage: an in-memory store in this gateway process (lost when it restarts; with several gateways a client's
requests must reach the same one, which Ray Serve's sticky `serve_multiplexed_model_id` header the client sends is
for). Each object is bound to the caller's tenant AND its `X-Twinkle-Session-Id` session: another tenant's or
another session's `pid:` is a 404, as is any call once the session has ended. Objects of ended sessions (finished,
or no heartbeat within `session_timeout_seconds`) are dropped by a sweep that runs at the first processor request
after at most SWEEP_SECONDS. Per tenant at most `native_processor_objects_per_tenant` objects,
`native_processor_rows_per_tenant` rows and `native_processor_bytes_per_tenant` bytes of rows (as JSON) are held
(429 with the numbers beyond them; the operation that would pass a limit changes nothing).

Differences from upstream, on purpose: `data_slice` also slices inline data (upstream applies it only to hub and
file datasets); a DataLoader counts the rows it actually served as consumed (upstream adds `batch_size` per batch);
`skip_consumed_samples` / `resume_from_checkpoint` skip that many rows (modulo the dataset's length) of the next
pass only (upstream skips them in every later pass); `shuffle` orders each pass by a seeded permutation (`seed`,
default 42, plus the pass number); `__getitem__` past the end answers 410, so `for row in dataset` ends with
StopIteration on the client; `set_processor` is validated and recorded, batches stay lists of rows (collation is the
model's job).
"""

from __future__ import annotations

import asyncio
import json
import math
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import numpy as np
from pydantic import ValidationError

from api_schemas.native import datasets as schema
from api_schemas.native.components import ComponentError, resolve
from api_schemas.native.datasets import DataLoaderArgs, DatasetMetaIn, ProcessorKind
from server.db import repositories as repo
from server.db.models import utcnow
from server.errors import BadRequest, DomainError, Gone, NotFound
from server.services.context import Context
from server.services.native.adapters import native_session
from server.services.native.encoding import DEFAULT_MAX_LENGTH, EncodeError, TemplateOptions, encode_rows, \
    tokenizer_for
from server.services.native.preprocessors import BUILDERS, PreprocessError, apply

Row = dict[str, Any]
SWEEP_SECONDS = 30.0
SHUFFLE_SEED = 42  # twinkle's default seed
_STORE_KEY = "_native_processor_store"


class ProcessorLimit(DomainError):
    """A tenant's server-held data would pass one of its limits (objects, rows, bytes)."""

    status, category = 429, "user"


# --- what is held
@dataclass
class DatasetObj:
    parts: dict[str, list[Row]] = field(default_factory=dict)  # added datasets, by their DatasetMeta's key
    mixed: list[Row] | None = None  # mix_dataset's result; then every operation acts on it
    template: TemplateOptions | None = None
    model: str | None = None  # the served model whose tokenizer encodes the rows (set_template)

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


def _check_limits(ctx: Context, store: Store, tenant_id: str, pid: str | None, rows: int, size: int,
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


def _bad(e: Exception) -> BadRequest:
    return BadRequest(str(e))


# --- create
async def create(ctx: Context, tenant_id: str, session_id: str | None, body: dict[str, Any]) -> dict[str, Any]:
    session = await native_session(ctx, tenant_id, session_id)
    store = store_of(ctx)
    await sweep(ctx, store, force=True)
    kwargs = dict(body)
    try:
        kind, class_name = schema.class_for(kwargs.pop("processor_type", None), kwargs.pop("class_type", None))
    except ComponentError as e:
        raise _bad(e) from None
    pid = f"pid:{secrets.token_hex(16)}"
    rows = size = 0
    obj: Any
    if kind == "dataset":
        meta = kwargs.pop("dataset_meta", None)
        if kwargs:
            raise BadRequest(f"{class_name}: unknown arguments {sorted(kwargs)}; accepted: dataset_meta "
                             "(datasets.load_dataset's kwargs do not apply to inline rows)")
        obj = DatasetObj()
        if meta is not None:
            key, data = _load(ctx, meta)
            obj.parts[key] = data
        rows, size = obj.measure()
    elif kind == "dataloader":
        try:
            args = DataLoaderArgs.model_validate(kwargs)
        except ValidationError as e:  # worded like the other allow-lists
            raise _bad(_component_error("DataLoader", DataLoaderArgs, e)) from None
        _held(store, tenant_id, session.id, args.dataset, "dataset", what="dataset")
        if args.batch_size > ctx.settings.max_datums_per_request:
            raise BadRequest(f"batch_size must be at most {ctx.settings.max_datums_per_request} (the rows of one "
                             "forward_backward request)")
        obj = LoaderObj(dataset=args.dataset, args=args)
    else:
        try:
            _, parsed = resolve("processor", class_name, kwargs)
        except ComponentError as e:
            raise _bad(e) from None
        obj = ProcessorObj(parsed.model_dump(mode="json"))
    _check_limits(ctx, store, tenant_id, None, rows, size, new_object=True)
    store.objects[pid] = Held(pid, tenant_id, session.id, kind, class_name, obj, rows=rows, bytes=size)
    return {"processor_id": pid}


def _component_error(name: str, model: type[Any], e: Exception) -> ComponentError:
    errors: list[Any] = e.errors() if isinstance(e, ValidationError) else []
    problems = "; ".join(f"{'.'.join(str(p) for p in err['loc']) or name}: {err['msg']}" for err in errors)
    return ComponentError(f"{name} arguments: {problems or e} (accepted arguments: {', '.join(model.model_fields)})")


def _load(ctx: Context, raw: object) -> tuple[str, list[Row]]:
    """(key, rows) of an inline DatasetMeta; the key identifies the same meta sent again (map's dataset_meta)."""
    try:
        meta = schema.parse_dataset_meta(raw)
        rows = _rows(meta, ctx.settings.native_processor_rows_per_tenant)
    except ComponentError as e:
        raise _bad(e) from None
    return _key(meta), rows


def _key(meta: DatasetMetaIn) -> str:
    return json.dumps(meta.model_dump(mode="json", by_alias=True), sort_keys=True, separators=(",", ":"))


def _rows(meta: DatasetMetaIn, max_rows: int) -> list[Row]:
    data = meta.data
    if isinstance(data, dict):
        columns = list(data.items())
        if not all(isinstance(v, list) for _, v in columns):
            raise ComponentError("dataset_meta.data as a dict must map column names to lists of values")
        lengths = {len(v) for _, v in columns}
        if len(lengths) > 1:
            raise ComponentError(f"dataset_meta.data's columns have different lengths {sorted(lengths)}")
        n = lengths.pop() if lengths else 0
        if n > max_rows:
            raise ComponentError(f"dataset_meta.data holds {n} rows; at most {max_rows} are accepted")
        rows = [{k: v[i] for k, v in columns} for i in range(n)]
    else:
        assert data is not None
        if len(data) > max_rows:
            raise ComponentError(f"dataset_meta.data holds {len(data)} rows; at most {max_rows} are accepted")
        if not all(isinstance(r, dict) for r in data):
            raise ComponentError("dataset_meta.data as a list must hold one JSON object per row")
        rows = list(data)
    picked = meta.indices(len(rows), max_rows)
    return rows if picked is None else [rows[i] for i in picked]


def _held(store: Store, tenant_id: str, session_id: str, pid: object, kind: ProcessorKind | None = None,
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


# --- call
async def call(ctx: Context, tenant_id: str, session_id: str | None, body: dict[str, Any]) -> dict[str, Any]:
    session = await native_session(ctx, tenant_id, session_id)
    store = store_of(ctx)
    await sweep(ctx, store)
    kwargs = dict(body)
    held = _held(store, tenant_id, session.id, kwargs.pop("processor_id", None))
    try:
        function, args, rest = schema.check_args(held.kind, kwargs.pop("function", None), kwargs)
    except ComponentError as e:
        raise _bad(e) from None
    handler = HANDLERS[(held.kind, function)]
    async with held.lock:
        result = await handler(ctx, store, held, args, rest)
    return {"result": result}


Handler = Callable[[Context, Store, Held, Any, dict[str, Any]], Any]
HANDLERS: dict[tuple[str, str], Handler] = {}


def handles(kind: str, *functions: str) -> Callable[[Handler], Handler]:
    def register(fn: Handler) -> Handler:
        for f in functions:
            HANDLERS[(kind, f)] = fn
        return fn

    return register


def _dataset(held: Held) -> DatasetObj:
    assert isinstance(held.obj, DatasetObj)
    return held.obj


def _current(ds: DatasetObj) -> list[Row]:
    rows = ds.current()
    if rows is None:
        raise BadRequest("this dataset holds no rows yet: create it with a DatasetMeta or call add_dataset")
    return rows


async def _commit(ctx: Context, store: Store, held: Held, new: DatasetObj) -> None:
    """Replace the dataset's state by `new` if the tenant's limits allow it."""
    rows, size = await asyncio.to_thread(new.measure)
    _check_limits(ctx, store, held.tenant_id, held.pid, rows, size)
    held.obj, held.rows, held.bytes = new, rows, size


def _with_rows(ds: DatasetObj, target: str | None, rows: list[Row]) -> DatasetObj:
    """`ds` with the rows of `target` (a part's key; None: the current rows) replaced."""
    if ds.mixed is not None and target is None:
        return DatasetObj(dict(ds.parts), rows, ds.template, ds.model)
    key = target if target is not None else next(iter(ds.parts))
    parts = dict(ds.parts)
    parts[key] = rows
    return DatasetObj(parts, ds.mixed, ds.template, ds.model)


def _remove_columns(rows: list[Row], columns: list[str] | str | None) -> list[Row]:
    if not columns:
        return rows
    drop = {columns} if isinstance(columns, str) else set(columns)
    return [{k: v for k, v in r.items() if k not in drop} for r in rows]


@handles("dataset", "set_template")
async def _set_template(ctx: Context, store: Store, held: Held, args: schema.SetTemplate,
                        rest: dict[str, Any]) -> None:
    """The served model's own tokenizer and chat template, always: `model_id` only picks which served model when
    it names one (hub ids and paths are not loaded); the name and the other kwargs go through the Template
    allow-list (api_schemas/native/components.py)."""
    name = args.template_func if args.template_func is not None else args.template_cls
    try:
        _, spec = resolve("template", name, rest)
    except ComponentError as e:
        raise _bad(e) from None
    values = spec.model_dump()
    ds = _dataset(held)
    ds.model = _served_name(ctx, values.get("model_id"))
    ds.template = TemplateOptions(
        max_length=values["max_length"] if "max_length" in rest else DEFAULT_MAX_LENGTH,
        truncation_strategy=values["truncation_strategy"], default_system=values["default_system"],
        enable_thinking=values["enable_thinking"])


def _served_name(ctx: Context, model_id: object) -> str:
    names = list(ctx.models)
    if isinstance(model_id, str):
        stripped = model_id.split("://", 1)[-1]
        if stripped in ctx.models:
            return stripped
    if len(names) == 1:
        return names[0]
    raise BadRequest(f"this server serves several base models ({', '.join(names)}): pass model_id=<one of them> "
                     "to set_template to pick the tokenizer and chat template")


def _template(ds: DatasetObj) -> tuple[TemplateOptions, Any]:
    if ds.template is None or ds.model is None:
        raise BadRequest("call set_template first (e.g. set_template('Template', max_length=512)): the rows are "
                         "encoded with the served model's tokenizer and chat template")
    return ds.template, ds.model


@handles("dataset", "encode")
async def _encode(ctx: Context, store: Store, held: Held, args: schema.Encode, rest: dict[str, Any]) -> None:
    ds = _dataset(held)
    opts, model = _template(ds)
    rows = _current(ds)
    tok = tokenizer_for(ctx.served(model))

    def work() -> list[Row]:
        encoded = encode_rows(tok, rows, opts, args.add_generation_prompt)
        return [{**r, **e.feature()} for r, e in zip(_remove_columns(rows, args.remove_columns), encoded)
                if e is not None]

    try:
        new_rows = await asyncio.to_thread(work)
    except EncodeError as e:
        raise _bad(e) from None
    await _commit(ctx, store, held, _with_rows(ds, None, new_rows))


@handles("dataset", "check")
async def _check(ctx: Context, store: Store, held: Held, args: schema.MapKwargs, rest: dict[str, Any]) -> None:
    """Upstream's check: keep the rows the template can encode (one at a time, as Template.check does)."""
    ds = _dataset(held)
    opts, model = _template(ds)
    rows = _current(ds)
    tok = tokenizer_for(ctx.served(model))

    def work() -> list[Row]:
        kept = []
        for r in rows:
            try:
                if encode_rows(tok, [r], opts)[0] is not None:
                    kept.append(r)
            except EncodeError:
                continue
        return kept

    await _commit(ctx, store, held, _with_rows(ds, None, await asyncio.to_thread(work)))


def _target(ctx: Context, ds: DatasetObj, meta: object) -> str | None:
    """The part a map acts on: the one `meta` names (the same DatasetMeta sent again), else the only one."""
    if ds.mixed is not None:
        return None
    if meta is None:
        if len(ds.parts) != 1:
            raise BadRequest(f"this dataset holds {len(ds.parts)} datasets: pass the dataset_meta to act on, or "
                             "call mix_dataset first")
        return next(iter(ds.parts))
    key, _ = _load(ctx, meta)
    if key not in ds.parts:
        raise BadRequest("dataset_meta names none of the datasets added to this dataset")
    return key


@handles("dataset", "map")
async def _map(ctx: Context, store: Store, held: Held, args: schema.MapArgs, rest: dict[str, Any]) -> None:
    name = args.preprocess_func
    accepted = ", ".join(schema.PREPROCESSORS)
    if name not in schema.PREPROCESSORS:
        hint = " (hub plugins are not loaded by this server)" if "://" in name else ""
        raise BadRequest(f"preprocessor {name!r} is not offered by this server{hint}; accepted: {accepted}")
    model = schema.PREPROCESSORS[name]
    try:
        init = model.model_validate(args.init_args or {})
    except ValidationError as e:
        raise _bad(_component_error(name, model, e)) from None
    ds = _dataset(held)
    _current(ds)
    target = _target(ctx, ds, args.dataset_meta)
    rows = ds.mixed if target is None else ds.parts[target]
    assert rows is not None
    fn = BUILDERS[name](init)
    try:
        new_rows = await asyncio.to_thread(lambda: _remove_columns(apply(fn, rows), args.remove_columns))
    except PreprocessError as e:
        raise _bad(e) from None
    await _commit(ctx, store, held, _with_rows(ds, target, new_rows))


@handles("dataset", "filter")
async def _filter(ctx: Context, store: Store, held: Held, args: schema.FilterArgs, rest: dict[str, Any]) -> None:
    raise BadRequest(f"filter {args.filter_func!r} is not offered: this server runs no client filter code and "
                     "offers no built-in filter (accepted: none); filter the rows before sending them, or use "
                     "check() to drop the rows the template cannot encode")


@handles("dataset", "add_dataset")
async def _add_dataset(ctx: Context, store: Store, held: Held, args: schema.AddDataset,
                       rest: dict[str, Any]) -> None:
    key, rows = _load(ctx, args.dataset_meta)
    ds = _dataset(held)
    parts = dict(ds.parts)
    while key in parts:  # the same rows added twice are two datasets, as upstream's fresh uid makes them
        key += "+"
    parts[key] = rows
    await _commit(ctx, store, held, DatasetObj(parts, ds.mixed, ds.template, ds.model))


@handles("dataset", "mix_dataset")
async def _mix_dataset(ctx: Context, store: Store, held: Held, args: schema.MixDataset,
                       rest: dict[str, Any]) -> None:
    ds = _dataset(held)
    parts = list(ds.parts.values())
    if len(parts) <= 1:
        return  # upstream: nothing to mix
    if args.interleave:  # datasets.interleave_datasets' default: round robin until the first one runs out
        mixed: list[Row] = []
        shortest = min(len(p) for p in parts)
        for i in range(shortest):
            mixed.extend(p[i] for p in parts)
        for p in parts:  # the round in which the shortest ran out ends where it ran out
            if len(p) == shortest:
                break
            mixed.append(p[shortest])
    else:
        mixed = [r for p in parts for r in p]
    await _commit(ctx, store, held, DatasetObj(dict(ds.parts), mixed, ds.template, ds.model))


@handles("dataset", "__len__")
async def _len(ctx: Context, store: Store, held: Held, args: Any, rest: dict[str, Any]) -> int:
    return len(_current(_dataset(held)))


@handles("dataset", "__getitem__")
async def _getitem(ctx: Context, store: Store, held: Held, args: schema.GetItem, rest: dict[str, Any]) -> Row:
    idx = args.idx if args.idx is not None else args.index
    if idx is None:
        raise BadRequest("__getitem__ needs idx (an integer)")
    rows = _current(_dataset(held))
    if idx >= len(rows):  # 410: the end of a `for row in dataset` loop (StopIteration on the client)
        raise Gone(f"index {idx} is past the end of the dataset ({len(rows)} rows)")
    if idx < -len(rows):
        raise BadRequest(f"index {idx} is out of range ({len(rows)} rows)")
    return rows[idx]


@handles("dataset", "cast_column")
async def _cast_column(ctx: Context, store: Store, held: Held, args: schema.CastColumn,
                       rest: dict[str, Any]) -> None:
    raise BadRequest("cast_column sets how image or audio columns are decoded; server-held datasets are text rows "
                     "(inline JSON) with no media to decode, so it is not offered")


@handles("dataset", "save_as", "flush_save")
async def _save_as(ctx: Context, store: Store, held: Held, args: Any, rest: dict[str, Any]) -> None:
    raise BadRequest("save_as writes files on the server, which is not offered; fetch the rows with "
                     "dataset[i] (or iterate a DataLoader) and save them on the client")


# --- DataLoader
def _loader(held: Held) -> LoaderObj:
    assert isinstance(held.obj, LoaderObj)
    return held.obj


def _loader_rows(store: Store, held: Held, loader: LoaderObj) -> list[Row]:
    ds_held = _held(store, held.tenant_id, held.session_id, loader.dataset, "dataset", what="dataset")
    return _current(_dataset(ds_held))


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
        raise _bad(e) from None
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
