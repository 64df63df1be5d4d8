"""The native GRPO family's KL penalty (beta > 0) and GKDLoss with a teacher's top-k equal upstream's formulas
(twinkle.loss.grpo / twinkle.loss.gkd, transcribed; fp64 on random inputs, the job's float32 arrays widened)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from api_schemas.losses import LossSpecError, validate_loss_request
from api_schemas.native.features import Feature
from server.errors import BadRequest
from server.services.native.losses import SEQUENCE_MEAN, TOKEN_MEAN, gkd_datums, grpo_datums
from tests.unit.test_native_losses import _family_reference, _features
from workers.engine.losses import compute_loss


def _job_inputs(batch) -> list[dict[str, torch.Tensor]]:  # type: ignore[no-untyped-def]
    return [{k: torch.from_numpy(np.asarray(v)).to(torch.float64) if np.asarray(v).dtype.kind == "f"
             else torch.from_numpy(np.asarray(v)) for k, v in x.items()} for _, x in batch.datums]


def _kl_reference(loss: str, mode: str | None, lps: list[torch.Tensor], feats: list[Feature],
                  ref: list[torch.Tensor], max_len: int) -> torch.Tensor:
    """Upstream's beta-free KL part: per token exp(ref - lp) - (ref - lp) - 1, aggregated as the class does."""
    toks, masks = [], []
    for lp, f, r in zip(lps, feats, ref):
        m = torch.from_numpy(f.mask).to(torch.float64)
        toks.append(((torch.exp(r - lp) - (r - lp) - 1) * m).sum())
        masks.append(m.sum())
    if loss in ("BNPOLoss", "CISPOLoss") or (loss == "PPOLoss" and mode == "token-mean"):
        return torch.stack(toks).sum() / torch.stack(masks).sum()
    if loss == "DRGRPOLoss":
        return torch.stack(toks).sum() / (len(feats) * max_len)
    return torch.stack([t / c for t, c in zip(toks, masks)]).mean()


@pytest.mark.parametrize("with_old", [True, False])
@pytest.mark.parametrize("loss,mode", [("GRPOLoss", None), ("PPOLoss", "token-mean"), ("GSPOLoss", None),
                                       ("CISPOLoss", None), ("DRGRPOLoss", None), ("SAPOLoss", None)])
def test_kl_penalty_equals_upstream(loss: str, mode: str | None, with_old: bool) -> None:
    beta = 0.04 if loss != "SAPOLoss" else 0.3
    feats = _features(11)
    g = torch.Generator().manual_seed(12)
    lps = [(-torch.rand(len(f.input_ids), generator=g, dtype=torch.float64) * 2).requires_grad_(True) for f in feats]
    adv = [0.8, -1.1, 0.4, -0.2]
    # float32-exact reference logps: the job carries float32, the reference uses the same numbers
    ref_full = [(lp.detach() + torch.randn(lp.shape, generator=g, dtype=torch.float64) * 0.5).float().double()
                for lp in lps]
    ref_sent = [torch.where(torch.from_numpy(f.mask), r, torch.zeros_like(r)) for r, f in zip(ref_full, feats)]
    old = ([(lp.detach() + torch.randn(lp.shape, generator=g, dtype=torch.float64) * 0.25).float().double()
            for lp in lps] if with_old else None)
    old_resp = [o[torch.from_numpy(f.mask)].tolist() for o, f in zip(old, feats)] if old is not None else None
    aggregation = None if mode is None else TOKEN_MEAN if mode == "token-mean" else SEQUENCE_MEAN
    batch = grpo_datums(feats, adv, old_resp, epsilon=0.2, epsilon_high=0.28, loss=loss, aggregation=aggregation,
                        max_completion_length=16, tau_pos=1.5, tau_neg=0.5, beta=beta,
                        ref_logps=[r.tolist() for r in ref_full])  # the full-sequence form, as forward_only gives
    inputs = _job_inputs(batch)
    for x, r in zip(inputs, ref_sent):
        torch.testing.assert_close(x["kl_ref_logprobs"], r, rtol=0, atol=0)
    out = compute_loss(batch.loss_fn, lps, inputs, batch.config)
    old_sent = ([torch.where(torch.from_numpy(f.mask), o, torch.zeros_like(o)) for o, f in zip(old, feats)]
                if old is not None else None)
    expect = (_family_reference(loss, lps, feats, adv, old_sent, 0.2, 0.28, mode, 16)
              + beta * _kl_reference(loss, mode, lps, feats, ref_sent, 16))
    reported = float(out.loss.detach()) if batch.value is None else batch.value + out.metrics["kl:sum"]
    assert reported == pytest.approx(float(expect.detach()), rel=1e-6, abs=1e-7)
    for a, b in zip(torch.autograd.grad(out.loss, lps), torch.autograd.grad(expect, lps)):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-9)


