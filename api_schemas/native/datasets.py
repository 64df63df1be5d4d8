"""The native protocol's processor service (`/api/v1/processor/twinkle/{create,call}`): what a twinkle client may
create and call on server-held datasets, data loaders and input processors, and the kwargs each accepts.

Upstream creates `getattr(twinkle.<processor_type>, class_type)(**body)` and calls any method marked remote, with
every string kwarg through `deserialize_object`. Here the class is a key of `CLASSES`, the function a key of that
class's table, and each call's kwargs are validated by the entry's model (unknown kwargs refused, a ComponentError
naming what is accepted). The only typed object read from the wire is a DatasetMeta (`"_TWINKLE_TYPE_":
"DatasetMeta"`, a JSON string as twinkle_client sends it, or the same object unencoded), and only its inline `data`:
a `dataset_id` (hub id or server path) is refused, since nothing is downloaded or read from the server's disk.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from api_schemas.native.components import ComponentError

__all__ = ["CLASSES", "DATASET_OPTIONS", "FUNCTIONS", "PREPROCESSORS", "Args", "DataLoaderArgs", "DatasetMetaIn",
           "ProcessorKind",
           "check_args", "class_for", "parse_dataset_meta"]

ProcessorKind = Literal["dataset", "dataloader", "processor"]

# processor_type -> class_type -> what the server holds for it. Every dataset class holds the client's inline rows
# in memory (LazyDataset behaves as Dataset; IterableDataset adds __iter__ / __next__; PackingDataset and
# IterablePackingDataset add pack_dataset, server/services/native/packing.py).
CLASSES: dict[str, dict[str, str]] = {
    "dataset": {"Dataset": "dataset", "LazyDataset": "dataset", "IterableDataset": "dataset",
                "PackingDataset": "dataset", "IterablePackingDataset": "dataset"},
    "dataloader": {"DataLoader": "dataloader"},
    "processor": {"InputProcessor": "processor"},
}
NOT_OFFERED: dict[str, str] = {}  # class names twinkle has that the server knows but does not hold, with the reason


def class_for(processor_type: object, class_type: object) -> tuple[ProcessorKind, str]:
    """(kind, class name) of an allowed class; ComponentError naming the accepted ones otherwise."""
    accepted = ", ".join(f"{t}/{c}" for t, table in CLASSES.items() for c in table)
    if not isinstance(processor_type, str) or processor_type not in CLASSES:
        raise ComponentError(f"processor_type {processor_type!r} is not offered by this server; accepted: "
                             f"{', '.join(CLASSES)} (classes: {accepted})")
    table = CLASSES[processor_type]
    if not isinstance(class_type, str) or class_type not in table:
        why = NOT_OFFERED.get(class_type) if isinstance(class_type, str) else None
        hint = f" ({why})" if why else ""
        if isinstance(class_type, str) and "://" in class_type:
            hint = " (hub plugins are not loaded by this server)"
        raise ComponentError(f"{processor_type} class {class_type!r} is not offered by this server{hint}; "
                             f"accepted: {', '.join(table)}")
    return table[class_type], class_type  # type: ignore[return-value]


class Args(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


# --- DatasetMeta: inline rows only
class RangeSlice(Args):
    slice_type: Literal["range"] = Field(alias="_slice_type_")
    start: int = Field(ge=0)
    stop: int = Field(ge=0)
    step: int = Field(1, ge=1)


class ListSlice(Args):
    slice_type: Literal["list"] = Field(alias="_slice_type_")
    values: list[int]


class DatasetMetaIn(BaseModel):
    """twinkle.dataset.DatasetMeta as serialize_object writes it (unknown keys of newer clients ignored)."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    dataset_id: str | None = ""
    subset_name: str | None = "default"
    split: str | None = "train"
    data_slice: RangeSlice | ListSlice | None = Field(None, discriminator="slice_type")
    data: list[Any] | dict[str, Any] | None = None

    def indices(self, n: int, max_rows: int) -> list[int] | None:
        """The slice's row indices into `n` rows (an index past the end wraps, as upstream's does); None: all."""
        s = self.data_slice
        if s is None:
            return None
        picked = range(s.start, s.stop, s.step) if isinstance(s, RangeSlice) else s.values
        if len(picked) > max_rows:
            raise ComponentError(f"data_slice picks {len(picked)} rows; at most {max_rows} are accepted")
        if any(i < 0 for i in picked):
            raise ComponentError("data_slice indices must be >= 0")
        if n == 0:
            return []
        return [i % n for i in picked]


