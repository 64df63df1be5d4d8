"""Executes training jobs on the base model + adapter pool and turns each into a JobResult.

A job that fails for a user reason (bad shapes, non-finite loss, missing checkpoint) yields a failed result with
category `user`; anything else is `server`. Either way the worker goes on with the next job.
"""

from __future__ import annotations

import json
import logging

import numpy as np
import torch

from api_schemas.jobs import (
    CreateModel,
    ErrorCategory,
    ForwardBackward,
    Job,
    JobError,
    JobResult,
    LoadWeights,
    OptimStep,
    SaveWeights,
    Skip,
)
from api_schemas.tinker.losses import LossSpecError
from api_schemas.tinker.proto import decode_forward_backward, encode_forward_backward_output, parse_forward_backward
from workers.checkpoints.store import CheckpointStore
from workers.engine.adapter_pool import AdapterError, AdapterPool
from workers.engine.base_model import BaseModel
from workers.engine.losses import compute_loss
from workers.engine.multi_lora import Route, routed
from workers.engine.optim import AdamHyper, InvalidAdamParamsError, NonFiniteGradError, adam_step

log = logging.getLogger(__name__)


class UserJobError(ValueError):
    """The job cannot run because of what the user sent; reported with category `user`."""


class Trainer:
    def __init__(self, base: BaseModel, store: CheckpointStore) -> None:
        self.base = base
        self.pool = AdapterPool(base)
        self.store = store

    def execute(self, job: Job) -> JobResult:
        try:
            media_type, body = self._run(job)
            return JobResult(job_id=job.job_id, media_type=media_type, body=body)
        except (UserJobError, AdapterError, LossSpecError, NonFiniteGradError, InvalidAdamParamsError) as e:
            log.info("job %s (%s) failed: %s", job.job_id, job.payload.kind, e)
            return JobResult(job_id=job.job_id, error=JobError(category=ErrorCategory.USER, message=str(e)))
        except Exception as e:  # a server fault must fail only this job, never the worker
            log.exception("job %s (%s) crashed", job.job_id, job.payload.kind)
            msg = f"internal error while running {job.payload.kind}: {type(e).__name__}"
            return JobResult(job_id=job.job_id, error=JobError(category=ErrorCategory.SERVER, message=msg))

    def _run(self, job: Job) -> tuple[str, bytes]:
        p = job.payload
        if isinstance(p, CreateModel):
            self.pool.create(job.model_id, p.lora)
            return _ok({"model_id": job.model_id, "type": "create_model"})
        if isinstance(p, ForwardBackward):
            return "application/x-protobuf", self.forward_backward(job.model_id, p)
        if isinstance(p, OptimStep):
            return _ok({"metrics": self.optim_step(job.model_id, p)})
        if isinstance(p, SaveWeights):
            adapter = self.pool.get(job.model_id)
            with self.store.writing(p.storage_key) as folder:
                self.pool.save(adapter, folder, p.with_optimizer)
                written = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
                if p.max_bytes is not None and written > p.max_bytes:  # raising here discards the folder
                    raise UserJobError(f"storage quota exceeded: the checkpoint needs {written} bytes, "
                                       f"{max(p.max_bytes, 0)} are left; delete checkpoints to free space")
            key = "save_weights" if p.with_optimizer else "save_weights_for_sampler"
            if "/external_weights/" in p.tinker_path:
                key = "save_weights_external"
            size = self.store.size_bytes(p.storage_key)
            if p.sampling_session_id is not None:  # ephemeral: the client samples from this session, no path
                return _ok({"sampling_session_id": p.sampling_session_id, "type": key, "size_bytes": size})
            return _ok({"path": p.tinker_path, "type": key, "size_bytes": size})
        if isinstance(p, LoadWeights):
            folder = self.store.existing(p.storage_key)
            if folder is None:
                raise UserJobError("checkpoint files not found (deleted or expired)")
            self.pool.load(job.model_id, folder, p.with_optimizer, p.create)
            return _ok({"model_id": job.model_id, "type": "load_weights"})
        if isinstance(p, Skip):
            return _ok({"skipped": p.reason})
        raise UserJobError(f"unsupported job kind {p.kind}")

    def forward_backward(self, model_id: str, p: ForwardBackward) -> bytes:
        adapter = self.pool.get(model_id)
        req = decode_forward_backward(parse_forward_backward(p.request_pb))
        if not req.data:
            raise UserJobError("forward_backward needs at least one datum")
        device = self.base.device
        lengths = [len(d.tokens) for d in req.data]
        width = max(lengths)
        ids = torch.zeros(len(lengths), width, dtype=torch.long)
        mask = torch.zeros(len(lengths), width, dtype=torch.long)
        for i, d in enumerate(req.data):
            ids[i, : lengths[i]] = torch.from_numpy(d.tokens)
            mask[i, : lengths[i]] = 1
        ids, mask = ids.to(device), mask.to(device)
        with torch.set_grad_enabled(not p.forward_only), routed(self.base.layers, [Route(model_id, 0, len(lengths))]):
            logp = self.base.logprob_logits(ids, mask)
        lps, inputs = [], []
        for i, d in enumerate(req.data):
            tensors = {k: torch.from_numpy(np.ascontiguousarray(v)).to(device) for k, v in d.inputs.items()}
            if "target_tokens" not in tensors:
                raise UserJobError(f"datum {i}: loss_fn_inputs has no target_tokens")
            targets = tensors["target_tokens"]
            n = lengths[i]
            if targets.shape[0] != n:
                raise UserJobError(f"datum {i}: target_tokens has {targets.shape[0]} rows, model_input has {n} tokens")
            flat = targets.reshape(n, -1)
            lp = logp[i, :n].gather(-1, flat).reshape(targets.shape)
            lps.append(lp)
            inputs.append({k: (v.to(logp.dtype) if v.is_floating_point() else v) for k, v in tensors.items()})
        out = compute_loss(req.loss_fn, lps, inputs, req.loss_fn_config)
        if not torch.isfinite(out.loss):
            raise UserJobError("the loss is not finite; gradients were not accumulated")
        if not p.forward_only:
            grads = torch.autograd.grad(out.loss, adapter.params, allow_unused=True)
            grads = tuple(torch.zeros_like(w) if g is None else g for g, w in zip(grads, adapter.params))
            if not all(torch.isfinite(g).all() for g in grads):
                raise UserJobError("a gradient is not finite; gradients were not accumulated")
            self.pool.accumulate(adapter, grads)
        outputs = [{k: v.detach().cpu().numpy() for k, v in o.items()} for o in out.outputs]
        return encode_forward_backward_output(outputs, out.metrics)

    def optim_step(self, model_id: str, p: OptimStep) -> dict[str, float]:
        adapter = self.pool.get(model_id)
        for w, g in zip(adapter.params, adapter.grads):
            w.grad = torch.zeros_like(w) if g is None else g
        try:
            metrics = adam_step(adapter.params, adapter.optim, AdamHyper(**p.adam.model_dump()))
        finally:
            for w in adapter.params:
                w.grad = None
        adapter.grads = [None] * len(adapter.params)
        return metrics


def _ok(payload: dict) -> tuple[str, bytes]:
    return "application/json", json.dumps(payload).encode()
