"""The native losses added on top of the first set, over plain HTTP as twinkle_client sends them: GRPOLoss with a
KL penalty (beta > 0) to the reference logps of a `disable_lora` pass, GKDLoss with a teacher's top-k from a
served model's sampler (the base model, then a second served model of the same tokenizer), the cross-entropy
variants, the refused names, and packed rows read as their sequences."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from tests.support.native_http import Native, rows, setup_adapter
from tests.support.server import ServerProcess, student_teacher_server
from tests.support.tiny_model import build_tiny_model


def _seq_mean(values: list[list[float]], feats: list[dict]) -> float:
    """Upstream's GRPOLoss aggregation: the mean over each row's label tokens, then over the rows."""
    return float(np.mean([np.mean([v for v, t in zip(vals, f["labels"]) if t != -100])
                          for vals, f in zip(values, feats)]))


def test_grpo_kl_penalty_to_the_reference_pass(a: Native) -> None:
    setup_adapter(a, gas=1)
    a.ok("set_loss", loss_cls="GRPOLoss", adapter_name="default", beta=0.5)
    feats, adv = rows(seed=21, n=2), [1.0, 0.5]
    missing = a.op("forward_backward", inputs=feats, adapter_name="default", advantages=adv)
    assert missing.status_code == 400 and "ref_logps" in missing.json()["detail"]
    ref = a.ok("forward_only", inputs=feats, adapter_name="default", disable_lora=True)["result"]["logps"]
    # a fresh adapter is the base model: no KL, the value is -mean(A) at ratio 1
    first = a.ok("forward_backward", inputs=feats, adapter_name="default", advantages=adv, ref_logps=ref)["result"]
    assert first["loss"] == pytest.approx(-0.75, abs=1e-5)
    a.ok("clip_grad_and_step", adapter_name="default")
    for _ in range(2):  # move away from the reference, then the KL term is the k3 estimate on the pass's logps
        a.ok("set_loss", loss_cls="CrossEntropyLoss", adapter_name="default")
        a.ok("forward_backward", inputs=feats, adapter_name="default")
        a.ok("clip_grad_and_step", adapter_name="default")
    a.ok("set_loss", loss_cls="GRPOLoss", adapter_name="default", beta=0.5)
    out = a.ok("forward_backward", inputs=feats, adapter_name="default", advantages=adv, ref_logps=ref)["result"]
    d = [[r - lp for r, lp in zip(rr, lr)] for rr, lr in zip(ref, out["logps"])]
    kl = _seq_mean([[np.exp(x) - x - 1 for x in row] for row in d], feats)
    assert kl > 1e-3
    assert out["loss"] == pytest.approx(-0.75 + 0.5 * kl, rel=1e-4, abs=1e-5)
    assert np.isfinite(float(a.ok("clip_grad_and_step", adapter_name="default")["result"]))


def _teacher_topk(a: Native, teacher: str, feats: list[dict], k: int) -> tuple[list, list]:
    """A served teacher's top-k per position, aligned to the shifted labels: position i predicts token i + 1,
    whose prompt logprobs the sampler reports at i + 1 (the last position has none and no label)."""
    r = a.http.post(f"/sampler/{teacher}/twinkle/sample", json={
        "inputs": feats, "sampling_params": {"max_tokens": 0, "prompt_logprobs": k}})
    assert r.status_code == 200, r.text
    lps, ids = [], []
    for sample, f in zip(r.json()["samples"], feats):
        top = sample["topk_prompt_logprobs"][1:] + [[[0, 0.0]] * k]
        assert len(top) == len(f["input_ids"])
        ids.append([[t for t, _ in pos] for pos in top])
        lps.append([[lp for _, lp in pos] for pos in top])
    return lps, ids


def test_gkd_distils_a_served_teacher(a: Native) -> None:
    setup_adapter(a, gas=1)
    a.ok("set_loss", loss_cls="GKDLoss", adapter_name="default", beta=0.5, temperature=1.0)
    feats = rows(seed=23, n=2)
    t_lp, t_ids = _teacher_topk(a, a.model, feats, 4)  # the teacher: the base model, served by its sampler
    kw = {"teacher_topk_logprobs": t_lp, "teacher_topk_indices": t_ids}
    # the fresh student is the base model: no divergence (the positions line up)
    plain = a.ok("forward_only", inputs=feats, adapter_name="default")["result"]  # forward_only: CE
    first = a.ok("forward_backward", inputs=feats, adapter_name="default", **kw)["result"]
    assert abs(first["loss"]) < 1e-4
    for x, y in zip(first["logps"], plain["logps"]):  # the labels' logps, as upstream's pass returns them
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6)
    setup_adapter(a, "drift", gas=1)  # a student that drifted from the teacher (SFT on the rows)
    for _ in range(3):
        a.ok("forward_backward", inputs=feats, adapter_name="drift")
        a.ok("clip_grad_and_step", adapter_name="drift")
    path = a.ok("save", name="drifted", adapter_name="drift")["twinkle_path"]
    setup_adapter(a, "gkd", gas=1)  # its own optimizer, from the drifted weights
    a.ok("set_loss", loss_cls="GKDLoss", adapter_name="gkd", beta=0.5)
    a.ok("set_optimizer", optimizer_cls="AdamW", adapter_name="gkd", lr=2e-3)
    a.ok("load", name=path, adapter_name="gkd")
    losses = []
    for _ in range(4):  # distillation pulls it back towards the teacher
        losses.append(a.ok("forward_backward", inputs=feats, adapter_name="gkd", **kw)["result"]["loss"])
        a.ok("clip_grad_and_step", adapter_name="gkd")
    assert losses[0] > 1e-3 and losses[-1] < losses[0], losses
    bad = a.op("forward_backward", inputs=feats, adapter_name="gkd", teacher_logits=[[[0.0]]])
    assert bad.status_code == 400 and "teacher_topk_logprobs" in bad.json()["detail"]


def test_cross_entropy_variants_and_refused_names(a: Native) -> None:
    setup_adapter(a, gas=1)
    feats = rows(seed=25, n=2)
    a.ok("set_loss", loss_cls="CrossEntropyLoss", adapter_name="default", reduction="mean")
    plain = a.ok("forward_backward", inputs=feats, adapter_name="default")["result"]["loss"]
    a.ok("zero_grad", adapter_name="default")
    a.ok("set_loss", loss_cls="ChunkedCrossEntropyLoss", adapter_name="default", chunk_size=64)
    assert a.ok("forward_backward", inputs=feats, adapter_name="default")["result"]["loss"] == pytest.approx(plain)
    a.ok("zero_grad", adapter_name="default")
    a.ok("set_loss", loss_cls="LigerFusedLinearCrossEntropyLoss", adapter_name="default")  # sum by default
    summed = a.ok("forward_backward", inputs=feats, adapter_name="default")["result"]["loss"]
    assert summed == pytest.approx(plain * sum(t != -100 for f in feats for t in f["labels"]), rel=1e-5)
    for slot, name, word in (("set_loss", "MSELoss", "regression head"), ("set_loss", "PPOValueLoss", "value head"),
                             ("set_loss", "InfonceLoss", "embeddings"),
                             ("set_template", "DeepseekV4Template", "DeepSeek-V4")):
        field = "loss_cls" if slot == "set_loss" else "template_cls"
        r = a.op(slot, adapter_name="default", **{field: name})
        assert r.status_code == 400 and word in r.json()["detail"] and "accepted:" in r.json()["detail"], r.text
    r = a.op("set_loss", loss_cls="LigerFusedLinearCrossEntropyLoss", adapter_name="default", label_smoothing=0.1)
    assert r.status_code == 400 and "label_smoothing" in r.json()["detail"]


def test_a_packed_row_is_read_as_its_sequences(a: Native) -> None:
    setup_adapter(a, gas=1)
    one, two = rows(seed=27, n=2)
    packed = {k: one[k] + two[k] for k in ("input_ids", "labels", "attention_mask", "position_ids")}
    alone = a.ok("forward_only", inputs=[one, two], adapter_name="default")["result"]
    joined = a.ok("forward_only", inputs=[packed], adapter_name="default")["result"]
    assert len(joined["logps"]) == 2
    for x, y in zip(joined["logps"], alone["logps"]):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6)
    assert joined["loss"] == pytest.approx(alone["loss"], rel=1e-5)


@pytest.fixture(scope="module")
def student_and_teacher(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """Two served models of one tokenizer: the student (the tiny model) and a teacher of other weights."""
    teacher = build_tiny_model(tmp_path_factory.mktemp("teacher") / "model", seed=7, logit_scale=4.0)  # peaked
    srv = student_teacher_server(tmp_path_factory.mktemp("gkd-server"), tiny_model_dir, teacher, ("student", "teacher"))
    yield srv
    srv.stop()


def test_gkd_between_two_served_models(student_and_teacher: ServerProcess) -> None:
    s = Native(student_and_teacher, student_and_teacher.api_key_a)  # type: ignore[attr-defined]
    s.model = "student"
    setup_adapter(s, gas=1)
    s.ok("set_loss", loss_cls="GKDLoss", adapter_name="default", beta=0.5)
    s.ok("set_optimizer", optimizer_cls="AdamW", adapter_name="default", lr=3e-3)
    s.ok("set_lr_scheduler", scheduler_cls="constant", adapter_name="default")
    feats = rows(seed=29, n=2)
    t_lp, t_ids = _teacher_topk(s, "teacher", feats, 8)
    kw = {"teacher_topk_logprobs": t_lp, "teacher_topk_indices": t_ids}
    losses = []
    for _ in range(8):
        losses.append(s.ok("forward_backward", inputs=feats, adapter_name="default", **kw)["result"]["loss"])
        s.ok("clip_grad_and_step", adapter_name="default")
    # the student moves towards the teacher (one run: 0.0098 -> 0.00056 over 8 steps)
    assert losses[0] > 5e-3 and losses[-1] < 0.25 * losses[0], losses
    assert all(b < a for a, b in zip(losses, losses[1:])), losses
    assert float(s.ok("calculate_metric", is_training=True, adapter_name="default")["result"]["loss"]) > 0
    # the split form: forward, calculate_loss (the teacher's top-k as its kwargs), backward
    s.ok("forward", inputs=feats, adapter_name="default")
    split = s.ok("calculate_loss", adapter_name="default", **kw)["result"]
    s.ok("backward", adapter_name="default")
    s.ok("zero_grad", adapter_name="default")
    again = s.ok("forward_backward", inputs=feats, adapter_name="default", **kw)["result"]["loss"]
    assert float(split) == pytest.approx(again, rel=1e-5)
