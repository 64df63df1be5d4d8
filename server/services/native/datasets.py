"""Server-held datasets of the native protocol (twinkle_client.dataset.Dataset, twinkle_client.dataloader.DataLoader,
twinkle_client.processor.InputProcessor): `/api/v1/processor/twinkle/create` and `/call`, and the Dataset's
functions (the DataLoader's and InputProcessor's are server/services/native/dataloader.py's; the held objects, their
store, its per-session lifetime and per-tenant limits are server/services/native/processor_store.py's).

What a client may create and call is api_schemas/native/datasets.py's allow-list. The rows come only from the client
(DatasetMeta `data`, optionally sliced by `data_slice`); `map` runs one of server/services/native/preprocessors.py's
reimplementations of twinkle's preprocessors; `encode` turns each row's `messages` into the InputFeature fields
with the served model's tokenizer and chat template as twinkle's Template does (server/services/native/encoding.py),
so a DataLoader batch (a list of rows) goes straight into `model.forward_backward(inputs=batch)`. Nothing is
written to or read from the server's disk, nothing is downloaded, no client-named class is imported.

Differences from upstream, on purpose: `data_slice` also slices inline data (upstream applies it only to hub and
file datasets); `__getitem__` past the end answers 410, so `for row in dataset` ends with StopIteration on the
client (the DataLoader's differences are listed in server/services/native/dataloader.py).
"""

from __future__ import annotations

import asyncio
import json
import secrets
from typing import Any

from pydantic import ValidationError

from api_schemas.native import datasets as schema
from api_schemas.native.components import ComponentError, resolve
from api_schemas.native.datasets import DataLoaderArgs, DatasetMetaIn
from server.errors import BadRequest, Gone
from server.services.context import Context
from server.services.native import dataloader as _dataloader  # noqa: F401  (registers its handlers)
from server.services.native import packing as _packing  # noqa: F401  (registers its handlers)
from server.services.native.adapters import native_session
from server.services.native.encoding import DEFAULT_MAX_LENGTH, EncodeError, TemplateOptions, encode_rows, \
    tokenizer_for
from server.services.native.preprocessors import BUILDERS, PreprocessError, apply
from server.services.native.processor_store import HANDLERS, DatasetObj, Held, LoaderObj, ProcessorObj, Row, Store, \
    bad, check_limits, current_rows, dataset_of, handles, lookup, seen_count, seen_row, store_of, sweep


# --- create
async def create(ctx: Context, tenant_id: str, session_id: str | None, body: dict[str, Any]) -> dict[str, Any]:
    session = await native_session(ctx, tenant_id, session_id)
    store = store_of(ctx)
    await sweep(ctx, store, force=True)
    kwargs = dict(body)
    try:
        kind, class_name = schema.class_for(kwargs.pop("processor_type", None), kwargs.pop("class_type", None))
    except ComponentError as e:
        raise bad(e) from None
    pid = f"pid:{secrets.token_hex(16)}"
    rows = size = 0
    options: dict[str, Any] = {}
    obj: Any
    if kind == "dataset":
        meta = kwargs.pop("dataset_meta", None)
        model = schema.DATASET_OPTIONS.get(class_name, schema.Args)
        own = {k: kwargs.pop(k) for k in list(kwargs) if k in model.model_fields}
        if kwargs:
            raise BadRequest(f"{class_name}: unknown arguments {sorted(kwargs)}; accepted: "
                             f"{', '.join(['dataset_meta', *model.model_fields])} "
                             "(datasets.load_dataset's kwargs do not apply to inline rows)")
        try:
            options = model.model_validate(own).model_dump()
        except ValidationError as e:
            raise bad(_component_error(class_name, model, e)) from None
        obj = DatasetObj()
        if meta is not None:
            key, data = _load(ctx, meta)
            obj.parts[key] = data
        rows, size = obj.measure()
    elif kind == "dataloader":
        try:
            args = DataLoaderArgs.model_validate(kwargs)
        except ValidationError as e:  # worded like the other allow-lists
            raise bad(_component_error("DataLoader", DataLoaderArgs, e)) from None
        lookup(store, tenant_id, session.id, args.dataset, "dataset", what="dataset")
        if args.batch_size > ctx.settings.max_datums_per_request:
            raise BadRequest(f"batch_size must be at most {ctx.settings.max_datums_per_request} (the rows of one "
                             "forward_backward request)")
        obj = LoaderObj(dataset=args.dataset, args=args)
    else:
        try:
            _, parsed = resolve("processor", class_name, kwargs)
        except ComponentError as e:
            raise bad(e) from None
        obj = ProcessorObj(parsed.model_dump(mode="json"))
    check_limits(ctx, store, tenant_id, None, rows, size, new_object=True)
    store.objects[pid] = Held(pid, tenant_id, session.id, kind, class_name, obj, rows=rows, bytes=size,
                              options=options)
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
        raise bad(e) from None
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