def test_kl_needs_reference_logps_and_is_native_only() -> None:
    feats = _features(2)
    with pytest.raises(BadRequest, match="ref_logps"):
        grpo_datums(feats, [1.0] * len(feats), None, epsilon=0.2, epsilon_high=0.2, beta=0.1)
    assert all("kl_weights" not in x for _, x in grpo_datums(feats, [1.0] * 4, None, epsilon=0.2,
                                                             epsilon_high=0.2).datums)  # beta 0: no KL inputs
    keys = {"target_tokens", "logprobs", "advantages", "kl_ref_logprobs", "kl_weights"}
    with pytest.raises(LossSpecError, match="does not use"):  # a Tinker client cannot send them
        validate_loss_request("ppo", [keys], {})
    validate_loss_request("ppo", [keys], {}, engine=True)
    lp = torch.zeros(3, dtype=torch.float64)
    with pytest.raises(LossSpecError, match="together"):
        compute_loss("cross_entropy", [lp], [{"target_tokens": torch.zeros(3, dtype=torch.int64),
                                               "weights": torch.ones(3, dtype=torch.float64),
                                               "kl_weights": torch.ones(3, dtype=torch.float64)}], {})


def test_kl_ignores_positions_off_the_labels() -> None:
    """A prompt token of logprob -200 (exp(200) overflows float32) adds nothing: its KL weight is 0."""
    lp = torch.tensor([-200.0, -1.0, -2.0], requires_grad=True)
    x = {"target_tokens": torch.zeros(3, dtype=torch.int64), "weights": torch.tensor([0.0, 1.0, 1.0]),
         "kl_ref_logprobs": torch.tensor([0.0, -1.5, -1.0]), "kl_weights": torch.tensor([0.0, 0.5, 0.5])}
    out = compute_loss("cross_entropy", [lp], [x], {})
    assert torch.isfinite(out.loss)
    (grad,) = torch.autograd.grad(out.loss, [lp])
    assert torch.isfinite(grad).all() and float(grad[0]) == 0.0


def _gkd_reference(logits: torch.Tensor, labels: torch.Tensor, t_lp: torch.Tensor, t_ids: torch.Tensor,
                   beta: float, temperature: float) -> torch.Tensor:
    """twinkle.loss.gkd GKDLoss._generalized_jsd_loss, remote-teacher (top-k) mode, transcribed."""
    s = torch.gather(logits, -1, t_ids) / temperature
    t = t_lp / temperature
    mask = labels != -100
    s, t = s[mask], t[mask]
    s_lp, q = F.log_softmax(s, -1), F.log_softmax(t, -1)
    if beta == 0:
        jsd = F.kl_div(s_lp, q, reduction="none", log_target=True)
    elif beta == 1:
        jsd = F.kl_div(q, s_lp, reduction="none", log_target=True)
    else:
        b = torch.tensor(beta, dtype=s.dtype)
        m = torch.logsumexp(torch.stack([s_lp + torch.log1p(-b), q + torch.log(b)]), dim=0)
        jsd = b * F.kl_div(m, q, reduction="none", log_target=True) + (1 - b) * F.kl_div(
            m, s_lp, reduction="none", log_target=True)
    return jsd.sum() / mask.sum()


@pytest.mark.parametrize("beta,temperature,response_only", [(0.5, 1.0, False), (0.0, 1.0, True),
                                                            (1.0, 2.0, False), (0.3, 0.7, True)])
