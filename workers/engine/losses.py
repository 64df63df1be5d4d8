"""Tinker loss functions on the learner's target-token log-probabilities (the math behind forward_backward).

Every loss is a per-token ("elementwise") loss SUMMED over tokens and datums, as Tinker does (never averaged).
Names, required inputs and config defaults come from `api_schemas.losses`, the table the gateway also
validates with. Notation as in the Tinker docs: lp = learner logprobs, q = sampler logprobs
(`loss_fn_inputs["logprobs"]`), A = advantages, r = exp(lp - q), sg = stop-gradient.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Mapping

import torch

from api_schemas.custom_loss import CustomLossProgram
from api_schemas.losses import LossSpecError, resolve_loss_config, validate_loss_request
from workers.engine.custom_loss import CustomLossError, run_custom_loss

__all__ = ["LossOutput", "LossSpecError", "compute_loss"]


@dataclass
class LossOutput:
    loss: torch.Tensor  # scalar, differentiable w.r.t. the logprobs; SUM over datums and tokens
    outputs: list[dict[str, torch.Tensor]]  # per datum: "logprobs" (+ "elementwise_loss" for cross_entropy)
    metrics: dict[str, float]  # "name:reduction" keys; always "loss:sum"


@dataclass
class _Datum:
    index: int
    lp: torch.Tensor  # learner logprobs, shape of target_tokens
    x: dict[str, torch.Tensor]  # float inputs cast to lp's dtype/device, same shape as lp (thresholds broadcast)


# A loss body returns the per-token loss (lp's shape) and the number of tokens whose ratio was clipped (or None).
_Body = Callable[[_Datum, Mapping[str, float]], tuple[torch.Tensor, torch.Tensor | None]]


def _cross_entropy(d: _Datum, cfg: Mapping[str, float]) -> tuple[torch.Tensor, None]:
    # Weights may be any real number: the SDK's client-side custom loss sends weights = -dLoss/dlogprobs.
    return -d.lp * d.x["weights"], None


def _ratio(d: _Datum) -> torch.Tensor:
    return torch.exp(d.lp - d.x["logprobs"])


def _importance_sampling(d: _Datum, cfg: Mapping[str, float]) -> tuple[torch.Tensor, None]:
    return -(_ratio(d) * d.x["advantages"]), None


def _bounds(d: _Datum, cfg: Mapping[str, float]) -> tuple[torch.Tensor, torch.Tensor]:
    # Per-datum / per-token thresholds sent as loss_fn_inputs take precedence over loss_fn_config.
    # Both bounds are tensors because torch.clamp cannot mix a tensor bound with a number.
    def bound(key: str) -> torch.Tensor:
        given = d.x.get(key)
        return given if given is not None else torch.tensor(cfg[key], dtype=d.lp.dtype, device=d.lp.device)

    return bound("clip_low_threshold"), bound("clip_high_threshold")


def _clipped_count(ratio: torch.Tensor, adv: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    # Only tokens that carry an advantage matter; prompt positions (A = 0, q = 0) would otherwise dominate.
    outside = (ratio < lo) | (ratio > hi)
    return (outside & (adv != 0)).sum()


def _ppo(d: _Datum, cfg: Mapping[str, float]) -> tuple[torch.Tensor, torch.Tensor]:
    ratio, adv = _ratio(d), d.x["advantages"]
    lo, hi = _bounds(d, cfg)
    objective = torch.min(ratio * adv, torch.clamp(ratio, lo, hi) * adv)
    return -objective, _clipped_count(ratio.detach(), adv, lo, hi)


def _cispo(d: _Datum, cfg: Mapping[str, float]) -> tuple[torch.Tensor, torch.Tensor]:
    ratio, adv = _ratio(d), d.x["advantages"]
    lo, hi = _bounds(d, cfg)
    coeff = torch.clamp(ratio, lo, hi).detach()
    return -(coeff * d.lp * adv), _clipped_count(ratio.detach(), adv, lo, hi)


def _dro(d: _Datum, cfg: Mapping[str, float]) -> tuple[torch.Tensor, None]:
    q, adv = d.x["logprobs"], d.x["advantages"]
    return -(d.lp * adv - 0.5 * cfg["beta"] * (d.lp - q) ** 2), None


def _gspo(d: _Datum, cfg: Mapping[str, float]) -> tuple[torch.Tensor, torch.Tensor]:
    # GSPO-token: every token carries the (detached) sequence ratio's value but its own logprob's gradient.
    in_ratio = d.x["sequence_ratio_mask"] != 0
    if not bool(in_ratio.any()):
        # The documented mean over an empty mask is NaN, which would poison the whole gradient.
        raise LossSpecError(f"gspo: datum {d.index}: sequence_ratio_mask marks no token (need at least one nonzero)")
    log_ratio = (d.lp.detach() - d.x["logprobs"])[in_ratio].mean()
    ratio = torch.exp(log_ratio + d.lp - d.lp.detach())
    adv = d.x["advantages"]
    lo, hi = _bounds(d, cfg)
    objective = torch.min(ratio * adv, torch.clamp(ratio, lo, hi) * adv)
    return -objective, _clipped_count(ratio.detach(), adv, lo, hi)


DPO_TYPES = ("sigmoid", "hinge", "ipo", "kto_pair", "orpo")


def _log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x <= 0, the stable branch on each side of -log 2 (as twinkle's ORPOLoss)."""
    x = torch.clamp(x, max=-1e-7)
    return torch.where(x > -math.log(2.0), torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))


