"""Tinker losses: value and gradient against references written here from the documented formulas, and validation."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from api_schemas.losses import LOSS_SPECS, SUPPORTED_LOSSES, LossSpecError, validate_loss_request
from workers.engine.losses import compute_loss

REPO = Path(__file__).resolve().parents[2]
LENGTHS = (7, 1, 12)


def _rl_data(seed: int, lengths: tuple[int, ...] = LENGTHS) -> tuple[list[torch.Tensor], list[dict[str, torch.Tensor]]]:
    """fp64 learner logprobs plus inputs; q is lp plus noise so ratios land inside and outside [0.8, 1.2]."""
    g = torch.Generator().manual_seed(seed)
    lps, inputs = [], []
    for n in lengths:
        lp = -torch.rand(n, generator=g, dtype=torch.float64) * 3 - 0.01
        q = lp + torch.randn(n, generator=g, dtype=torch.float64) * 0.4
        adv = torch.randn(n, generator=g, dtype=torch.float64)
        adv[0] = 0.0  # a prompt-like position
        mask = (torch.rand(n, generator=g) > 0.3).to(torch.float64)
        mask[-1] = 1.0
        lps.append(lp)
        inputs.append(
            {
                "target_tokens": torch.randint(0, 1000, (n,), generator=g),
                "logprobs": q,
                "advantages": adv,
                "sequence_ratio_mask": mask,
            }
        )
    return lps, inputs


def _keys(loss_fn: str, inputs: list[dict[str, torch.Tensor]]) -> list[dict[str, torch.Tensor]]:
    spec = LOSS_SPECS[loss_fn]
    return [{k: v for k, v in d.items() if k in spec.required_inputs | spec.optional_inputs} for d in inputs]


def _run(loss_fn, lps, inputs, config):
    leaves = [lp.clone().requires_grad_(True) for lp in lps]
    out = compute_loss(loss_fn, leaves, inputs, config)
    out.loss.backward()
    return out, [leaf.grad for leaf in leaves]


# ---- references: the documented formulas (cookbook docs/losses.mdx, Tinker GSPO page), summed per datum ----


def ref_importance_sampling(lp, d, cfg):
    return -(torch.exp(lp - d["logprobs"]) * d["advantages"]).sum()


def ref_ppo(lp, d, cfg):
    prob_ratio = torch.exp(lp - d["logprobs"])
    clipped_ratio = torch.clamp(prob_ratio, cfg.get("clip_low_threshold", 0.8), cfg.get("clip_high_threshold", 1.2))
    return -torch.min(prob_ratio * d["advantages"], clipped_ratio * d["advantages"]).sum()


def ref_cispo(lp, d, cfg):
    prob_ratio = torch.exp(lp - d["logprobs"])
    clipped_ratio = torch.clamp(prob_ratio, cfg.get("clip_low_threshold", 0.8), cfg.get("clip_high_threshold", 1.2))
    return -(clipped_ratio.detach() * lp * d["advantages"]).sum()


def ref_dro(lp, d, cfg):
    quadratic_term = (lp - d["logprobs"]) ** 2
    return -(lp * d["advantages"] - 0.5 * cfg["beta"] * quadratic_term).sum()


def ref_gspo(lp, d, cfg):
    in_ratio = d["sequence_ratio_mask"] != 0
    log_ratio = (lp.detach() - d["logprobs"])[in_ratio].mean()
    ratio = torch.exp(log_ratio + lp - lp.detach())
    clipped = torch.clamp(ratio, cfg.get("clip_low_threshold", 0.8), cfg.get("clip_high_threshold", 1.2))
    return -torch.min(ratio * d["advantages"], clipped * d["advantages"]).sum()


REFERENCES = {
    "importance_sampling": (ref_importance_sampling, {}),
    "ppo": (ref_ppo, {}),
    "cispo": (ref_cispo, {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}),
    "dro": (ref_dro, {"beta": 0.05}),
    "gspo": (ref_gspo, {"clip_low_threshold": 0.85, "clip_high_threshold": 1.15}),
}


@pytest.mark.parametrize("loss_fn", sorted(REFERENCES))
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_rl_loss_value_and_grad_match_reference(loss_fn: str, seed: int) -> None:
    ref, config = REFERENCES[loss_fn]
    lps, raw = _rl_data(seed)
    inputs = _keys(loss_fn, raw)
    out, grads = _run(loss_fn, lps, inputs, config)

    leaves = [lp.clone().requires_grad_(True) for lp in lps]
    expected = sum(ref(leaf, d, config) for leaf, d in zip(leaves, inputs))
    expected.backward()
    torch.testing.assert_close(out.loss.detach(), expected.detach(), rtol=1e-6, atol=1e-12)
    for got, want in zip(grads, [leaf.grad for leaf in leaves]):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-12)
    assert out.metrics["loss:sum"] == pytest.approx(float(expected.detach()), rel=1e-6)
    assert out.loss.dtype == torch.float64
    for o, lp in zip(out.outputs, lps):
        assert set(o) == {"logprobs"}
        assert not o["logprobs"].requires_grad
        torch.testing.assert_close(o["logprobs"], lp, rtol=0, atol=0)


def _hand_gradient(loss_fn: str, lp, d, cfg) -> torch.Tensor:
    """dLoss/dlp derived by hand (no autograd), to catch a reference and an implementation sharing a mistake."""
    q, a = d["logprobs"], d["advantages"]
    lo, hi = cfg.get("clip_low_threshold", 0.8), cfg.get("clip_high_threshold", 1.2)
    r = torch.exp(lp - q)
    if loss_fn == "importance_sampling":
        return -a * r
    if loss_fn == "ppo":
        inactive = ((a > 0) & (r > hi)) | ((a < 0) & (r < lo))
        return torch.where(inactive, torch.zeros_like(r), -a * r)
    if loss_fn == "cispo":
        return -a * r.clamp(lo, hi)
    if loss_fn == "dro":
        return -(a - cfg["beta"] * (lp - q))
    if loss_fn == "gspo":
        m = d["sequence_ratio_mask"] != 0
        s = torch.exp((lp - q)[m].mean()).expand_as(lp)
        inactive = ((a > 0) & (s > hi)) | ((a < 0) & (s < lo))
        return torch.where(inactive, torch.zeros_like(s), -a * s)
    raise AssertionError(loss_fn)


@pytest.mark.parametrize("loss_fn", sorted(REFERENCES))
def test_rl_loss_gradient_matches_hand_derivation(loss_fn: str) -> None:
    _, config = REFERENCES[loss_fn]
    lps, raw = _rl_data(7)
    inputs = _keys(loss_fn, raw)
    _, grads = _run(loss_fn, lps, inputs, config)
    for got, lp, d in zip(grads, lps, inputs):
        torch.testing.assert_close(got, _hand_gradient(loss_fn, lp, d, config), rtol=1e-6, atol=1e-12)


def test_clipping_is_exercised_by_the_data() -> None:
    lps, raw = _rl_data(0)
    out, _ = _run("ppo", lps, _keys("ppo", raw), {})
    assert out.metrics["clipped_tokens:sum"] > 0  # otherwise the ppo/cispo/gspo tests prove little


@pytest.mark.parametrize("shape", [(9,), (6, 4)])
def test_cross_entropy_with_negative_weights_and_2d(shape: tuple[int, ...]) -> None:
    g = torch.Generator().manual_seed(3)
    lps = [-torch.rand(shape, generator=g, dtype=torch.float64) * 5 for _ in range(2)]
    inputs = [
        {
            "target_tokens": torch.randint(0, 50, shape, generator=g),
            "weights": torch.randn(shape, generator=g, dtype=torch.float64),
        }
        for _ in range(2)
    ]
    out, grads = _run("cross_entropy", lps, inputs, {})
    expected = sum(-(lp * d["weights"]).sum() for lp, d in zip(lps, inputs))
    torch.testing.assert_close(out.loss.detach(), expected, rtol=1e-6, atol=1e-12)
    for got, d in zip(grads, inputs):
        torch.testing.assert_close(got, -d["weights"], rtol=1e-6, atol=1e-12)
    for o, lp, d in zip(out.outputs, lps, inputs):
        assert o["elementwise_loss"].shape == (shape[0],)
        per_token = -(lp * d["weights"])
        want = per_token.sum(dim=1) if per_token.dim() == 2 else per_token
        torch.testing.assert_close(o["elementwise_loss"], want)
        assert o["logprobs"].shape == shape
    assert out.metrics == {"loss:sum": pytest.approx(float(expected), rel=1e-6)}


def test_float32_is_kept_and_float32_inputs_are_accepted() -> None:
    lps, raw = _rl_data(4)
    inputs = [{k: (v.float() if v.is_floating_point() else v) for k, v in d.items()} for d in _keys("ppo", raw)]
    out, grads = _run("ppo", [lp.float() for lp in lps], inputs, {})
    assert out.loss.dtype == torch.float32 and all(g.dtype == torch.float32 for g in grads)
    assert out.outputs[0]["logprobs"].dtype == torch.float32


def test_per_datum_and_per_token_clip_thresholds_override_config() -> None:
    lps, raw = _rl_data(5)
    inputs = _keys("ppo", raw)
    inputs[0] = {**inputs[0], "clip_low_threshold": torch.tensor([0.95]), "clip_high_threshold": torch.tensor([1.05])}
    n = inputs[2]["target_tokens"].shape[0]
    inputs[2] = {**inputs[2], "clip_high_threshold": torch.linspace(1.01, 1.5, n, dtype=torch.float64)}
    out, grads = _run("ppo", lps, inputs, {"clip_low_threshold": 0.7, "clip_high_threshold": 1.3})
    cfgs = [
        {"clip_low_threshold": 0.95, "clip_high_threshold": 1.05},
        {"clip_low_threshold": 0.7, "clip_high_threshold": 1.3},
        # torch.clamp cannot mix a number bound with a tensor bound
        {
            "clip_low_threshold": torch.tensor(0.7, dtype=torch.float64),
            "clip_high_threshold": inputs[2]["clip_high_threshold"],
        },
    ]
    expected = sum(ref_ppo(lp, d, c) for lp, d, c in zip(lps, inputs, cfgs))
    torch.testing.assert_close(out.loss.detach(), expected, rtol=1e-6, atol=1e-12)
    for got, lp, d, c in zip(grads, lps, inputs, cfgs):
        torch.testing.assert_close(got, _hand_gradient("ppo", lp, d, c), rtol=1e-6, atol=1e-12)


# ---- bad tensors (engine side) ----


def test_shape_mismatch_between_targets_and_weights_is_rejected() -> None:
    lp = torch.zeros(4, dtype=torch.float64, requires_grad=True)
    bad = {"target_tokens": torch.zeros(4, dtype=torch.int64), "weights": torch.ones(5, dtype=torch.float64)}
    with pytest.raises(LossSpecError, match=r"weights.*shape \(5,\).*\(4,\)"):
        compute_loss("cross_entropy", [lp], [bad], {})


def test_learner_logprob_shape_mismatch_and_float_targets_are_rejected() -> None:
    lp = torch.zeros(3, dtype=torch.float64, requires_grad=True)
    ok = {"target_tokens": torch.zeros(4, dtype=torch.int64), "weights": torch.ones(4)}
    with pytest.raises(LossSpecError, match="learner logprobs"):
        compute_loss("cross_entropy", [lp], [ok], {})
    floaty = {"target_tokens": torch.zeros(3), "weights": torch.ones(3)}
    with pytest.raises(LossSpecError, match="integer"):
        compute_loss("cross_entropy", [lp], [floaty], {})


def test_non_finite_inputs_and_empty_gspo_mask_are_rejected() -> None:
    lps, raw = _rl_data(6, lengths=(5,))
    nan = torch.full((5,), float("nan"), dtype=torch.float64)
    nan_adv = [{**_keys("importance_sampling", raw)[0], "advantages": nan}]
    with pytest.raises(LossSpecError, match="non-finite"):
        compute_loss("importance_sampling", lps, nan_adv, {})
    empty_mask = [{**_keys("gspo", raw)[0], "sequence_ratio_mask": torch.zeros(5, dtype=torch.float64)}]
    with pytest.raises(LossSpecError, match="marks no token"):
        compute_loss("gspo", lps, empty_mask, {})


def test_bad_per_token_thresholds_are_rejected() -> None:
    lps, raw = _rl_data(8, lengths=(4,))
    d = {**_keys("ppo", raw)[0], "clip_low_threshold": torch.tensor([1.5]), "clip_high_threshold": torch.tensor([1.2])}
    with pytest.raises(LossSpecError, match="clip_high_threshold must be >= clip_low_threshold"):
        compute_loss("ppo", lps, [d], {})


# ---- request validation (gateway side, no tensors) ----


def test_sdk_loss_names_are_all_in_the_table() -> None:
    from typing import get_args

    from tinker.types.loss_fn_type import LossFnType

    assert set(get_args(LossFnType)) == {name for name, spec in LOSS_SPECS.items() if not spec.native_only}
    assert set(SUPPORTED_LOSSES) == {"cross_entropy", "importance_sampling", "ppo", "cispo", "dro", "gspo", "custom"}


def test_unknown_loss_lists_supported_ones() -> None:
    with pytest.raises(LossSpecError, match=r"unknown loss_fn 'dpo'.*cross_entropy.*gspo"):
        validate_loss_request("dpo", [{"target_tokens", "weights"}], {})


@pytest.mark.parametrize(("loss_fn", "why"), [("stable_reinforce", "stability")])
def test_unsupported_losses_are_rejected_with_a_reason(loss_fn: str, why: str) -> None:
    with pytest.raises(LossSpecError, match=why):
        validate_loss_request(loss_fn, [{"target_tokens", "logprobs", "advantages"}], {})


def test_custom_loss_requests_name_a_loss_id() -> None:
    """Its inputs are the loss's own (checked against the stored graph); the table checks target_tokens and loss_id."""
    validate_loss_request("custom", [{"target_tokens", "anything"}], {"loss_id": "custom-loss-1"})
    with pytest.raises(LossSpecError, match=r"must set \['loss_id'\]"):
        validate_loss_request("custom", [{"target_tokens"}], {})
    with pytest.raises(LossSpecError, match="must be a string"):
        validate_loss_request("custom", [{"target_tokens"}], {"loss_id": 3.0})
    with pytest.raises(LossSpecError, match="unknown loss_fn_config"):
        validate_loss_request("custom", [{"target_tokens"}], {"loss_id": "x", "beta": 1.0})
    with pytest.raises(LossSpecError, match="target_tokens"):
        validate_loss_request("custom", [{"weights"}], {"loss_id": "x"})