def parse_dataset_meta(value: object) -> DatasetMetaIn:
    """A DatasetMeta from the wire: a JSON string (or object) with `"_TWINKLE_TYPE_": "DatasetMeta"` and inline
    `data`. Anything else is a ComponentError saying what is accepted."""
    raw: object = value
    if isinstance(value, str):
        try:
            raw = json.loads(value)
        except ValueError:
            raw = None
    if not isinstance(raw, Mapping) or raw.get("_TWINKLE_TYPE_") != "DatasetMeta":
        raise ComponentError("dataset_meta must be a twinkle DatasetMeta (a JSON object with "
                             "\"_TWINKLE_TYPE_\": \"DatasetMeta\") holding its rows in `data`")
    try:
        meta = DatasetMetaIn.model_validate({k: v for k, v in raw.items() if k != "_TWINKLE_TYPE_"})
    except ValidationError as e:
        problems = "; ".join(f"{'.'.join(str(p) for p in err['loc'])}: {err['msg']}" for err in e.errors())
        raise ComponentError(f"dataset_meta: {problems}") from None
    if meta.dataset_id:
        raise ComponentError(f"dataset_meta.dataset_id {meta.dataset_id!r}: this server loads no dataset from a "
                             "model hub or a server path; only inline rows are accepted: "
                             "DatasetMeta(data=[{...}, ...]) (a list of rows or a dict of columns)")
    if meta.data is None:
        raise ComponentError("dataset_meta holds no `data`: pass the rows inline, DatasetMeta(data=[{...}, ...])")
    return meta