def _dpo(datums: list[_Datum], cfg: Mapping[str, float], loss_type: str) -> LossOutput:
    """Preference losses over (chosen, rejected) pairs in datum order, twinkle's DPOLoss family. Per datum
    s = sum(w * lp) and s_ref = sum(w * ref) (divided by sum(w) when `normalize`); h = s - s_ref. Pair terms, with
    z = beta * (h_c - h_r) - gamma: sigmoid -(1 - ls) logsigmoid(z) - ls logsigmoid(-z); hinge relu(1 - z);
    ipo (z - 1 / (2 beta))^2; kto_pair 1 - sigmoid(beta h_c) + sigmoid(beta h_r); orpo -logsigmoid(o_c - o_r) with
    o = a - log(1 - exp(a)) of the mean logps a. Loss = pref_weight * mean(pair terms) + sft_weight * the chosen
    tokens' mean NLL."""
    if loss_type not in DPO_TYPES:
        raise LossSpecError(f"dpo: loss_type must be one of {list(DPO_TYPES)}, got {loss_type!r}")
    if not datums or len(datums) % 2:
        raise LossSpecError(f"dpo: needs (chosen, rejected) pairs, got {len(datums)} datums")
    counts = torch.stack([d.x["weights"].sum() for d in datums]).clamp(min=1)
    seq = torch.stack([(d.lp * d.x["weights"]).sum() for d in datums])
    ref = torch.stack([(d.x["ref_logprobs"] * d.x["weights"]).sum() for d in datums])
    if cfg["normalize"] or loss_type == "orpo":
        seq, ref = seq / counts, ref / counts
    beta, ls = cfg["beta"], cfg["label_smoothing"]
    h = seq - ref
    z = beta * (h[0::2] - h[1::2]) - cfg["gamma"]
    if loss_type == "sigmoid":
        pair = -(1 - ls) * torch.nn.functional.logsigmoid(z) - ls * torch.nn.functional.logsigmoid(-z)
    elif loss_type == "hinge":
        pair = torch.relu(1 - z)
    elif loss_type == "ipo":
        pair = (z - 1 / (2 * beta)) ** 2
    elif loss_type == "kto_pair":
        pair = 1 - torch.sigmoid(beta * h[0::2]) + torch.sigmoid(beta * h[1::2])
    else:
        odds = seq - _log1mexp(seq)
        pair = -torch.nn.functional.logsigmoid(odds[0::2] - odds[1::2])
    loss = cfg["pref_weight"] * pair.mean()
    if cfg["sft_weight"] > 0:
        chosen = datums[0::2]
        tokens = torch.stack([d.x["weights"].sum() for d in chosen]).sum().clamp(min=1)
        total = torch.stack([(d.lp * d.x["weights"]).sum() for d in chosen]).sum()
        loss = loss + cfg["sft_weight"] * -total / tokens
    outputs = [{"logprobs": d.lp.detach()} for d in datums]
    return LossOutput(loss=loss, outputs=outputs, metrics={"loss:sum": float(loss.detach())})


