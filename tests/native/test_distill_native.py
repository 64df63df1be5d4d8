"""GRPO with a KL penalty and GKD distillation with twinkle-kit 0.5.1's own, unmodified client: GRPOLoss(beta > 0)
with `ref_logps` from `forward_only(disable_lora=True)`, GKDLoss with the teacher's top-k read from a served model's
vLLMSampler (`prompt_logprobs=K`, `max_tokens=0`), and the server-side PackingDataset feeding forward_backward.
Run by scripts/test_native.sh (-k distill_native)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import requests
from twinkle.dataset import DatasetMeta
from twinkle_client.dataloader import DataLoader
from twinkle_client.dataset import PackingDataset
from twinkle_client.sampler import vLLMSampler

from tests.native.conftest import MODEL_NAME, NativeServer
from tests.native.data import IDENTITY
from tests.native.test_rl_native import new_model

pytestmark = pytest.mark.timeout(300)


def _seq_mean(values: list[list[float]], batch: list[dict[str, Any]]) -> float:
    return float(np.mean([np.mean([v for v, t in zip(vals, f["labels"]) if t != -100])
                          for vals, f in zip(values, batch)]))


def test_grpo_with_a_kl_penalty(native_server: NativeServer, connect: Callable[[str], Any],
                                sc_batches: list[list[dict[str, Any]]]) -> None:
    connect(native_server.api_key_a)  # type: ignore[attr-defined]
    batch, adv, beta = sc_batches[0], [1.0, 0.5, 0.25, -0.75], 0.2
    model = new_model("kl", "GRPOLoss", beta=beta)
    ref = model.forward_only(inputs=batch, disable_lora=True).result["logps"]
    with pytest.raises(requests.HTTPError) as err:  # beta > 0 needs the reference
        model.forward_backward(inputs=batch, advantages=adv)
    assert err.value.response is not None and err.value.response.status_code == 400
    first = model.forward_backward(inputs=batch, advantages=adv, ref_logps=ref).result
    assert float(first["loss"]) == pytest.approx(-0.25, abs=1e-5)  # the policy is the reference: no KL
    model.clip_grad_and_step()
    model.set_loss("CrossEntropyLoss")
    for _ in range(3):
        model.forward_backward(inputs=batch)
        model.clip_grad_and_step()
    model.set_loss("GRPOLoss", beta=beta)
    out = model.forward_backward(inputs=batch, advantages=adv, ref_logps=ref).result
    d = [[r - lp for r, lp in zip(rr, lr)] for rr, lr in zip(ref, out["logps"])]
    kl = _seq_mean([[np.exp(x) - x - 1 for x in row] for row in d], batch)
    assert kl > 1e-5
    assert float(out["loss"]) == pytest.approx(-0.25 + beta * kl, rel=1e-4, abs=1e-6)


def test_gkd_from_a_served_teacher(native_server: NativeServer, connect: Callable[[str], Any],
                                   sc_batches: list[list[dict[str, Any]]]) -> None:
    connect(native_server.api_key_a)  # type: ignore[attr-defined]
    batch, k = sc_batches[1], 4
    teacher = vLLMSampler(model_id=MODEL_NAME)  # any served model of the same tokenizer; here the base model
    answers = teacher.sample(inputs=batch, sampling_params={"max_tokens": 0, "prompt_logprobs": k})
    t_lp, t_ids = [], []
    for answer, row in zip(answers, batch):
        top = answer.topk_prompt_logprobs
        assert top is not None and len(top) == len(row["input_ids"]) and top[0] is None
        aligned = top[1:] + [[(0, 0.0)] * k]  # position i predicts token i + 1
        t_ids.append([[t for t, _ in pos] for pos in aligned])
        t_lp.append([[lp for _, lp in pos] for pos in aligned])
    kw = {"teacher_topk_logprobs": t_lp, "teacher_topk_indices": t_ids}
    assert abs(float(new_model("fresh", "GKDLoss").forward_backward(inputs=batch, **kw).result["loss"])) < 1e-4
    drift = new_model("drift", "CrossEntropyLoss")  # a student that drifted from the teacher (SFT on the rows)
    for _ in range(3):
        drift.forward_backward(inputs=batch)
        drift.clip_grad_and_step()
    path = drift.save(name="drifted").twinkle_path
    model = new_model("gkd", "GKDLoss", lr=2e-3, beta=0.5)  # its own optimizer, from the drifted weights
    model.load(path)
    losses = []
    for _ in range(4):
        losses.append(float(model.forward_backward(inputs=batch, **kw).result["loss"]))
        model.clip_grad_and_step()
    assert losses[0] > 1e-6 and losses[-1] < losses[0], losses


def test_server_side_packing_dataset(native_server: NativeServer, connect: Callable[[str], Any],
                                     sc_jsonl: Path) -> None:
    connect(native_server.api_key_a)  # type: ignore[attr-defined]
    rows = [json.loads(line) for line in sc_jsonl.read_text().splitlines() if line.strip()]
    dataset = PackingDataset(DatasetMeta(data=rows))
    dataset.set_template("Template", model_id=f"ms://{MODEL_NAME}", max_length=256)
    dataset.map("SelfCognitionProcessor", init_args=IDENTITY)
    dataset.encode(batched=True)
    dataset.pack_dataset()
    packs = [dataset[i] for i in range(len(dataset))]
    assert 1 <= len(packs) < len(rows)
    assert sorted(q for p in packs for q in p["query"]) == sorted(r["query"] for r in rows)
    model = new_model("packed", "CrossEntropyLoss")
    for batch in DataLoader(dataset=dataset, batch_size=2):
        out = model.forward_backward(inputs=batch).result
        assert [len(x) for x in out["logps"]] == [n for p in batch for n in p["length"]]
        model.clip_grad_and_step()