# --- the dataset classes' own ctor kwargs (beside dataset_meta)
class PackingArgs(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    packing_num_proc: int = Field(1, ge=1)  # ignored: packing is one pass over the lengths


class IterablePackingArgs(PackingArgs):
    packing_interval: int = Field(128, ge=1, le=100_000)  # rows packed together
    cyclic: bool = False  # __next__ starts again from the first row instead of ending


DATASET_OPTIONS: dict[str, type[BaseModel]] = {"PackingDataset": PackingArgs,
                                               "IterablePackingDataset": IterablePackingArgs}


# --- map preprocessors (twinkle.preprocessor, reimplemented in server/services/native/preprocessors.py)
class SelfCognitionArgs(Args):
    model_name: str | None = Field(None, max_length=256)
    model_author: str | None = Field(None, max_length=256)


class NoArgs(Args):
    pass


class GSM8KArgs(Args):
    system: str | None = Field(None, max_length=8192)
    add_assistant: bool = False


PREPROCESSORS: dict[str, type[Args]] = {
    "SelfCognitionProcessor": SelfCognitionArgs,
    "AlpacaProcessor": NoArgs,
    "CompetitionMathProcessor": NoArgs,
    "GSM8KProcessor": GSM8KArgs,
}


# --- call arguments, per class and function (the function's own named arguments + datasets.map's kwargs)
class MapKwargs(Args):
    """datasets.map's kwargs a twinkle script passes: accepted, and ignored except remove_columns (applied)."""

    batched: bool = True
    batch_size: int | None = Field(None, ge=1)
    num_proc: int | None = Field(None, ge=1)
    load_from_cache_file: bool | None = None
    keep_in_memory: bool | None = None
    desc: str | None = Field(None, max_length=256)
    remove_columns: list[str] | str | None = None


class SetTemplate(Args):
    """The template's own kwargs are checked by api_schemas/native/components.py's Template entry."""

    template_func: str | None = None
    template_cls: str | None = None


class Encode(MapKwargs):
    add_generation_prompt: bool = False


class MapArgs(MapKwargs):
    preprocess_func: str
    dataset_meta: Any = None
    init_args: dict[str, Any] | None = None


class FilterArgs(MapKwargs):
    filter_func: Any = None
    dataset_meta: Any = None
    init_args: dict[str, Any] | None = None


class AddDataset(Args):
    dataset_meta: Any


class MixDataset(Args):
    interleave: bool = True


class GetItem(Args):
    idx: int | None = None
    index: int | None = None


class CastColumn(Args):
    column: str
    decode: bool = True


class SaveAs(Args):
    output_path: Any = None
    format: Any = None
    batch_size: Any = None
    mode: Any = None


class ProcessorCls(Args):
    processor_cls: str | None = None
    padding_side: Literal["left", "right"] = "right"
    padding_free: bool = False
    framework: Literal["transformers"] = "transformers"


class Consumed(Args):
    consumed_train_samples: int = Field(ge=0)


class ResumeArgs(Consumed):
    pass


class AnyArgs(Args):
    """Functions that are refused whatever they are given."""

    model_config = ConfigDict(extra="allow", frozen=True)


class DataLoaderArgs(Args):
    """twinkle.dataloader.DataLoader's kwargs (torch DataLoader's): the ones that change the batches are applied,
    the worker-process ones are accepted and ignored (the rows are in memory)."""

    dataset: str
    batch_size: int = Field(ge=1)
    min_batch_size: int | None = Field(None, ge=1)
    drop_last: bool = False
    shuffle: bool = False
    seed: int | None = None
    num_workers: int | None = Field(None, ge=0)  # ignored
    pin_memory: bool | None = None  # ignored
    persistent_workers: bool | None = None  # ignored
    prefetch_factor: int | None = Field(None, ge=1)  # ignored
    max_retries: int | None = Field(None, ge=0)  # ignored: a held row never fails to load
    device_mesh: None = None


class InputProcessorArgs(Args):
    device_mesh: None = None
    padding_free: bool = False
    framework: Literal["transformers"] = "transformers"
    padding_side: Literal["left", "right"] = "right"


FUNCTIONS: dict[ProcessorKind, dict[str, type[Args]]] = {
    "dataset": {
        "set_template": SetTemplate, "encode": Encode, "check": MapKwargs, "map": MapArgs, "filter": FilterArgs,
        "add_dataset": AddDataset, "mix_dataset": MixDataset, "__len__": Args, "__getitem__": GetItem,
        "cast_column": CastColumn, "save_as": SaveAs, "flush_save": Args,
        "pack_dataset": Args, "__iter__": Args, "__next__": Args,  # the iterable and packing classes only
    },
    "dataloader": {
        "__len__": Args, "__iter__": Args, "__next__": Args, "set_processor": ProcessorCls,
        "skip_consumed_samples": Consumed, "resume_from_checkpoint": ResumeArgs, "get_state": Args,
    },
    "processor": {"__call__": AnyArgs},
}
EXTRA_ALLOWED = {("dataset", "set_template")}  # the template's kwargs: checked against the Template allow-list


def check_args(kind: ProcessorKind, function: object, kwargs: dict[str, Any]) -> tuple[str, Args, dict[str, Any]]:
    """(function, its validated kwargs, the kwargs left for a component's own check) or a ComponentError."""
    table = FUNCTIONS[kind]
    if not isinstance(function, str) or function not in table:
        raise ComponentError(f"{kind} function {function!r} is not offered by this server; accepted: "
                             f"{', '.join(table)}")
    model = table[function]
    own = {k: v for k, v in kwargs.items() if k in model.model_fields} if (kind, function) in EXTRA_ALLOWED \
        else kwargs
    rest = {k: v for k, v in kwargs.items() if k not in own}
    try:
        return function, model.model_validate(own), rest
    except ValidationError as e:
        fields = ", ".join(model.model_fields) or "none"
        problems = "; ".join(f"{'.'.join(str(p) for p in err['loc']) or function}: {err['msg']}"
                             for err in e.errors())
        raise ComponentError(f"{kind} {function} arguments: {problems} (accepted arguments: {fields})") from None