def _sapo(d: _Datum, cfg: Mapping[str, float]) -> tuple[torch.Tensor, None]:
    ratio, adv = _ratio(d), d.x["advantages"]
    tau = torch.where(adv > 0, torch.tensor(cfg["tau_pos"], dtype=adv.dtype, device=adv.device),
                      torch.tensor(cfg["tau_neg"], dtype=adv.dtype, device=adv.device))
    return -(torch.sigmoid(tau * (ratio - 1)) * (4.0 / tau) * adv), None


def _gkd(d: _Datum, cfg: Mapping[str, float]) -> tuple[torch.Tensor, None]:
    """twinkle's GKDLoss with a teacher's top-k (columns 1.., column 0 is the label token, not in the loss): student
    and teacher renormalised over the K ids at temperature t, then beta * KL(T || M) + (1 - beta) * KL(S || M),
    M = beta T + (1 - beta) S (beta 0: KL(T || S), 1: KL(S || T)), weighted per position by weights[:, 1] (which
    carries upstream's mean over label tokens)."""
    if d.lp.dim() != 2 or d.lp.shape[1] < 2:
        raise LossSpecError(f"gkd: datum {d.index}: target_tokens must be (positions, 1 + K), got {tuple(d.lp.shape)}")
    t, beta = cfg["temperature"], cfg["beta"]
    s = torch.log_softmax(d.lp[..., 1:] / t, dim=-1)
    q = torch.log_softmax(d.x["teacher_logprobs"][..., 1:] / t, dim=-1)
    if beta == 0:
        jsd = (q.exp() * (q - s)).sum(-1)
    elif beta == 1:
        jsd = (s.exp() * (s - q)).sum(-1)
    else:
        m = torch.logsumexp(torch.stack([s + math.log(1 - beta), q + math.log(beta)]), dim=0)
        jsd = beta * (q.exp() * (q - m)).sum(-1) + (1 - beta) * (s.exp() * (s - m)).sum(-1)
    return jsd * d.x["weights"][..., 1], None


def _kl_penalty(d: _Datum) -> torch.Tensor | None:
    """The native GRPO family's KL term (api_schemas/losses.py KL_INPUTS), None when the datum has none. Positions
    of weight 0 see d = 0, so a very unlikely prompt token cannot make exp(d) overflow into the sum."""
    if "kl_weights" not in d.x and "kl_ref_logprobs" not in d.x:
        return None
    if "kl_weights" not in d.x or "kl_ref_logprobs" not in d.x:
        raise LossSpecError(f"datum {d.index}: kl_ref_logprobs and kl_weights go together")
    w = d.x["kl_weights"]
    diff = torch.where(w != 0, d.x["kl_ref_logprobs"] - d.lp, torch.zeros_like(d.lp))
    return w * (torch.exp(diff) - diff - 1)


_BODIES: dict[str, _Body] = {
    "cross_entropy": _cross_entropy,
    "importance_sampling": _importance_sampling,
    "ppo": _ppo,
    "cispo": _cispo,
    "dro": _dro,
    "gspo": _gspo,
    "sapo": _sapo,
    "gkd": _gkd,
}
_THRESHOLDS = ("clip_low_threshold", "clip_high_threshold")


def _prepare(loss_fn: str, index: int, lp: torch.Tensor, raw: Mapping[str, torch.Tensor]) -> _Datum:
    where = f"{loss_fn}: datum {index}"
    targets = raw["target_tokens"]
    if targets.dtype.is_floating_point or targets.dtype.is_complex or targets.dtype == torch.bool:
        raise LossSpecError(f"{where}: target_tokens must be integer token ids, got {targets.dtype}")
    if targets.dim() not in (1, 2):
        raise LossSpecError(f"{where}: target_tokens must have shape (N,) or (N, K), got {tuple(targets.shape)}")
    if tuple(lp.shape) != tuple(targets.shape):
        raise LossSpecError(
            f"{where}: learner logprobs have shape {tuple(lp.shape)} but target_tokens {tuple(targets.shape)}"
        )
    if not lp.dtype.is_floating_point:
        raise LossSpecError(f"{where}: learner logprobs must be floating point, got {lp.dtype}")
    x: dict[str, torch.Tensor] = {}
    for key, value in raw.items():
        if key == "target_tokens":
            continue
        if value.dtype.is_complex or value.dtype == torch.bool:
            raise LossSpecError(f"{where}: loss_fn_inputs[{key!r}] must be real numbers, got {value.dtype}")
        t = value.to(device=lp.device, dtype=lp.dtype)
        if key in _THRESHOLDS and t.numel() == 1:
            t = t.reshape(())  # one threshold for the whole datum
        elif tuple(t.shape) != tuple(targets.shape):
            raise LossSpecError(
                f"{where}: loss_fn_inputs[{key!r}] has shape {tuple(t.shape)}, "
                f"expected the shape of target_tokens {tuple(targets.shape)}"
            )
        # +inf is a legal "no upper clip"; everything else must be finite or the sum becomes NaN/inf.
        bad = torch.isnan(t) if key == "clip_high_threshold" else ~torch.isfinite(t)
        if bool(bad.any()):
            raise LossSpecError(f"{where}: loss_fn_inputs[{key!r}] contains non-finite values")
        x[key] = t
    if any(k in x for k in _THRESHOLDS):
        _check_tensor_thresholds(where, x)
    return _Datum(index, lp, x)


