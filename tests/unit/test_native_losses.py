"""The native protocol's losses equal their documented formulas (fp64, random inputs): DPOLoss as the engine's `dpo`
loss, GRPOLoss as the gateway's mapping onto `ppo` (per-sequence mean, then batch mean) and, without old logps,
onto `cross_entropy` with the same gradient."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from api_schemas.losses import LossSpecError, validate_loss_request
from server.services.native.losses import grpo_datums
from api_schemas.native.features import Feature
from workers.engine.losses import compute_loss


def _pairs(seed: int, n: int = 6, t: int = 9) -> tuple[list[torch.Tensor], list[dict[str, torch.Tensor]]]:
    g = torch.Generator().manual_seed(seed)
    lps = [(-torch.rand(t, generator=g, dtype=torch.float64) * 3).requires_grad_(True) for _ in range(n)]
    inputs = []
    for _ in range(n):
        w = (torch.rand(t, generator=g) > 0.3).to(torch.float64)
        inputs.append({"target_tokens": torch.zeros(t, dtype=torch.int64), "weights": w,
                       "ref_logprobs": -torch.rand(t, generator=g, dtype=torch.float64) * 3})
    return lps, inputs


@pytest.mark.parametrize("beta,ls,sft", [(0.1, 0.0, 0.0), (0.5, 0.2, 0.0), (0.1, 0.0, 1.0)])
def test_dpo_equals_its_formula(beta: float, ls: float, sft: float) -> None:
    lps, inputs = _pairs(0)
    out = compute_loss("dpo", lps, inputs, {"beta": beta, "label_smoothing": ls, "sft_weight": sft,
                                            "loss_type": "sigmoid"})
    s = torch.stack([(lp * x["weights"]).sum() for lp, x in zip(lps, inputs)])
    r = torch.stack([(x["ref_logprobs"] * x["weights"]).sum() for x in inputs])
    logits = beta * ((s[0::2] - r[0::2]) - (s[1::2] - r[1::2]))
    expect = ((1 - ls) * -F.logsigmoid(logits) + ls * -F.logsigmoid(-logits)).mean()
    if sft:
        chosen_tokens = sum(float(x["weights"].sum()) for x in inputs[0::2])
        expect = expect + sft * -s[0::2].sum() / chosen_tokens
    assert float(out.loss.detach()) == pytest.approx(float(expect.detach()), rel=1e-12)
    got = torch.autograd.grad(out.loss, lps)
    want = torch.autograd.grad(expect, lps)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)


def test_dpo_needs_pairs_and_is_native_only() -> None:
    lps, inputs = _pairs(1, n=3)
    with pytest.raises(LossSpecError, match="pairs"):
        compute_loss("dpo", lps, inputs, {"loss_type": "sigmoid"})
    with pytest.raises(LossSpecError, match="unknown loss_fn 'dpo'"):  # a Tinker client cannot name it
        validate_loss_request("dpo", [{"target_tokens", "weights", "ref_logprobs"}], {})


def _features(seed: int, rows: int = 4, t: int = 10) -> list[Feature]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(rows):
        ids = rng.integers(0, 50, size=t)
        labels = np.full(t, -100)
        start = 3 + i % 3
        labels[start:-1] = ids[start + 1:]
        out.append(Feature(ids.astype(np.int64), labels.astype(np.int64)))
    return out


def _grpo_reference(lps: list[torch.Tensor], feats: list[Feature], adv: list[float], old: list[torch.Tensor] | None,
                    eps: float, eps_high: float) -> torch.Tensor:
    """Upstream GRPOLoss (beta 0): per-token -min(r A, clip(r) A), mean per sequence, mean over the batch."""
    per_seq = []
    for lp, f, a, i in zip(lps, feats, adv, range(len(feats))):
        m = torch.from_numpy(f.mask).to(torch.float64)
        ratio = torch.exp(lp - (old[i] if old is not None else lp.detach()))
        tok = -torch.min(ratio * a, torch.clamp(ratio, 1 - eps, 1 + eps_high) * a)
        per_seq.append((tok * m).sum() / m.sum().clamp(min=1))
    return torch.stack(per_seq).mean()


@pytest.mark.parametrize("with_old", [True, False])
def test_grpo_mapping_equals_upstream_formula(with_old: bool) -> None:
    feats = _features(0)
    g = torch.Generator().manual_seed(3)
    lps = [(-torch.rand(len(f.input_ids), generator=g, dtype=torch.float64) * 2).requires_grad_(True) for f in feats]
    adv = [1.5, -0.5, 0.25, -1.0]
    old_full = [lp.detach() + torch.randn(lp.shape, generator=g, dtype=torch.float64) * 0.3 for lp in lps]
    old_resp = [o[torch.from_numpy(f.mask)].tolist() for o, f in zip(old_full, feats)] if with_old else None
    batch = grpo_datums(feats, adv, old_resp, epsilon=0.2, epsilon_high=0.28)
    assert batch.loss_fn == ("ppo" if with_old else "cross_entropy")
    # fp64 throughout: the batch's float32 inputs are widened from the same numbers the reference uses
    inputs = [{k: torch.from_numpy(np.asarray(v)) for k, v in x.items()} for _, x in batch.datums]
    if with_old:
        for x, o, f in zip(inputs, old_full, feats):
            want = torch.where(torch.from_numpy(f.mask), o, torch.zeros_like(o))
            torch.testing.assert_close(x["logprobs"].to(torch.float64), want, rtol=1e-6, atol=1e-6)
            x["logprobs"] = want
    for x, f, a in zip(inputs, feats, adv):
        s = 1.0 / (int(f.mask.sum()) * len(feats))
        key = "advantages" if with_old else "weights"
        want = torch.from_numpy(f.mask).to(torch.float64) * a * s
        torch.testing.assert_close(x[key].to(torch.float64), want, rtol=1e-6, atol=1e-9)  # what the batch sends
        x[key] = want
    out = compute_loss(batch.loss_fn, lps, inputs, batch.config)
    value = batch.value
    ref = _grpo_reference(lps, feats, adv, [torch.where(torch.from_numpy(f.mask), o, torch.zeros_like(o))
                                               for o, f in zip(old_full, feats)] if with_old else None, 0.2, 0.28)
    reported = float(out.loss.detach()) if value is None else value
    assert reported == pytest.approx(float(ref), rel=1e-9)
    for a, b in zip(torch.autograd.grad(out.loss, lps), torch.autograd.grad(ref, lps)):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("summed", [True, False])
def test_cross_entropy_mapping_equals_upstream_formula(summed: bool) -> None:
    """Upstream CrossEntropyLoss: -sum(mask * logp) (`sum`) or that over mask.sum() for the whole batch (`mean`)."""
    from server.services.native.losses import cross_entropy

    feats = _features(5)
    g = torch.Generator().manual_seed(8)
    lps = [(-torch.rand(len(f.input_ids), generator=g, dtype=torch.float64) * 2).requires_grad_(True) for f in feats]
    batch = cross_entropy(feats, summed)
    assert batch.loss_fn == "cross_entropy" and batch.value is None
    inputs = [{k: torch.from_numpy(np.asarray(v)) for k, v in x.items()} for _, x in batch.datums]
    for x, f in zip(inputs, feats):
        assert torch.equal(x["target_tokens"], torch.from_numpy(np.where(f.mask, f.labels, 0)))
        x["weights"] = x["weights"].to(torch.float64)
    out = compute_loss("cross_entropy", lps, inputs, {})
    masks = [torch.from_numpy(f.mask).to(torch.float64) for f in feats]
    total = -sum((lp * m).sum() for lp, m in zip(lps, masks))
    expect = total if summed else total / sum(m.sum() for m in masks)
    assert float(out.loss.detach()) == pytest.approx(float(expect.detach()), rel=1e-6)
    for a, b in zip(torch.autograd.grad(out.loss, lps), torch.autograd.grad(expect, lps)):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-9)


def _family_reference(loss: str, lps: list[torch.Tensor], feats: list[Feature], adv: list[float],
                      old: list[torch.Tensor] | None, eps: float, eps_high: float, mode: str | None,
                      max_len: int) -> torch.Tensor:
    """Upstream twinkle.loss.grpo (beta 0), transcribed: the per-token term, then the class's aggregation."""
    sums, counts = [], []
    for i, (lp, f, a) in enumerate(zip(lps, feats, adv)):
        m = torch.from_numpy(f.mask).to(torch.float64)
        q = old[i] if old is not None else lp.detach()
        log_ratio = torch.clamp(lp - q, -20.0, 20.0)
        if loss == "GSPOLoss":
            log_ratio = (log_ratio * m).sum() / m.sum().clamp(min=1.0)
        ratio = torch.exp(log_ratio)
        if loss == "CISPOLoss":
            tok = -torch.clamp(ratio, max=1 + eps).detach() * a * lp
        elif loss == "SAPOLoss":  # tau_pos 1.5, tau_neg 0.5
            gate = torch.sigmoid(1.5 * (ratio - 1)) * (4.0 / 1.5) if a > 0 else torch.sigmoid(0.5 * (ratio - 1)) * 8.0
            tok = -gate * a
        else:
            tok = -torch.min(ratio * a, torch.clamp(ratio, 1 - eps, 1 + eps_high) * a)
        tok = tok * torch.ones_like(lp)
        sums.append((tok * m).sum())
        counts.append(m.sum())
    total = torch.stack(sums).sum()
    if loss in ("BNPOLoss", "CISPOLoss") or (loss == "PPOLoss" and mode == "token-mean"):
        return total / torch.stack(counts).sum().clamp(min=1.0)
    if loss == "DRGRPOLoss":
        return total / (len(feats) * max_len)
    return torch.stack([s / c.clamp(min=1.0) for s, c in zip(sums, counts)]).mean()