def test_missing_and_extra_inputs_are_named() -> None:
    with pytest.raises(LossSpecError, match=r"datum 1 is missing loss_fn_inputs \['advantages'\]"):
        validate_loss_request("ppo", [{"target_tokens", "logprobs", "advantages"}, {"target_tokens", "logprobs"}], {})
    with pytest.raises(LossSpecError, match=r"\['sequence_ratio_mask'\]"):
        validate_loss_request("gspo", [{"target_tokens", "logprobs", "advantages"}], {})
    with pytest.raises(LossSpecError, match=r"\['mask'\] that this loss does not use"):
        validate_loss_request("importance_sampling", [{"target_tokens", "logprobs", "advantages", "mask"}], {})
    with pytest.raises(LossSpecError, match="no datums"):
        validate_loss_request("cross_entropy", [], {})


@pytest.mark.parametrize(
    ("loss_fn", "config", "match"),
    [
        ("cross_entropy", {"beta": 0.1}, r"unknown loss_fn_config key\(s\) \['beta'\]; allowed: none"),
        ("ppo", {"clip_epsilon": 0.2}, r"unknown .*clip_epsilon.*allowed: clip_high_threshold, clip_low_threshold"),
        ("ppo", {"clip_low_threshold": 1.3, "clip_high_threshold": 1.2}, "must be >= clip_low_threshold"),
        ("cispo", {"clip_low_threshold": 1.3}, "must be >= clip_low_threshold"),  # 1.3 > default high 1.2
        ("gspo", {"clip_low_threshold": -0.1}, "clip_low_threshold must be a finite number >= 0"),
        ("ppo", {"clip_high_threshold": float("nan")}, "clip_high_threshold.*must be a finite number"),
        ("ppo", {"clip_low_threshold": "0.8"}, "must be a number"),
        ("dro", {}, r"must set \['beta'\]"),
        ("dro", {"beta": -1.0}, "beta must be a finite number >= 0"),
    ],
)
def test_bad_config_is_rejected(loss_fn: str, config: dict, match: str) -> None:
    keys = [set(LOSS_SPECS[loss_fn].required_inputs)]
    with pytest.raises(LossSpecError, match=match):
        validate_loss_request(loss_fn, keys, config)


def test_good_requests_pass_validation() -> None:
    with_threshold = {"target_tokens", "logprobs", "advantages", "clip_low_threshold"}
    validate_loss_request("ppo", [with_threshold], {"clip_high_threshold": float("inf")})
    validate_loss_request("dro", [{"target_tokens", "logprobs", "advantages"}], {"beta": 0})
    validate_loss_request("cross_entropy", [{"target_tokens", "weights"}] * 3, {})


def test_the_gateway_table_does_not_import_torch() -> None:
    code = "import sys, api_schemas.losses; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], cwd=REPO).returncode == 0
