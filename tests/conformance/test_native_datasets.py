"""Server-held datasets of the native protocol over plain HTTP, as twinkle_client's remote Dataset / DataLoader send
them (`/api/v1/processor/twinkle/{create,call}`): inline rows, set_template, map(SelfCognitionProcessor), encode with
the served model's tokenizer, a DataLoader's passes ending in 410, its state and resume, a batch trained on as it is;
objects bound to tenant and session; every refusal (hub ids and paths, server files, classes and functions outside
the allow-lists) and the per-tenant limits. (tests/native/test_remote_dataset.py drives the same routes with the
real twinkle_client and compares the tokens with twinkle's own Template.)"""

from __future__ import annotations

import json
import math
from pathlib import Path

import httpx
import pytest
from tokenizers import Tokenizer

from tests.conformance.test_native_http import Native, setup_adapter
from tests.support.server import ServerProcess

ROWS = [
    {"query": "Who are you?", "response": "I am {{NAME}}, an assistant trained by {{AUTHOR}}."},
    {"query": "What is your name?", "response": "My name is {{NAME}}. {{AUTHOR}} built me."},
    {"query": "Introduce yourself.", "response": "Hello! I am {{NAME}}, made by {{AUTHOR}}."},
    {"query": "Who made you?", "response": "{{AUTHOR}} made me. I am {{NAME}}."},
    {"query": "Are you ChatGPT?", "response": "No, I am {{NAME}}, an assistant from {{AUTHOR}}."},
    {"query": "What should I call you?", "response": "Call me {{NAME}}. I was trained by {{AUTHOR}}."},
]
IDENTITY = {"model_name": "Blinky", "model_author": "Tenant A Labs"}


def meta(data: object, **extra: object) -> str:
    """A DatasetMeta as twinkle_client's serialize_object sends it: a JSON string with the type marker."""
    return json.dumps({"dataset_id": "", "subset_name": "default", "split": "train", "data_slice": None,
                       "data": data, **extra, "_TWINKLE_TYPE_": "DatasetMeta"})


class Proc(Native):
    def create(self, **body: object) -> httpx.Response:
        return self.http.post("/processor/twinkle/create", json=body)

    def new(self, **body: object) -> str:
        r = self.create(**body)
        assert r.status_code == 200, r.text
        pid = r.json()["processor_id"]
        assert pid.startswith("pid:") and len(pid) == 36
        return pid

    def call(self, pid: str, function: str, **kwargs: object) -> httpx.Response:
        return self.http.post("/processor/twinkle/call", json={"processor_id": pid, "function": function, **kwargs})

    def result(self, pid: str, function: str, **kwargs: object) -> object:
        r = self.call(pid, function, **kwargs)
        assert r.status_code == 200, (function, r.status_code, r.text)
        return r.json()["result"]

    def dataset(self, rows: list[dict] | None = None, class_type: str = "Dataset", options: dict | None = None,
                **meta_extra: object) -> str:
        return self.new(processor_type="dataset", class_type=class_type,
                        dataset_meta=meta(ROWS if rows is None else rows, **meta_extra), **(options or {}))

    def encoded(self, max_length: int = 128, class_type: str = "Dataset", **options: object) -> str:
        pid = self.dataset(class_type=class_type, options=options)
        assert self.result(pid, "set_template", template_func="Template", model_id="ms://Qwen/Qwen3.5-4B",
                           max_length=max_length) is None
        assert self.result(pid, "map", preprocess_func="SelfCognitionProcessor", dataset_meta=None,
                           init_args=IDENTITY, batched=True) is None
        assert self.result(pid, "encode", add_generation_prompt=False, batched=True) is None
        return pid


@pytest.fixture()
def a(server: ServerProcess) -> Proc:
    return Proc(server, server.api_key_a)


def _detail(r: httpx.Response, status: int, *words: str) -> None:
    assert r.status_code == status, (r.status_code, r.text)
    detail = r.json()["detail"]
    for w in words:
        assert w in detail, (w, detail)