@pytest.mark.parametrize("with_old", [True, False])
@pytest.mark.parametrize("loss,mode", [("GRPOLoss", None), ("PPOLoss", "token-mean"),
                                       ("PPOLoss", "seq-mean-token-mean"), ("GSPOLoss", None), ("CISPOLoss", None),
                                       ("BNPOLoss", None), ("DRGRPOLoss", None), ("SAPOLoss", None)])
def test_policy_loss_family_equals_upstream(loss: str, mode: str | None, with_old: bool) -> None:
    from server.services.native.losses import SEQUENCE_MEAN, TOKEN_MEAN

    feats = _features(3)
    g = torch.Generator().manual_seed(4)
    lps = [(-torch.rand(len(f.input_ids), generator=g, dtype=torch.float64) * 2).requires_grad_(True) for f in feats]
    adv = [1.2, -0.7, 0.3, -0.9]
    old = ([lp.detach() + torch.randn(lp.shape, generator=g, dtype=torch.float64) * 0.25 for lp in lps]
           if with_old else None)
    old_resp = [o[torch.from_numpy(f.mask)].tolist() for o, f in zip(old, feats)] if old is not None else None
    aggregation = None if mode is None else TOKEN_MEAN if mode == "token-mean" else SEQUENCE_MEAN
    batch = grpo_datums(feats, adv, old_resp, epsilon=0.2, epsilon_high=0.28, loss=loss, aggregation=aggregation,
                        max_completion_length=16, tau_pos=1.5, tau_neg=0.5)
    inputs = [{k: torch.from_numpy(np.asarray(v)).to(torch.float64) if np.asarray(v).dtype.kind == "f"
               else torch.from_numpy(np.asarray(v)) for k, v in x.items()} for _, x in batch.datums]
    out = compute_loss(batch.loss_fn, lps, inputs, batch.config)
    old_sent = ([torch.where(torch.from_numpy(f.mask), o, torch.zeros_like(o)) for o, f in zip(old, feats)]
                if old is not None else None)
    ref = _family_reference(loss, lps, feats, adv, old_sent, 0.2, 0.28, mode, 16)
    reported = float(out.loss.detach()) if batch.value is None else batch.value
    # the job carries float32 arrays: terms of either sign cancel, so the bound is absolute as well (|terms| ~ 1)
    assert reported == pytest.approx(float(ref.detach()), rel=1e-6, abs=1e-7)
    for a, b in zip(torch.autograd.grad(out.loss, lps), torch.autograd.grad(ref, lps)):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-9)


