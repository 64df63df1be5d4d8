"""calculate_metric: the adapter's metrics (LossMetric, Accuracy, TrainMetric), accumulated per step and reset on
read, in upstream's format (numbers as the strings twinkle's metrics print).

Sums live in the adapter's progress (`progress["metrics"]["train" | "eval"]`), so they survive a gateway restart.
Accuracy needs the model's argmax predictions, which upstream computes only when logits are returned
(`return_logits`); like upstream it reports nothing otherwise.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from api_schemas.native.features import Feature


def _bucket(progress: dict[str, Any], training: bool) -> dict[str, Any]:
    buckets = progress.setdefault("metrics", {})
    return buckets.setdefault("train" if training else "eval",
                              {"loss": 0.0, "calls": 0, "tokens": 0, "since": time.time(), "iters_at": 0})


def add_loss(progress: dict[str, Any], training: bool, loss: float, label_tokens: int, summed: bool) -> None:
    """One forward's loss (`summed`: the loss is a sum over `label_tokens`, else a mean)."""
    b = _bucket(progress, training)
    b["loss"] += loss
    b["calls"] += 1
    if summed:
        b["tokens"] += label_tokens


def add_rl(progress: dict[str, Any], settings: dict[str, Any], training: bool, features: list[Feature],
           logps: list[list[float]], kwargs: dict[str, Any]) -> None:
    """The sums DPOMetric and GRPOMetric report, from a pass's logps and its loss inputs."""
    names = {m["name"]: m["args"] for m in settings.get("metrics", [])}
    b = _bucket(progress, training)
    if "DPOMetric" in names and len(features) % 2 == 0:
        ref = kwargs.get("ref_logps")
        if ref is None and isinstance(kwargs.get("ref_outputs"), dict):
            ref = kwargs["ref_outputs"].get("logps")
        beta = names["DPOMetric"].get("beta", 0.1)
        seq = [float(np.asarray(lp)[f.mask].sum()) for lp, f in zip(logps, features)]
        d = b.setdefault("dpo", {"pairs": 0, "chosen": 0.0, "rejected": 0.0, "ref_chosen": 0.0, "ref_rejected": 0.0,
                                 "margin": 0.0, "correct": 0, "rewards": False})
        for i in range(0, len(seq), 2):
            d["pairs"] += 1
            d["chosen"] += seq[i]
            d["rejected"] += seq[i + 1]
            if isinstance(ref, list) and len(ref) == len(features):
                rc, rr = (_masked_sum(ref[j], features[j]) for j in (i, i + 1))
                margin = beta * ((seq[i] - rc) - (seq[i + 1] - rr))
                d.update(rewards=True, ref_chosen=d["ref_chosen"] + rc, ref_rejected=d["ref_rejected"] + rr,
                         margin=d["margin"] + margin, correct=d["correct"] + int(margin > 0))
    old = kwargs.get("old_logps")
    if "GRPOMetric" in names and isinstance(old, list) and len(old) == len(features):
        g = b.setdefault("grpo", {"tokens": 0, "old": 0.0, "diff": 0.0, "kl": 0.0})
        for lp, o, f in zip(logps, old, features):
            new = np.asarray(lp, dtype=np.float64)[f.mask]
            prev = np.asarray(o, dtype=np.float64)
            prev = prev if prev.size == new.size else prev[: len(f.mask)][f.mask]
            d = new - prev
            g["tokens"] += int(new.size)
            g["old"] += float(prev.sum())
            g["diff"] += float(d.sum())
            g["kl"] += float((np.exp(-d) - 1 + d).sum())  # k3 estimate of KL(new || old) per token


def _masked_sum(values: object, f: Feature) -> float:
    arr = np.asarray(values, dtype=np.float64)
    return float(arr[f.mask].sum() if arr.size >= f.mask.size else arr.sum())


def add_step(progress: dict[str, Any], grad_norm: float, learning_rate: float) -> None:
    progress["last_grad_norm"] = grad_norm
    progress["last_lr"] = learning_rate


def calculate(progress: dict[str, Any], settings: dict[str, Any], training: bool) -> dict[str, Any]:
    """The metrics the adapter has, then a reset of their sums."""
    names = {m["name"] for m in settings.get("metrics", [])
             if m.get("is_training") is None or bool(m["is_training"]) == training}
    b = _bucket(progress, training)
    out: dict[str, Any] = {}
    if "LossMetric" in names and b["calls"]:
        out["loss"] = f"{b['loss'] / (b['tokens'] if b['tokens'] else b['calls']):.4f}"
        grad_norm = progress.get("last_grad_norm")
        if training and grad_norm:
            out["grad_norm"] = f"{grad_norm:.6f}"
    if "TrainMetric" in names and training:
        if progress.get("last_lr") is not None:
            out["learning rate"] = f"{progress['last_lr']:.6e}"
        gas = max(int(settings.get("gas", 1)), 1)
        iters = progress.get("backwards", 0) // gas
        now = time.time()
        interval = max(now - b["since"], 1e-9)
        elapsed = now - progress.get("started_at", now)
        out["iters"] = iters
        out["total time elapse"] = (f"{elapsed:.0f} seconds" if interval < 60 else f"{elapsed / 60:.1f} minutes")
        out["speed"] = f"{(iters - b['iters_at']) / interval:.2f} iters/s"
        b["iters_at"] = iters
    dpo = b.pop("dpo", None)
    if "DPOMetric" in names and dpo and dpo["pairs"]:
        n = dpo["pairs"]
        out["logps/chosen"], out["logps/rejected"] = f"{dpo['chosen'] / n:.2f}", f"{dpo['rejected'] / n:.2f}"
        if dpo["rewards"]:
            beta = next(m["args"].get("beta", 0.1) for m in settings["metrics"] if m["name"] == "DPOMetric")
            chosen = beta * (dpo["chosen"] - dpo["ref_chosen"]) / n
            rejected = beta * (dpo["rejected"] - dpo["ref_rejected"]) / n
            out.update({"logps/ref_chosen": f"{dpo['ref_chosen'] / n:.2f}",
                        "logps/ref_rejected": f"{dpo['ref_rejected'] / n:.2f}",
                        "rewards/chosen": f"{chosen:.4f}", "rewards/rejected": f"{rejected:.4f}",
                        "rewards/margins": f"{dpo['margin'] / n:.4f}",
                        "rewards/accuracies": f"{dpo['correct'] / n * 100:.1f}%"})
    grpo = b.pop("grpo", None)
    if "GRPOMetric" in names and grpo and grpo["tokens"]:
        n = grpo["tokens"]
        out.update({"train/mean_old_logp": grpo["old"] / n, "train/logp_diff_mean": grpo["diff"] / n,
                    "train/approx_kl": grpo["kl"] / n})
    b.update(loss=0.0, calls=0, tokens=0, since=time.time())
    return out
