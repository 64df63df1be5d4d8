"""calculate_metric: the adapter's metrics (LossMetric, Accuracy, TrainMetric), accumulated per step and reset on
read, in upstream's format (numbers as the strings twinkle's metrics print).

Sums live in the adapter's progress (`progress["metrics"]["train" | "eval"]`), so they survive a gateway restart.
Accuracy needs the model's argmax predictions, which upstream computes only when logits are returned
(`return_logits`); like upstream it reports nothing otherwise.
"""

from __future__ import annotations

import time
from typing import Any


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
    b.update(loss=0.0, calls=0, tokens=0, since=time.time())
    return out
