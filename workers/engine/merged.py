"""One merged pass: the forward / forward_backward jobs of several models in ONE padded forward (and backward).

Rows of every job are stacked (each job's rows contiguous, right-padded to the longest row of the pass) and
routed through their own model's adapter (multi_lora routes), so adapters of different ranks and target modules
share one pass over the base model. Each job's loss is computed from its own rows only, exactly as if it ran
alone: rows never interact (attention, norms and the loss are per row, the base weights are frozen), and right
padding never changes a real position's output under the causal mask.

Backward is one autograd.grad over the sum of the training jobs' losses with respect to all their adapters'
parameters: the gradient of that sum with respect to one adapter is its own job's gradient. A job whose loss is
not finite is left out of the sum before backward, and a job whose gradient is not finite is not accumulated:
either fails alone. Each job's result is handed to `on_result` as soon as it is known (a forward-only job right
after the forward, a training job after the backward), so futures complete without waiting for the rest.
"""

from __future__ import annotations

import hashlib

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from api_schemas.jobs import ForwardBackward, ForwardBackwardResult, Job, JobResult
from workers.engine.adapter_pool import Adapter, AdapterError, AdapterPool
from workers.engine.base_model import BaseModel
from workers.engine.errors import UserJobError, failure
from workers.engine.full_param import FullRun, FullRuns
from workers.engine.head_logprobs import target_logprobs
from workers.engine.losses import LossOutput, compute_loss
from workers.engine.multi_lora import Route, routed
from workers.scheduler import JobSize

OnResult = Callable[[JobResult], None]


@dataclass
class _Item:
    job: Job
    req: ForwardBackward
    data: list[_Datum]
    adapter: Adapter | FullRun
    offset: int = 0  # this job's first position in the pass's flat log-probs (MergedPass._forward)

    @property
    def forward_only(self) -> bool:
        return self.req.forward_only


@dataclass
class _Datum:
    tokens: np.ndarray  # int64 (n,)
    inputs: dict[str, np.ndarray]

    @classmethod
    def of(cls, tokens: np.ndarray, inputs: dict[str, np.ndarray]) -> _Datum:
        return cls(tokens, {k: a.copy() for k, a in inputs.items()})  # writable copies for torch


def batch_of(job: Job) -> ForwardBackward:
    p = job.payload
    if not isinstance(p, ForwardBackward):
        raise UserJobError(f"{p.kind} is not a forward/forward_backward job")
    if not p.rows:
        raise UserJobError("forward_backward needs at least one datum")
    return p


def job_size(job: Job) -> JobSize:
    """Rows, longest row and tokens of a forward/forward_backward job (computed where the job was built), for the
    scheduler's budget and fairness."""
    p = job.payload
    if not isinstance(p, ForwardBackward) or not p.rows:
        return JobSize()
    return JobSize(rows=p.rows, max_len=max(p.max_len, 1), tokens=max(p.tokens, 1))


