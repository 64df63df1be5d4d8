"""The server-side-dataset flow of twinkle-kit's cookbook (`demo_server_dataset.py`, §6 of
../shared/reference/twinkle-native-protocol.md) with twinkle-kit 0.5.1's own, unmodified client:
`twinkle_client.dataset.Dataset` (rows sent inline in a DatasetMeta) -> set_template -> map(SelfCognitionProcessor) ->
encode on the server; `twinkle_client.dataloader.DataLoader` over it feeding `MultiLoraTransformersModel`. The encoded
rows must be what twinkle's own local Dataset / Template / DataLoader give for the same data; a pass ends with
StopIteration; state and resume; another tenant cannot reach the objects; refusals surface as HTTPError.
Run by scripts/test_native.sh (-k remote_dataset)."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import requests
from twinkle.dataset import DatasetMeta
from twinkle_client.dataloader import DataLoader
from twinkle_client.dataset import Dataset

from tests.native.conftest import MODEL_NAME, NativeServer
from tests.native.data import IDENTITY
from tests.native.test_twinkle_native import fb_loss, new_model

pytestmark = pytest.mark.timeout(300)

FEATURE = ("input_ids", "labels", "attention_mask", "position_ids", "length")


def remote_dataset(jsonl: Path) -> Dataset:
    rows = [json.loads(line) for line in jsonl.read_text().splitlines() if line.strip()]
    dataset = Dataset(DatasetMeta(data=rows))
    dataset.set_template("Template", model_id=f"ms://{MODEL_NAME}", max_length=128)
    dataset.map("SelfCognitionProcessor", init_args=IDENTITY)
    dataset.encode(batched=True, timeout=3600)
    return dataset


def test_remote_dataset_flow(native_server: NativeServer, connect: Callable[[str], Any], sc_jsonl: Path,
                             sc_batches: list[list[dict[str, Any]]]) -> None:
    srv = native_server
    connect(srv.api_key_a)  # type: ignore[attr-defined]
    dataset = remote_dataset(sc_jsonl)
    assert len(dataset) == 8
    first = dataset[0]
    assert first["query"] == "Who are you?" and first["messages"][-1] == {
        "role": "assistant", "content": "I am Blinky, an assistant trained by Tenant A Labs."}
    loader = DataLoader(dataset=dataset, batch_size=4, min_batch_size=None, drop_last=False, shuffle=False,
                        num_workers=0)
    assert len(loader) == 2

    # the same tokens, labels and fields as twinkle's own local Template / Dataset / DataLoader give
    remote = list(loader)  # __iter__, then __next__ until the 410 that the client turns into StopIteration
    assert [len(b) for b in remote] == [len(b) for b in sc_batches] == [4, 4]
    for rb, lb in zip(remote, sc_batches):
        for r, loc in zip(rb, lb):
            assert r["query"] == loc["query"]
            for key in FEATURE:
                expected = int(loc[key]) if key == "length" else [int(x) for x in loc[key]]
                assert r[key] == expected, key
            assert any(t != -100 for t in r["labels"])
    assert loader.get_state() == {"consumed_train_samples": 8}

    # train on the remote batches as they come: the loss is finite and falls
    model = new_model("remote-ds", gas=1)
    model.set_optimizer("AdamW", lr=3e-3)
    epochs = []
    for _ in range(4):
        losses = []
        for batch in loader:
            losses.append(fb_loss(model.forward_backward(inputs=batch)))
            model.clip_grad_and_step()
        assert len(losses) == 2
        epochs.append(sum(losses) / len(losses))
    assert all(math.isfinite(x) for x in epochs) and epochs[-1] < epochs[0], epochs
    assert loader.get_state() == {"consumed_train_samples": 8 + 4 * 8}

    # resume: the consumed rows of the interrupted pass are skipped (6 of 8: the rest of the second batch)
    loader.resume_from_checkpoint(6)
    rest = list(loader)
    assert [[r["query"] for r in b] for b in rest] == [[r["query"] for r in sc_batches[1][2:]]]
    assert len(list(loader)) == 2  # the pass after is whole again

    # a row past the end is StopIteration too: `for row in dataset` works on the client
    assert [row["query"] for row in dataset] == [r["query"] for b in sc_batches for r in b]

    with pytest.raises(requests.HTTPError, match="writes files on the server"):
        dataset.save_as("/tmp/leak.jsonl")
    with pytest.raises(requests.HTTPError, match="only inline rows"):
        Dataset(DatasetMeta("ms://swift/self-cognition"))
    with pytest.raises(requests.HTTPError, match="only inline rows"):
        Dataset(DatasetMeta(str(sc_jsonl)))  # a path (here one that exists on the server's machine too)
    with pytest.raises(requests.HTTPError, match="accepted: SelfCognitionProcessor"):
        dataset.map("ms://someone/evil_preprocessor")

    # tenant B's client: A's dataset and loader are not found
    connect(srv.api_key_b)  # type: ignore[attr-defined]
    for call in (lambda: len(dataset), lambda: next(iter(loader)), lambda: dataset[0]):
        with pytest.raises(requests.HTTPError, match="404"):
            call()