def _log1mexp(x: torch.Tensor) -> torch.Tensor:
    x = torch.clamp(x, max=-1e-7)
    return torch.where(x > -np.log(2.0), torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))


def _preference_reference(name: str, args: dict, lps: list[torch.Tensor], feats: list[Feature],
                          ref: list[torch.Tensor]) -> torch.Tensor:
    """Upstream twinkle.loss.dpo, transcribed (pairs interleaved chosen, rejected)."""
    masks = [torch.from_numpy(f.mask).to(torch.float64) for f in feats]
    seq = torch.stack([(lp * m).sum() for lp, m in zip(lps, masks)])
    avg = torch.stack([(lp * m).sum() / m.sum().clamp(min=1) for lp, m in zip(lps, masks)])
    refs = torch.stack([(r * m).sum() for r, m in zip(ref, masks)])
    chosen_nll = -sum((lp * m).sum() for lp, m in zip(lps[0::2], masks[0::2])) / sum(m.sum() for m in masks[0::2])
    if name == "SimPOLoss":
        return -F.logsigmoid(args["beta"] * (avg[0::2] - avg[1::2]) - args["gamma"]).mean()
    if name == "CPOLoss":
        return -F.logsigmoid(args["beta"] * (seq[0::2] - seq[1::2])).mean() + args["bc_coef"] * chosen_nll
    if name == "ORPOLoss":
        odds = avg - _log1mexp(avg)
        return chosen_nll + args["lambda_orpo"] * -F.logsigmoid(odds[0::2] - odds[1::2]).mean()
    beta, kind = args["beta"], args["loss_type"]
    c, r = seq[0::2] - refs[0::2], seq[1::2] - refs[1::2]
    logits = beta * (c - r)
    if kind == "hinge":
        return torch.relu(1 - logits).mean()
    if kind == "ipo":
        return ((logits - 1 / (2 * beta)) ** 2).mean()
    return (1 - torch.sigmoid(beta * c) + torch.sigmoid(beta * r)).mean()  # kto_pair


