"""The native losses as engine batches: each twinkle loss becomes datums of an engine loss (api_schemas/losses.py)
whose value and gradient are the twinkle loss's.

- CrossEntropyLoss: `cross_entropy`, weights 1 on label tokens (`sum`) or 1 / the batch's label tokens (`mean`).
- GRPOLoss (beta 0): upstream's per-token -min(r A, clip(r, 1 - eps, 1 + eps_high) A), averaged per sequence, then
  over the batch, is `ppo` with each token's advantage scaled by 1 / (its sequence's label tokens x rows): the
  scale is positive, so it passes through the min. Without `old_logps` upstream's ratio is exp(lp - sg(lp)) = 1:
  the same gradient as `cross_entropy` with weights A x that scale, and the loss value -mean(A), reported here.
  The rest of the family differs only in that average (PPOLoss token-mean, BNPOLoss, CISPOLoss: over the batch's
  label tokens; DRGRPOLoss: over rows x max_completion_length) or in the objective (GSPOLoss: the sequence's mean
  log ratio, the engine's `gspo`; CISPOLoss: -sg(min(r, 1 + eps)) A logp, the engine's `cispo`).
  beta > 0 adds upstream's k3 KL to the reference logps (`ref_logps`, the client's forward_only(disable_lora=True)
  of the same rows, as upstream's ref-model forward) with the same weights: the engine's KL inputs.
- DPOLoss (sigmoid, hinge, ipo, kto_pair), SimPOLoss, CPOLoss, ORPOLoss: the engine's `dpo` on (chosen, rejected)
  pairs, with the reference logps of the same rows (DPOLoss) or none.
- GKDLoss: the engine's `gkd` on the teacher's top-k ids per position (a served teacher's prompt logprobs).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from api_schemas.native.features import Feature
from server.errors import BadRequest
from server.services.sample_validation import MAX_TOPK


@dataclass(frozen=True)
class EngineBatch:
    loss_fn: str
    datums: list[tuple[np.ndarray, dict[str, np.ndarray]]]
    config: dict[str, float | str] = field(default_factory=dict)
    value: float | None = None  # the loss to report instead of the engine's (GRPO without old logps)


def cross_entropy(features: list[Feature], summed: bool) -> EngineBatch:
    tokens = sum(int(f.mask.sum()) for f in features)
    scale = np.float32(1.0 if summed else 1.0 / max(tokens, 1))
    return EngineBatch("cross_entropy", [(f.input_ids, {"target_tokens": f.targets,
                                                        "weights": f.mask.astype(np.float32) * scale})
                                         for f in features])


def _per_token(name: str, i: int, value: object, f: Feature, scalar_ok: bool) -> np.ndarray:
    """A per-row value on the row's positions: a number (every label token), the label tokens' values in order
    (upstream's response-only form) or one per position (the full form, longer ones cut)."""
    n, mask = len(f.input_ids), f.mask
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if not scalar_ok:
            raise BadRequest(f"{name}[{i}] must be a list of numbers")
        return np.where(mask, float(value), 0.0)
    if not isinstance(value, Sequence) or not all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                                  for v in value):
        raise BadRequest(f"{name}[{i}] must be a number or a list of numbers")
    arr = np.asarray(value, dtype=np.float64)
    if not np.isfinite(arr).all():
        raise BadRequest(f"{name}[{i}] holds a non-finite number")
    if arr.size == int(mask.sum()):
        out = np.zeros(n)
        out[mask] = arr
        return out
    if arr.size >= n:
        return np.where(mask, arr[:n], 0.0)
    raise BadRequest(f"{name}[{i}] has {arr.size} values: give one per label token ({int(mask.sum())}) or one per "
                     f"position ({n})")


def _rows(name: str, values: object, features: list[Feature]) -> Sequence[object]:
    if not isinstance(values, Sequence) or isinstance(values, (str, bytes)) or len(values) != len(features):
        raise BadRequest(f"{name} must hold one entry per input row ({len(features)})")
    return values