def test_dataset_flow_encodes_like_the_template(a: Proc, server: ServerProcess) -> None:
    tok = Tokenizer.from_file(str(Path(server.base_model) / "tokenizer.json"))
    pid = a.dataset(data_slice={"_slice_type_": "range", "start": 0, "stop": 5, "step": 1})
    assert a.result(pid, "__len__") == 5
    assert a.result(pid, "__getitem__", idx=1) == ROWS[1]
    a.result(pid, "set_template", template_func="Template", model_id="ms://Qwen/Qwen3.5-4B", max_length=128)
    a.result(pid, "map", preprocess_func="SelfCognitionProcessor", dataset_meta=None, init_args=IDENTITY)
    row = a.result(pid, "__getitem__", idx=0)
    assert row["query"] == ROWS[0]["query"]  # the raw columns stay, as datasets.map keeps them
    assert row["messages"] == [
        {"role": "system", "content": "You are a helpful assistant."}, {"role": "user", "content": "Who are you?"},
        {"role": "assistant", "content": "I am Blinky, an assistant trained by Tenant A Labs."}]
    a.result(pid, "encode", add_generation_prompt=False, batched=True, load_from_cache_file=False)
    assert a.result(pid, "__len__") == 5
    row = a.result(pid, "__getitem__", index=0)
    ids, labels = row["input_ids"], row["labels"]
    text = ("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nWho are you?<|im_end|>\n"
            "<|im_start|>assistant\nI am Blinky, an assistant trained by Tenant A Labs.<|im_end|>\n")
    assert ids == tok.encode(text, add_special_tokens=False).ids
    assert row["attention_mask"] == [1] * len(ids) and row["position_ids"] == list(range(len(ids)))
    assert row["length"] == len(ids)
    trained = [i for i, t in enumerate(labels) if t != -100]
    assert trained and labels[-1] == -100
    assert all(labels[i] == ids[i + 1] for i in trained)  # rolled: position i predicts token i + 1
    assert tok.decode([labels[i] for i in trained], skip_special_tokens=False).endswith(
        "I am Blinky, an assistant trained by Tenant A Labs.<|im_end|>\n")
    header = len(tok.encode(text.rsplit("<|im_start|>assistant\n", 1)[0] + "<|im_start|>assistant\n",
                            add_special_tokens=False).ids)
    assert trained[0] == header - 1  # the assistant header is not trained, its content is
    # the generation-prompt variant: no labels at all
    gen = a.dataset([ROWS[0]])
    a.result(gen, "set_template", template_cls="Template")
    a.result(gen, "map", preprocess_func="AlpacaProcessor")  # no instruction/output columns: empty texts
    a.result(gen, "encode", add_generation_prompt=True)
    assert set(a.result(gen, "__getitem__", idx=0)["labels"]) == {-100}
    # for row in dataset: the index past the end is a 410 (StopIteration on the client)
    _detail(a.call(pid, "__getitem__", idx=5), 410, "past the end")
    assert a.result(pid, "__getitem__", idx=-1)["query"] == ROWS[4]["query"]