def _check_tensor_thresholds(where: str, x: dict[str, torch.Tensor]) -> None:
    lo, hi = x.get("clip_low_threshold"), x.get("clip_high_threshold")
    if lo is not None and bool((lo < 0).any()):
        raise LossSpecError(f"{where}: clip_low_threshold must be >= 0")
    if lo is not None and hi is not None and bool((hi < lo).any()):
        raise LossSpecError(f"{where}: clip_high_threshold must be >= clip_low_threshold at every position")


def compute_loss(
    loss_fn: str,
    logprobs: list[torch.Tensor],
    inputs: list[dict[str, torch.Tensor]],
    config: dict[str, float | str],
    custom: CustomLossProgram | None = None,
) -> LossOutput:
    """The summed loss of one chunk, its per-datum outputs and its metrics; raises LossSpecError on bad input.

    `custom` is the checked graph of loss_fn "custom" (the job carries it; workers/engine/custom_loss.py runs it)."""
    if len(logprobs) != len(inputs):
        raise LossSpecError(f"{loss_fn}: {len(logprobs)} logprob tensors for {len(inputs)} datums")
    validate_loss_request(loss_fn, [set(d) for d in inputs], config, engine=True)
    if loss_fn == "custom":
        if custom is None or custom.loss_id != config.get("loss_id"):
            raise CustomLossError("custom: the job carries no graph for its loss_id")
        res = run_custom_loss(custom, logprobs, inputs)
        return LossOutput(loss=res.loss, outputs=res.outputs, metrics=res.metrics)
    cfg = resolve_loss_config(loss_fn, config, engine=True)
    if loss_fn == "dpo":
        return _dpo([_prepare(loss_fn, i, lp, raw) for i, (lp, raw) in enumerate(zip(logprobs, inputs))], cfg,
                    str(config["loss_type"]))
    body = _BODIES[loss_fn]

    # Prepare (validate) every datum first so a bad datum fails the chunk before any math runs.
    datums = [_prepare(loss_fn, i, lp, raw) for i, (lp, raw) in enumerate(zip(logprobs, inputs))]
    per_datum: list[torch.Tensor] = []
    outputs: list[dict[str, torch.Tensor]] = []
    clipped_counts: list[torch.Tensor] = []
    kl_terms: list[torch.Tensor] = []
    for d in datums:
        elementwise, clipped = body(d, cfg)
        kl = _kl_penalty(d)
        if kl is not None:
            kl_terms.append(kl.sum())
        per_datum.append(elementwise.sum() if kl is None else elementwise.sum() + kl_terms[-1])
        out = {"logprobs": d.lp.detach()}
        if loss_fn == "cross_entropy":
            # Shape (N,) even for (N, K) targets: the per-position loss summed over the K candidates.
            per_position = elementwise.detach()
            out["elementwise_loss"] = per_position.sum(dim=1) if per_position.dim() == 2 else per_position
        outputs.append(out)
        if clipped is not None:
            clipped_counts.append(clipped)

    loss = torch.stack(per_datum).sum()
    metrics = {"loss:sum": float(loss.detach())}
    if clipped_counts:
        # Summed on device, read once: one host sync per chunk, not per datum.
        metrics["clipped_tokens:sum"] = float(torch.stack(clipped_counts).sum())
    if kl_terms:
        metrics["kl:sum"] = float(torch.stack(kl_terms).sum().detach())
    return LossOutput(loss=loss, outputs=outputs, metrics=metrics)