# How each policy loss of the GRPO family averages its per-token terms (upstream's `_aggregate_loss`)
SEQUENCE_MEAN, TOKEN_MEAN, CONSTANT = "seq-mean", "token-mean", "constant"
AGGREGATION = {"GRPOLoss": SEQUENCE_MEAN, "GSPOLoss": SEQUENCE_MEAN, "BNPOLoss": TOKEN_MEAN, "CISPOLoss": TOKEN_MEAN,
               "DRGRPOLoss": CONSTANT}
OBJECTIVE = {"GSPOLoss": "gspo", "CISPOLoss": "cispo", "SAPOLoss": "sapo"}  # the others: PPO's clipped ratio


def _scales(features: list[Feature], aggregation: str, max_completion_length: int) -> list[float]:
    """Each row's weight of its per-token terms: 1 / (its label tokens x rows), 1 / the batch's label tokens, or
    1 / (rows x max_completion_length)."""
    if aggregation == TOKEN_MEAN:
        total = max(sum(int(f.mask.sum()) for f in features), 1)
        return [1.0 / total] * len(features)
    if aggregation == CONSTANT:
        return [1.0 / (len(features) * max_completion_length)] * len(features)
    return [1.0 / (max(int(f.mask.sum()), 1) * len(features)) for f in features]


def _kl_inputs(features: list[Feature], ref_logps: object, beta: float,
               scale: list[float]) -> list[dict[str, np.ndarray]]:
    """Each row's KL-penalty inputs (GRPOLoss beta > 0): the reference logps on its label tokens and beta x its
    aggregation weight there; none when beta is 0."""
    if beta == 0:
        return [{} for _ in features]
    if ref_logps is None:
        raise BadRequest("a KL penalty (beta > 0) needs ref_logps: the logps of forward_only(inputs, "
                         "disable_lora=True) on the same rows (the base model is the reference)")
    ref = [_per_token("ref_logps", i, r, f, False) for i, (r, f) in enumerate(
        zip(_rows("ref_logps", ref_logps, features), features))]
    return [{"kl_ref_logprobs": np.where(f.mask, r, 0.0).astype(np.float32),
             "kl_weights": (f.mask * (beta * s)).astype(np.float32)} for f, r, s in zip(features, ref, scale)]


def grpo_datums(features: list[Feature], advantages: object, old_logps: object, *, epsilon: float,  # noqa: PLR0913
                epsilon_high: float, loss: str = "GRPOLoss", aggregation: str | None = None,
                max_completion_length: int = 1024, tau_pos: float = 1.0, tau_neg: float = 1.0,
                beta: float = 0.0, ref_logps: object = None) -> EngineBatch:
    """The GRPO family (`loss`: GRPOLoss, PPOLoss, GSPOLoss, CISPOLoss, BNPOLoss, DRGRPOLoss): each row's advantages
    scaled by its aggregation weight (positive, so it passes through the clipped min) on the engine's ppo / gspo /
    cispo objective. Without old logps the ratio is 1: cross-entropy weighted by the scaled advantages has the
    same gradient, and the loss value is upstream's at ratio 1 (plus the engine's `kl:sum`). beta > 0 adds
    upstream's per-token k3 KL to `ref_logps` with the same aggregation weights."""
    adv = [_per_token("advantages", i, a, f, True) for i, (a, f) in enumerate(
        zip(_rows("advantages", advantages, features), features))]
    scale = _scales(features, aggregation or AGGREGATION.get(loss, SEQUENCE_MEAN), max_completion_length)
    kl = _kl_inputs(features, ref_logps, beta, scale)
    objective = OBJECTIVE.get(loss, "ppo")
    if old_logps is None:
        datums = [(f.input_ids, {"target_tokens": f.targets, "weights": (a * s).astype(np.float32), **k})
                  for f, a, s, k in zip(features, adv, scale, kl)]
        # CISPO at ratio 1 is -A * logp itself: the engine's cross-entropy value is upstream's; SAPO's gate is 2 / tau
        gate = [np.where(a > 0, 2.0 / tau_pos, 2.0 / tau_neg) if objective == "sapo" else 1.0 for a in adv]
        value = None if objective == "cispo" else -sum(float((g * a * f.mask).sum()) * s
                                                       for f, a, s, g in zip(features, adv, scale, gate))
        return EngineBatch("cross_entropy", datums, value=value)
    old = [_per_token("old_logps", i, o, f, False) for i, (o, f) in enumerate(
        zip(_rows("old_logps", old_logps, features), features))]
    datums = []
    for f, a, q, s, k in zip(features, adv, old, scale, kl):
        inputs = {"target_tokens": f.targets, "logprobs": q.astype(np.float32),
                  "advantages": (a * s).astype(np.float32), **k}
        if objective == "gspo":
            inputs["sequence_ratio_mask"] = f.mask.astype(np.float32)
        datums.append((f.input_ids, inputs))
    if objective == "sapo":
        return EngineBatch(objective, datums, {"tau_pos": tau_pos, "tau_neg": tau_neg})
    bounds = (0.0, 1 + epsilon) if objective == "cispo" else (1 - epsilon, 1 + epsilon_high)
    return EngineBatch(objective, datums, {"clip_low_threshold": bounds[0], "clip_high_threshold": bounds[1]})