# --- call
async def call(ctx: Context, tenant_id: str, session_id: str | None, body: dict[str, Any]) -> dict[str, Any]:
    session = await native_session(ctx, tenant_id, session_id)
    store = store_of(ctx)
    await sweep(ctx, store)
    kwargs = dict(body)
    held = lookup(store, tenant_id, session.id, kwargs.pop("processor_id", None))
    try:
        function, args, rest = schema.check_args(held.kind, kwargs.pop("function", None), kwargs)
    except ComponentError as e:
        raise bad(e) from None
    handler = HANDLERS[(held.kind, function)]
    async with held.lock:
        result = await handler(ctx, store, held, args, rest)
    return {"result": result}


# --- Dataset
async def _commit(ctx: Context, store: Store, held: Held, new: DatasetObj) -> None:
    """Replace the dataset's state by `new` if the tenant's limits allow it."""
    rows, size = await asyncio.to_thread(new.measure)
    check_limits(ctx, store, held.tenant_id, held.pid, rows, size)
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
        raise bad(e) from None
    values = spec.model_dump()
    ds = dataset_of(held)
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
    ds = dataset_of(held)
    opts, model = _template(ds)
    rows = current_rows(ds)
    tok = tokenizer_for(ctx.served(model))

    def work() -> list[Row]:
        encoded = encode_rows(tok, rows, opts, args.add_generation_prompt)
        return [{**r, **e.feature()} for r, e in zip(_remove_columns(rows, args.remove_columns), encoded)
                if e is not None]

    try:
        new_rows = await asyncio.to_thread(work)
    except EncodeError as e:
        raise bad(e) from None
    await _commit(ctx, store, held, _with_rows(ds, None, new_rows))


@handles("dataset", "check")
async def _check(ctx: Context, store: Store, held: Held, args: schema.MapKwargs, rest: dict[str, Any]) -> None:
    """Upstream's check: keep the rows the template can encode (one at a time, as Template.check does)."""
    ds = dataset_of(held)
    opts, model = _template(ds)
    rows = current_rows(ds)
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
        raise bad(_component_error(name, model, e)) from None
    ds = dataset_of(held)
    current_rows(ds)
    target = _target(ctx, ds, args.dataset_meta)
    rows = ds.mixed if target is None else ds.parts[target]
    assert rows is not None
    fn = BUILDERS[name](init)
    try:
        new_rows = await asyncio.to_thread(lambda: _remove_columns(apply(fn, rows), args.remove_columns))
    except PreprocessError as e:
        raise bad(e) from None
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
    ds = dataset_of(held)
    parts = dict(ds.parts)
    while key in parts:  # the same rows added twice are two datasets, as upstream's fresh uid makes them
        key += "+"
    parts[key] = rows
    await _commit(ctx, store, held, DatasetObj(parts, ds.mixed, ds.template, ds.model))


@handles("dataset", "mix_dataset")
async def _mix_dataset(ctx: Context, store: Store, held: Held, args: schema.MixDataset,
                       rest: dict[str, Any]) -> None:
    ds = dataset_of(held)
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
    return seen_count(dataset_of(held))


@handles("dataset", "__getitem__")
async def _getitem(ctx: Context, store: Store, held: Held, args: schema.GetItem, rest: dict[str, Any]) -> Row:
    idx = args.idx if args.idx is not None else args.index
    if idx is None:
        raise BadRequest("__getitem__ needs idx (an integer)")
    ds = dataset_of(held)
    n = seen_count(ds)
    if idx >= n:  # 410: the end of a `for row in dataset` loop (StopIteration on the client)
        raise Gone(f"index {idx} is past the end of the dataset ({n} rows)")
    if idx < -n:
        raise BadRequest(f"index {idx} is out of range ({n} rows)")
    return seen_row(ds, idx % n)


@handles("dataset", "cast_column")
async def _cast_column(ctx: Context, store: Store, held: Held, args: schema.CastColumn,
                       rest: dict[str, Any]) -> None:
    raise BadRequest("cast_column sets how image or audio columns are decoded; server-held datasets are text rows "
                     "(inline JSON) with no media to decode, so it is not offered")


@handles("dataset", "save_as", "flush_save")
async def _save_as(ctx: Context, store: Store, held: Held, args: Any, rest: dict[str, Any]) -> None:
    raise BadRequest("save_as writes files on the server, which is not offered; fetch the rows with "
                     "dataset[i] (or iterate a DataLoader) and save them on the client")