def test_dataloader_passes_state_resume_and_training(a: Proc) -> None:
    ds = a.encoded()
    dl = a.new(processor_type="dataloader", class_type="DataLoader", dataset=ds, batch_size=4, min_batch_size=None,
               drop_last=False, shuffle=False, num_workers=0)
    assert a.result(dl, "__len__") == 2
    assert a.result(dl, "set_processor", processor_cls="InputProcessor", padding_side="right") is None
    for _ in range(2):  # two passes: __iter__ resets
        assert a.result(dl, "__iter__") == "ok"
        b1, b2 = a.result(dl, "__next__"), a.result(dl, "__next__")
        assert [len(b1), len(b2)] == [4, 2]
        assert [r["query"] for r in b1 + b2] == [r["query"] for r in ROWS]
        _detail(a.call(dl, "__next__"), 410, "exhausted")
        _detail(a.call(dl, "__next__"), 410, "exhausted")  # stays exhausted until the next __iter__
    assert a.result(dl, "get_state") == {"consumed_train_samples": 12}

    # resume: the rows already consumed (modulo the dataset) are skipped in the next pass only
    a.result(dl, "resume_from_checkpoint", consumed_train_samples=5)
    assert a.result(dl, "get_state") == {"consumed_train_samples": 5}
    a.result(dl, "__iter__")
    assert [r["query"] for r in a.result(dl, "__next__")] == [ROWS[5]["query"]]
    _detail(a.call(dl, "__next__"), 410)
    a.result(dl, "skip_consumed_samples", consumed_train_samples=2)
    a.result(dl, "__iter__")
    assert [len(a.result(dl, "__next__")), len(a.result(dl, "__next__"))] == [2, 2]
    a.result(dl, "__iter__")
    assert len(a.result(dl, "__next__")) == 4  # the pass after starts at the beginning again

    # drop_last, min_batch_size, shuffle with a seed
    last = a.new(processor_type="dataloader", class_type="DataLoader", dataset=ds, batch_size=4, drop_last=True)
    assert a.result(last, "__len__") == 1
    a.result(last, "__iter__")
    a.result(last, "__next__")
    _detail(a.call(last, "__next__"), 410)
    floor = a.new(processor_type="dataloader", class_type="DataLoader", dataset=ds, batch_size=4, min_batch_size=3)
    a.result(floor, "__iter__")
    a.result(floor, "__next__")
    _detail(a.call(floor, "__next__"), 410)
    orders = []
    for _ in range(2):
        sh = a.new(processor_type="dataloader", class_type="DataLoader", dataset=ds, batch_size=6, shuffle=True,
                   seed=7)
        a.result(sh, "__iter__")
        orders.append([r["query"] for r in a.result(sh, "__next__")])
    assert orders[0] == orders[1] and sorted(orders[0]) == sorted(r["query"] for r in ROWS)

    # a batch is model input as it is
    setup_adapter(a, "ds", gas=1)
    a.ok("set_optimizer", optimizer_cls="AdamW", adapter_name="ds", lr=2e-3)
    a.result(dl, "__iter__")
    batch = a.result(dl, "__next__")
    losses = []
    for _ in range(8):
        out = a.ok("forward_backward", inputs=batch, adapter_name="ds")["result"]
        losses.append(out["loss"])
        a.ok("clip_grad_and_step", adapter_name="ds")
    assert all(math.isfinite(x) for x in losses) and sum(losses[-3:]) / 3 < losses[0], losses


def test_objects_are_bound_to_tenant_and_session(a: Proc, server: ServerProcess) -> None:
    ds = a.dataset()
    dl = a.new(processor_type="dataloader", class_type="DataLoader", dataset=ds, batch_size=2)
    b = Proc(server, server.api_key_b)
    other_session = Proc(server, server.api_key_a)
    for c in (b, other_session):
        for pid, fn in ((ds, "__len__"), (dl, "__next__")):
            _detail(c.call(pid, fn), 404, "not found")
        _detail(c.create(processor_type="dataloader", class_type="DataLoader", dataset=ds, batch_size=2), 404)
    # a session id of another tenant is no session of B's
    b.http.headers["X-Twinkle-Session-Id"] = a.session
    _detail(b.call(ds, "__len__"), 404)
    assert a.result(ds, "__len__") == len(ROWS)  # still A's
    _detail(a.call("pid:" + "0" * 32, "__len__"), 404)
    del a.http.headers["X-Twinkle-Session-Id"]
    _detail(a.call(ds, "__len__"), 400, "X-Twinkle-Session-Id")