def dpo_datums(features: list[Feature], ref_logps: object, *, beta: float, label_smoothing: float = 0.0,
               sft_weight: float = 0.0, reference_free: bool = False, loss_type: str = "sigmoid", gamma: float = 0.0,
               normalize: bool = False, pref_weight: float = 1.0) -> EngineBatch:
    """The preference family on the engine's `dpo` loss (chosen, rejected pairs): DPOLoss (its loss types),
    SimPOLoss (reference-free, length-normalised, margin gamma), CPOLoss (reference-free + behaviour cloning),
    ORPOLoss (log odds ratio + NLL)."""
    if len(features) % 2:
        raise BadRequest("preference losses need (chosen, rejected) pairs: an even number of rows, chosen first")
    if reference_free:
        ref = [np.zeros(len(f.input_ids)) for f in features]
    elif ref_logps is None:
        raise BadRequest("DPOLoss needs ref_outputs (the result of forward_only(inputs, disable_lora=True)) "
                         "or reference_free=True")
    else:
        ref = [_per_token("ref_outputs.logps", i, r, f, False) for i, (r, f) in enumerate(
            zip(_rows("ref_outputs.logps", ref_logps, features), features))]
    datums = [(f.input_ids, {"target_tokens": f.targets, "weights": f.mask.astype(np.float32),
                             "ref_logprobs": r.astype(np.float32)}) for f, r in zip(features, ref)]
    return EngineBatch("dpo", datums, {"beta": beta, "label_smoothing": label_smoothing, "sft_weight": sft_weight,
                                       "gamma": gamma, "normalize": float(normalize), "pref_weight": pref_weight,
                                       "loss_type": loss_type})


def preference(name: str, args: dict, features: list[Feature], ref_logps: object) -> EngineBatch:
    """A preference loss of the allow-list (`name`, its validated args) as the engine's batch."""
    if name == "SimPOLoss":
        return dpo_datums(features, None, beta=args.get("beta", 2.5), gamma=args.get("gamma", 0.5), normalize=True,
                          reference_free=True)
    if name == "CPOLoss":
        return dpo_datums(features, None, beta=args.get("beta", 0.1), sft_weight=args.get("bc_coef", 1.0),
                          reference_free=True)
    if name == "ORPOLoss":
        return dpo_datums(features, None, beta=1.0, loss_type="orpo", sft_weight=1.0,
                          pref_weight=args.get("lambda_orpo", 0.1), reference_free=True)
    return dpo_datums(features, ref_logps, beta=args.get("beta", 0.1), label_smoothing=args.get("label_smoothing", 0.0),
                      sft_weight=args.get("sft_weight", 0.0), reference_free=bool(args.get("reference_free")),
                      loss_type=args.get("loss_type", "sigmoid"))