class MergedPass:
    """Runs one list of forward/forward_backward jobs (distinct models) as one pass; see the module docstring."""

    def __init__(self, base: BaseModel, pool: AdapterPool | FullRuns) -> None:
        self.base = base
        self.pool = pool

    def run(self, jobs: list[Job], on_result: OnResult) -> None:
        checked: list[tuple[Job, ForwardBackward, list[_Datum]]] = []
        for job in jobs:
            try:
                req = batch_of(job)
                data = [_Datum.of(tokens, inputs) for tokens, inputs in req.datums()]
                _check_targets(data)
                if job.model_id not in self.pool.adapters:
                    raise AdapterError(f"model {job.model_id} is not loaded on this worker")
                checked.append((job, req, data))
            except Exception as e:  # noqa: BLE001 - a bad job fails alone, before it can affect the pass
                on_result(failure(job, e))
        if not checked:
            return
        with self.pool.pinned([job.model_id for job, _, _ in checked]) as adapters:
            items = [_Item(job, req, data, adapter) for (job, req, data), adapter in zip(checked, adapters)]
            picked = self._forward(items)
            trained: list[tuple[_Item, LossOutput]] = []
            for it in items:
                try:
                    out = self._loss(it, picked)
                except Exception as e:  # noqa: BLE001 - the job fails, the step goes on
                    on_result(failure(it.job, e))
                    continue
                if it.forward_only:
                    on_result(_result(it.job, out))
                else:
                    trained.append((it, out))
            del picked
            if trained:
                self._backward(trained, on_result)

    def _forward(self, items: list[_Item]) -> torch.Tensor:
        """Log-probs of every datum's target tokens at its real positions, (positions, targets per position), datums
        in pass order, taken in ONE head pass (workers/engine/head_logprobs.py: chunked, never the whole pass's
        (positions x vocab) at once), so backward builds the head's gradient once for the pass, not once per datum."""
        datums = [d for it in items for d in it.data]
        width = max(len(d.tokens) for d in datums)
        per_position = [_targets(d) for d in datums]
        ids = np.zeros((len(datums), width), dtype=np.int64)
        mask = np.zeros((len(datums), width), dtype=np.int64)
        targets = np.zeros((len(datums), width, max(t.shape[1] for t in per_position)), dtype=np.int64)
        for i, (d, t) in enumerate(zip(datums, per_position)):
            ids[i, : len(d.tokens)] = d.tokens
            mask[i, : len(d.tokens)] = 1
            targets[i, : len(d.tokens), : t.shape[1]] = t  # fewer targets at a position: token 0, never read
        routes, start, offset = [], 0, 0
        for it in items:
            it.offset = offset
            offset += sum(len(d.tokens) for d in it.data)
            stop = start + len(it.data)
            base = it.req.base_only and it.req.forward_only  # a reference pass: the rows skip every adapter
            routes.append(Route(None if base else it.adapter.route_id, start, stop))
            start = stop
        device = self.base.device
        grad = any(not it.forward_only for it in items)
        dropout = {it.job.model_id: (it.adapter.dropout, _generator(it.job, device))
                   for it in items if not it.forward_only and it.adapter.dropout > 0}
        with torch.set_grad_enabled(grad), routed(self.base.layers, routes, dropout=dropout):
            return target_logprobs(self.base.model, torch.from_numpy(ids).to(device),
                                   torch.from_numpy(mask).to(device), torch.from_numpy(targets).to(device))

    def _loss(self, it: _Item, picked: torch.Tensor) -> LossOutput:
        device = picked.device
        lps, inputs = [], []
        offset = it.offset
        for d in it.data:
            tensors = {k: torch.from_numpy(np.ascontiguousarray(v)).to(device) for k, v in d.inputs.items()}
            targets = tensors["target_tokens"]
            n = len(d.tokens)
            lp = picked[offset : offset + n, : targets.numel() // n].reshape(targets.shape)
            offset += n
            # a forward-only job's loss builds no graph, whoever shares the pass (a custom loss runs its own backward)
            lps.append(lp.detach() if it.forward_only else lp)
            inputs.append({k: (v.to(picked.dtype) if v.is_floating_point() else v) for k, v in tensors.items()})
        out = compute_loss(it.req.loss_fn, lps, inputs, it.req.loss_config, it.req.custom_loss)
        if not torch.isfinite(out.loss):
            raise UserJobError("the loss is not finite; gradients were not accumulated")
        return out

    def _backward(self, trained: list[tuple[_Item, LossOutput]], on_result: OnResult) -> None:
        params = [p for it, _ in trained for p in it.adapter.params]
        total = torch.stack([out.loss for _, out in trained]).sum()
        grads = torch.autograd.grad(total, params, allow_unused=True)
        offset = 0
        for it, out in trained:
            n = len(it.adapter.params)
            mine = [torch.zeros_like(w) if g is None else g for g, w in zip(grads[offset : offset + n], it.adapter.params)]
            offset += n
            if not _all_finite(mine):
                on_result(failure(it.job, UserJobError("a gradient is not finite; gradients were not accumulated")))
                continue
            self.pool.accumulate(it.adapter, tuple(mine))
            on_result(_result(it.job, out))


def _generator(job: Job, device: torch.device) -> torch.Generator:
    """The job's own dropout randomness: seeded by its id, so a replay (recovery) or a retry draws the same masks."""
    seed = int(hashlib.sha256(job.job_id.encode()).hexdigest()[:15], 16)
    return torch.Generator(device=device).manual_seed(seed)


def _targets(d: _Datum) -> np.ndarray:
    """A datum's target token ids, one row per position: (tokens, targets per position)."""
    return np.asarray(d.inputs["target_tokens"]).reshape(len(d.tokens), -1)


def _all_finite(grads: list[torch.Tensor]) -> bool:
    """One fused reduction and one host sync for all of an adapter's gradients (max |g| is NaN or inf iff some
    entry is; unlike a 2-norm it cannot overflow on finite values)."""
    if not grads:
        return True
    return bool(torch.stack(torch._foreach_norm(grads, float("inf"))).isfinite().all())


def _check_targets(data: list[_Datum]) -> None:
    for i, d in enumerate(data):
        targets = d.inputs.get("target_tokens")
        if targets is None:
            raise UserJobError(f"datum {i}: loss_fn_inputs has no target_tokens")
        if targets.shape[0] != len(d.tokens):
            raise UserJobError(f"datum {i}: target_tokens has {targets.shape[0]} rows, model_input has {len(d.tokens)} tokens")
        if len(d.tokens) == 0:
            raise UserJobError(f"datum {i}: model_input has no tokens")


def _result(job: Job, out: LossOutput) -> JobResult:
    outputs = [{k: v.detach().cpu().numpy() for k, v in o.items()} for o in out.outputs]
    return JobResult(job_id=job.job_id, output=ForwardBackwardResult.of(outputs, out.metrics))