def test_gkd_equals_upstream(beta: float, temperature: float, response_only: bool) -> None:
    vocab, k = 60, 5  # the rows' token ids are below 50
    feats = _features(21, rows=3, t=8)
    g = torch.Generator().manual_seed(22)
    logits = torch.randn(len(feats), 8, vocab, generator=g, dtype=torch.float64, requires_grad=True)
    teacher = torch.log_softmax(torch.randn(len(feats), 8, vocab, generator=g, dtype=torch.float64), -1)
    t_lp, t_ids = torch.topk(teacher, k, dim=-1)
    t_lp = t_lp.float().double()  # float32-exact, as the job carries them
    labels = torch.stack([torch.from_numpy(f.labels) for f in feats])
    masks = [torch.from_numpy(f.mask) for f in feats]
    send_lp = [(t_lp[i][masks[i]] if response_only else t_lp[i]).tolist() for i in range(len(feats))]
    send_ids = [(t_ids[i][masks[i]] if response_only else t_ids[i]).tolist() for i in range(len(feats))]
    batch = gkd_datums(feats, send_lp, send_ids, vocab_size=vocab, beta=beta, temperature=temperature)
    assert batch.loss_fn == "gkd"
    inputs = _job_inputs(batch)
    # the engine's learner logprobs of the (positions, 1 + K) targets: the student's log-softmax at those ids
    lps = [torch.gather(torch.log_softmax(logits[i], -1), -1, x["target_tokens"]) for i, x in enumerate(inputs)]
    out = compute_loss("gkd", lps, inputs, batch.config)
    expect = _gkd_reference(logits, labels, t_lp, t_ids, beta, temperature)
    assert float(out.loss.detach()) == pytest.approx(float(expect.detach()), rel=1e-6, abs=1e-9)
    torch.testing.assert_close(torch.autograd.grad(out.loss, [logits])[0], torch.autograd.grad(expect, [logits])[0],
                               rtol=1e-6, atol=1e-9)


def test_gkd_refusals() -> None:
    feats = _features(3, rows=2, t=6)
    n = [len(f.input_ids) for f in feats]
    good_ids = [[[0, 1]] * m for m in n]
    good_lp = [[[-0.5, -1.0]] * m for m in n]
    cases = [
        (None, good_ids, "teacher_topk_logprobs and teacher_topk_indices"),
        (good_lp, [[[0, 99]] * m for m in n], r"token ids in \[0, 30\)"),
        ([[[-0.5]] * m for m in n], good_ids, "same K"),
        ([[[-0.5, -1.0]] * 2 for _ in n], [[[0, 1]] * 2 for _ in n], "positions"),
        ([[[-0.5, None]] * m for m in n], good_ids, "lists of numbers"),
        (good_lp, [[[0, 1.5]] * m for m in n], "lists of integers"),
        (good_lp, [[[True, False]] * m for m in n], "lists of integers"),
        ([[[-0.5, -1.0], [-0.5]] for _ in n], good_ids, "lists of numbers"),
        ([[[float("nan"), -1.0]] * m for m in n], good_ids, "finite"),
    ]
    for lp, ids, match in cases:
        with pytest.raises(BadRequest, match=match):
            gkd_datums(feats, lp, ids, vocab_size=30, beta=0.5, temperature=1.0)
    with pytest.raises(LossSpecError, match="unknown loss_fn 'gkd'"):  # native only
        validate_loss_request("gkd", [{"target_tokens", "teacher_logprobs", "weights"}], {})
    flat = torch.zeros(4, dtype=torch.float64)
    with pytest.raises(LossSpecError, match=r"\(positions, 1 \+ K\)"):
        compute_loss("gkd", [flat], [{"target_tokens": torch.zeros(4, dtype=torch.int64), "teacher_logprobs": flat,
                                      "weights": flat}], {})
    with pytest.raises(LossSpecError, match="beta must be in"):
        validate_loss_request("gkd", [{"target_tokens", "teacher_logprobs", "weights"}], {"beta": 2.0}, engine=True)