def test_refusals(a: Proc) -> None:
    ds = a.dataset()
    for dataset_id in ("ms://swift/self-cognition", "/etc/passwd", "../data", "hf://x/y"):
        _detail(a.create(processor_type="dataset", class_type="Dataset",
                         dataset_meta=meta(None, dataset_id=dataset_id)), 400, "only inline rows")
        _detail(a.call(ds, "add_dataset", dataset_meta=meta(None, dataset_id=dataset_id)), 400, "only inline rows")
    _detail(a.create(processor_type="dataset", class_type="Dataset", dataset_meta=json.dumps({"data": ROWS})), 400,
            "_TWINKLE_TYPE_")
    _detail(a.create(processor_type="dataset", class_type="Dataset", dataset_meta=meta(ROWS), streaming=True), 400,
            "unknown arguments")
    _detail(a.create(processor_type="dataset", class_type="StreamingDataset", dataset_meta=meta(ROWS)), 400,
            "accepted: Dataset, LazyDataset, IterableDataset, PackingDataset")
    _detail(a.create(processor_type="dataset", class_type="IterablePackingDataset", dataset_meta=meta(ROWS),
                     packing_interval=0), 400, "packing_interval")
    _detail(a.call(ds, "pack_dataset"), 400, "PackingDataset and IterablePackingDataset, not of Dataset")
    _detail(a.call(ds, "__next__"), 400, "IterableDataset")
    _detail(a.create(processor_type="dataset", class_type="ms://evil/plugin"), 400, "hub plugins")
    _detail(a.create(processor_type="reward", class_type="MathReward"), 400, "accepted: dataset, dataloader")
    _detail(a.create(processor_type="dataloader", class_type="DataLoader", dataset=ds, batch_size=2,
                     collate_fn="x"), 400, "collate_fn")
    _detail(a.create(processor_type="dataloader", class_type="DataLoader", dataset="not-a-pid", batch_size=2), 400,
            "pid:")
    _detail(a.call(ds, "save_as", output_path="/tmp/x.jsonl", format=None, batch_size=1000, mode="immediate"),
            400, "writes files on the server")
    _detail(a.call(ds, "__reduce__"), 400, "accepted: set_template, encode")
    _detail(a.call(ds, "encode"), 400, "set_template first")
    _detail(a.call(ds, "set_template", template_func="Template", trust_remote_code=True), 400, "trust_remote_code")
    _detail(a.call(ds, "set_template", template_func="ms://x/template"), 400, "hub plugins")
    a.result(ds, "set_template", template_func="Template")
    _detail(a.call(ds, "encode", add_generation_prompt=False, fn_kwargs={}), 400, "fn_kwargs")
    _detail(a.call(ds, "encode"), 400, "no `messages`", "SelfCognitionProcessor")
    _detail(a.call(ds, "map", preprocess_func="os.system"), 400, "accepted: SelfCognitionProcessor")
    _detail(a.call(ds, "map", preprocess_func="SelfCognitionProcessor", init_args={"model_name": "x", "evil": 1}),
            400, "evil")
    _detail(a.call(ds, "map", preprocess_func="CompetitionMathProcessor"), 400, "row 0", "problem")
    _detail(a.call(ds, "filter", filter_func="LengthFilter", dataset_meta=None, init_args=None), 400, "accepted: none")
    _detail(a.call(ds, "cast_column", column="image", decode=False), 400, "not offered")
    a.result(ds, "map", preprocess_func="SelfCognitionProcessor", init_args=IDENTITY)
    a.result(ds, "set_template", template_func="Template", max_length=8)
    _detail(a.call(ds, "encode"), 400, "row 0", "exceeds max_length 8")
    a.result(ds, "set_template", template_func="Template", max_length=8, truncation_strategy="delete")
    a.result(ds, "encode")
    assert a.result(ds, "__len__") == 0  # every row was longer than 8 tokens: dropped
    proc = a.new(processor_type="processor", class_type="InputProcessor", device_mesh=None, padding_free=False,
                 framework="transformers")
    _detail(a.call(proc, "__call__", inputs=[]), 400, "forward_backward")
    _detail(a.create(processor_type="processor", class_type="InputProcessor", framework="megatron"), 400,
            "framework")


def test_add_and_mix_datasets(a: Proc) -> None:
    ds = a.dataset(ROWS[:2])
    a.result(ds, "add_dataset", dataset_meta=meta(ROWS[2:5]))
    assert a.result(ds, "__len__") == 2  # upstream: the first dataset until mix_dataset
    _detail(a.call(ds, "map", preprocess_func="SelfCognitionProcessor"), 400, "holds 2 datasets")
    a.result(ds, "map", preprocess_func="SelfCognitionProcessor", dataset_meta=meta(ROWS[2:5]), init_args=IDENTITY)
    a.result(ds, "mix_dataset", interleave=False)
    rows = [a.result(ds, "__getitem__", idx=i) for i in range(5)]
    assert [r["query"] for r in rows] == [r["query"] for r in ROWS[:5]]
    assert ["messages" in r for r in rows] == [False, False, True, True, True]
    by_list = a.dataset(data_slice={"_slice_type_": "list", "values": [5, 0, 7]})  # 7 wraps to 1, as upstream
    assert [a.result(by_list, "__getitem__", idx=i)["query"] for i in range(3)] == [
        ROWS[5]["query"], ROWS[0]["query"], ROWS[1]["query"]]
    columns = a.new(processor_type="dataset", class_type="LazyDataset",
                    dataset_meta=meta({"query": ["q1", "q2"], "response": ["r1", "r2"]}))
    assert a.result(columns, "__getitem__", idx=1) == {"query": "q2", "response": "r2"}