@pytest.mark.parametrize("name,args", [
    ("DPOLoss", {"beta": 0.3, "loss_type": "hinge"}), ("DPOLoss", {"beta": 0.3, "loss_type": "ipo"}),
    ("DPOLoss", {"beta": 0.3, "loss_type": "kto_pair"}), ("SimPOLoss", {"beta": 2.5, "gamma": 0.5}),
    ("CPOLoss", {"beta": 0.1, "bc_coef": 0.7}), ("ORPOLoss", {"lambda_orpo": 0.2}),
])
def test_preference_family_equals_upstream(name: str, args: dict) -> None:
    from server.services.native.losses import preference

    feats = _features(9, rows=6)
    g = torch.Generator().manual_seed(10)
    lps = [(-torch.rand(len(f.input_ids), generator=g, dtype=torch.float64) * 3).requires_grad_(True) for f in feats]
    ref = [-torch.rand(len(f.input_ids), generator=g, dtype=torch.float64) * 3 for f in feats]
    batch = preference(name, args, feats, [r.tolist() for r in ref] if name == "DPOLoss" else None)
    inputs = [{k: torch.from_numpy(np.asarray(v)).to(torch.float64) if np.asarray(v).dtype.kind == "f"
               else torch.from_numpy(np.asarray(v)) for k, v in x.items()} for _, x in batch.datums]
    out = compute_loss(batch.loss_fn, lps, inputs, batch.config)
    if name == "DPOLoss":  # the reference logps as the job carries them (float32), masked as the rows' labels
        ref_sent = [x["ref_logprobs"] for x in inputs]
        for r, want, f in zip(ref_sent, ref, feats):
            torch.testing.assert_close(r, torch.where(torch.from_numpy(f.mask), want, torch.zeros_like(want)),
                                       rtol=1e-6, atol=1e-6)
    else:
        ref_sent = [torch.zeros_like(r) for r in ref]
        assert all(not bool(x["ref_logprobs"].any()) for x in inputs)  # reference-free
    expect = _preference_reference(name, args, lps, feats, ref_sent)
    assert float(out.loss.detach()) == pytest.approx(float(expect.detach()), rel=1e-6, abs=1e-7)
    for a, b in zip(torch.autograd.grad(out.loss, lps), torch.autograd.grad(expect, lps)):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-9)