def _topk(name: str, i: int, value: object, f: Feature, integer: bool) -> np.ndarray:
    """A row's teacher top-k on its positions, shape (positions, K): one entry per position (upstream's
    [rows, seq_len, K] tensors, longer ones cut) or one per label token; 0 off the label tokens."""
    try:
        arr = np.asarray(value)
    except (ValueError, TypeError, OverflowError):
        arr = np.asarray(None)
    if arr.dtype.kind not in ("iu" if integer else "iuf"):
        kind = "integers" if integer else "numbers"
        raise BadRequest(f"{name}[{i}] must be a list of equally long lists of {kind}")
    arr = arr.astype(np.int64 if integer else np.float64)
    n, mask = len(f.input_ids), f.mask
    if arr.ndim != 2 or not 1 <= arr.shape[1] <= MAX_TOPK:
        raise BadRequest(f"{name}[{i}] must hold, per position, a list of 1 to {MAX_TOPK} values")
    out = np.zeros((n, arr.shape[1]), dtype=arr.dtype)
    if arr.shape[0] == int(mask.sum()):
        out[mask] = arr
    elif arr.shape[0] >= n:
        out[mask] = arr[:n][mask]
    else:
        raise BadRequest(f"{name}[{i}] has {arr.shape[0]} positions: give one per position ({n}) or one per label "
                         f"token ({int(mask.sum())})")
    return out


def gkd_datums(features: list[Feature], topk_logprobs: object, topk_indices: object, *, vocab_size: int,
               beta: float, temperature: float) -> EngineBatch:
    """GKDLoss with a teacher's top-k logprobs and ids (e.g. a served teacher's `prompt_logprobs=K` answer): the
    engine's `gkd` on (positions, 1 + K) targets (the label, then the teacher's ids), weighted 1 / the batch's label
    tokens (upstream's mean)."""
    if topk_logprobs is None or topk_indices is None:
        raise BadRequest("GKDLoss needs teacher_topk_logprobs and teacher_topk_indices (a teacher's top-k per "
                         "position, e.g. from its sampler's prompt_logprobs); full teacher_logits are not accepted")
    total = max(sum(int(f.mask.sum()) for f in features), 1)
    datums: list[tuple[np.ndarray, dict[str, np.ndarray]]] = []
    for i, (f, q, t) in enumerate(zip(features, _rows("teacher_topk_logprobs", topk_logprobs, features),
                                      _rows("teacher_topk_indices", topk_indices, features))):
        lp, ids = _topk("teacher_topk_logprobs", i, q, f, False), _topk("teacher_topk_indices", i, t, f, True)
        if lp.shape != ids.shape or (datums and lp.shape[1] + 1 != datums[0][1]["target_tokens"].shape[1]):
            raise BadRequest("teacher_topk_logprobs and teacher_topk_indices must have the same K in every row")
        if not np.isfinite(lp).all() or ids.min() < 0 or ids.max() >= vocab_size:
            raise BadRequest(f"row {i}: teacher logprobs must be finite and token ids in [0, {vocab_size})")
        # column 0: the label token, whose logprob the pass returns (upstream's logps) and the loss does not read
        w = np.repeat((f.mask / total)[:, None], lp.shape[1] + 1, axis=1)
        w[:, 0] = 0.0
        datums.append((f.input_ids, {"target_tokens": np.concatenate([f.targets[:, None], ids], axis=1),
                                     "teacher_logprobs": np.pad(lp, ((0, 0), (1, 0))).astype(np.float32),
                                     "weights": w.astype(np.float32)}))
    return EngineBatch("gkd", datums, {"beta": beta, "temperature": temperature})