def test_limits(server: ServerProcess) -> None:
    key = server.create_key("tenant-datasets-limits")
    c = Proc(server, key)
    _detail(c.create(processor_type="dataset", class_type="Dataset", dataset_meta=meta([{}] * 100_001)), 400,
            "at most 100000")
    big = "x" * (1 << 20)
    _detail(c.create(processor_type="dataset", class_type="Dataset", dataset_meta=meta([{"t": big}] * 33)), 429,
            "bytes")
    held = [c.dataset([{"i": 0}])]
    while True:
        r = c.create(processor_type="dataset", class_type="Dataset", dataset_meta=meta([{"i": len(held)}]))
        if r.status_code != 200:
            break
        held.append(r.json()["processor_id"])
    _detail(r, 429, "at most 20")
    assert len(held) == 20
    other = Proc(server, server.api_key_b)  # another tenant's quota is its own
    other.dataset()


def test_packing_and_iterable_datasets(a: Proc) -> None:
    ds = a.encoded(max_length=200, class_type="PackingDataset", packing_num_proc=1)
    lengths = [a.result(ds, "__getitem__", idx=i)["length"] for i in range(len(ROWS))]
    assert max(lengths) <= 100, lengths  # two or more rows fit a pack of 200 tokens
    assert a.result(ds, "pack_dataset") is None
    n = a.result(ds, "__len__")
    packs = [a.result(ds, "__getitem__", index=i) for i in range(n)]
    _detail(a.call(ds, "__getitem__", index=n), 410)
    assert n < len(ROWS) and sorted(q for p in packs for q in p["query"]) == sorted(r["query"] for r in ROWS)
    for p in packs:  # each pack: its rows joined, position_ids starting again at 0 for each row
        assert len(p["input_ids"]) == len(p["labels"]) == sum(p["length"]) <= 200
        assert p["position_ids"].count(0) == len(p["query"])
    assert sum(len(p["input_ids"]) for p in packs) == sum(lengths)
    # a DataLoader batches packs; forward_backward reads each pack back as its rows
    dl = a.new(processor_type="dataloader", class_type="DataLoader", dataset=ds, batch_size=2)
    a.result(dl, "__iter__")
    batch = a.result(dl, "__next__")
    setup_adapter(a, gas=1)
    out = a.ok("forward_backward", inputs=batch, adapter_name="default")["result"]
    assert len(out["logps"]) == sum(len(p["query"]) for p in batch)
    assert [len(x) for x in out["logps"]] == [length for p in batch for length in p["length"]]

    it = a.dataset(class_type="IterableDataset")
    for _ in range(2):  # __iter__ starts a pass again
        assert a.result(it, "__iter__") == "ok"
        assert [a.result(it, "__next__")["query"] for _ in ROWS] == [r["query"] for r in ROWS]
        _detail(a.call(it, "__next__"), 410, "have all been read")

    cyc = a.encoded(max_length=200, class_type="IterablePackingDataset", packing_interval=2, cyclic=True)
    _detail(a.call(cyc, "__iter__"), 400, "pack_dataset")
    a.result(cyc, "pack_dataset")
    total = a.result(cyc, "__len__")
    a.result(cyc, "__iter__")
    first = [a.result(cyc, "__next__")["query"] for _ in range(total)]
    windows = [{r["query"] for r in ROWS[i:i + 2]} for i in range(0, len(ROWS), 2)]
    assert all(any(set(q) <= w for w in windows) for q in first)  # packed within windows of 2 rows
    assert sorted(q for p in first for q in p) == sorted(r["query"] for r in ROWS)
    assert a.result(cyc, "__next__")["query"] == first[0]  # cyclic: no 410, the packs come round again
