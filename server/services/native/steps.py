"""The native training operations: forward_backward, forward_only, the split forward / calculate_loss / backward,
and the optimizer calls (clip_grad_and_step, step, clip_grad_norm, zero_grad, lr_step) with gradient accumulation.

Each batch becomes the engine's own ForwardBackward job (the adapter's loss turned into the engine's loss table),
so native and Tinker tenants share merged passes. Gradients add up across backwards until a step, as on the Tinker
side. Accumulation is upstream's: an adapter's `gradient_accumulation_steps` (GAS) makes the optimizer calls act
only once a window holds GAS backwards (earlier calls are no-ops, so a loop may call `clip_grad_and_step` after every
micro-batch); the window's summed gradients are divided by its label tokens (loss reduction `sum`, the adapter's
default) or by its number of backwards (`mean`) before clipping, at the step.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from api_schemas.jobs import (
    ForwardBackward,
    ForwardBackwardResult,
    Gradients,
    GradientsResult,
    OptimStep,
    OptimStepResult,
)
from api_schemas.training import SGD, Adam, AdamW, LRSchedule
from api_schemas.native.features import Feature, FeatureError, is_feature_list, read_features
from server.errors import BadRequest
from server.services.context import Context
from server.services.native import losses, metrics
from server.services.native.adapters import Adapter, JobFailed, run, save_state, window_full
from server.services.native.encoding import EncodeError, encode_messages
from server.services.native.losses import EngineBatch

FORWARD_KWARGS = {"gradient_accumulation_steps", "temperature", "return_logits", "disable_lora", "task"}
POLICY_LOSSES = ("GRPOLoss", "PPOLoss", "GSPOLoss", "CISPOLoss", "BNPOLoss", "DRGRPOLoss", "SAPOLoss")
PREFERENCE_LOSSES = ("DPOLoss", "SimPOLoss", "CPOLoss", "ORPOLoss")
CE_LOSSES = ("CrossEntropyLoss", "ChunkedCrossEntropyLoss", "LigerFusedLinearCrossEntropyLoss")
LOSS_KWARGS = {**{name: {"advantages", "old_logps", "ref_logps"} for name in POLICY_LOSSES},
               "DPOLoss": {"ref_outputs", "ref_logps"}, "GKDLoss": {"teacher_topk_logprobs", "teacher_topk_indices"}}


def _features(ctx: Context, adapter: Adapter, inputs: object) -> list[Feature]:
    """InputFeature rows as they are; Trajectories (`messages`) encoded here with the adapter's template
    settings, as twinkle's Template.encode would on the client (server/services/native/encoding.py)."""
    served = ctx.served(adapter.model.base_model)
    if inputs and not is_feature_list(inputs):
        inputs = _encode_trajectories(ctx, adapter, inputs)
    try:
        return read_features(inputs, vocab_size=served.vocab_size, max_len=served.max_context,
                             max_rows=ctx.settings.max_datums_per_request)
    except FeatureError as e:
        raise BadRequest(str(e)) from None


def _encode_trajectories(ctx: Context, adapter: Adapter, inputs: object) -> list[dict[str, Any]]:
    rows = [inputs] if isinstance(inputs, Mapping) else inputs
    if not isinstance(rows, list) or len(rows) > ctx.settings.max_datums_per_request:
        raise BadRequest(f"inputs must be a list of at most {ctx.settings.max_datums_per_request} InputFeatures "
                         "or Trajectories")
    t = adapter.settings.get("template", {}).get("args", {})
    out = []
    for i, row in enumerate(rows):
        if not isinstance(row, Mapping) or not isinstance(row.get("messages"), list):
            raise BadRequest(f"inputs[{i}] is neither an InputFeature (input_ids) nor a Trajectory (messages)")
        try:
            ids, labels = encode_messages(ctx.served(adapter.model.base_model), row["messages"], t.get("max_length"),
                                          t.get("truncation_strategy", "raise"), tools=row.get("tools"),
                                          default_system=t.get("default_system"),
                                          enable_thinking=t.get("enable_thinking", True))
        except EncodeError as e:
            raise BadRequest(f"inputs[{i}]: {e}") from None
        out.append({"input_ids": ids, "labels": labels})
    return out


def check_forward_kwargs(adapter: Adapter, kwargs: dict[str, Any], training: bool = True) -> None:
    loss_name = adapter.settings["loss"]["name"]
    accepted = FORWARD_KWARGS | (LOSS_KWARGS.get(loss_name, set()) if training else set())
    unknown = sorted(set(kwargs) - accepted)
    if unknown:
        raise BadRequest(f"unknown arguments {unknown} for this adapter's {loss_name}; accepted: {sorted(accepted)}")
    if kwargs.get("temperature", 1.0) not in (1, 1.0, None):
        raise BadRequest("temperature other than 1.0 is not supported for training passes")
    if kwargs.get("return_logits"):
        raise BadRequest("return_logits is not supported: logits are vocabulary-sized; logps are returned")
    if kwargs.get("task", "causal_lm") not in ("causal_lm", None):
        raise BadRequest("only task 'causal_lm' is supported")
    if kwargs.get("disable_lora") and training:
        raise BadRequest("disable_lora (a reference pass on the base model) is available on forward_only only")
    gas = kwargs.get("gradient_accumulation_steps")
    if gas is not None and (not isinstance(gas, int) or isinstance(gas, bool) or not 1 <= gas <= 10_000):
        raise BadRequest("gradient_accumulation_steps must be an integer from 1 to 10000")


def summed_loss(adapter: Adapter) -> bool:
    """Whether the adapter's loss is a sum over label tokens (its window is then divided by their count)."""
    loss = adapter.settings["loss"]
    return loss["name"] in CE_LOSSES and loss["args"].get("reduction", "mean") == "sum"


def _engine_batch(ctx: Context, adapter: Adapter, features: list[Feature], kwargs: dict[str, Any],
                  training: bool) -> EngineBatch:
    """The adapter's loss on `features` as an engine batch; passes that only read logps use cross-entropy."""
    loss = adapter.settings["loss"]
    a = loss["args"]
    if not training or loss["name"] in CE_LOSSES:
        return losses.cross_entropy(features, summed_loss(adapter))  # the scale forward_backward reports
    if loss["name"] == "GKDLoss":
        return losses.gkd_datums(features, kwargs.get("teacher_topk_logprobs"), kwargs.get("teacher_topk_indices"),
                                 vocab_size=ctx.served(adapter.model.base_model).vocab_size,
                                 beta=a.get("beta", 0.5), temperature=a.get("temperature", 1.0))
    if loss["name"] in POLICY_LOSSES:
        if kwargs.get("advantages") is None:
            raise BadRequest(f"{loss['name']} needs advantages (one per row, or one per label token)")
        high = a.get("epsilon_high")
        eps = a.get("epsilon", 0.2)
        mode = a.get("loss_agg_mode")
        aggregation = None if mode is None else losses.TOKEN_MEAN if mode == "token-mean" else losses.SEQUENCE_MEAN
        return losses.grpo_datums(features, kwargs["advantages"], kwargs.get("old_logps"), epsilon=eps,
                                  epsilon_high=eps if high is None else high, loss=loss["name"],
                                  aggregation=aggregation, max_completion_length=a.get("max_completion_length", 1024),
                                  tau_pos=a.get("tau_pos", 1.0), tau_neg=a.get("tau_neg", 1.0),
                                  beta=a.get("beta", 0.0), ref_logps=kwargs.get("ref_logps"))
    if loss["name"] not in PREFERENCE_LOSSES:
        raise BadRequest(f"loss {loss['name']} is not available for this operation")
    ref = kwargs.get("ref_logps")
    if ref is None and isinstance(kwargs.get("ref_outputs"), dict):
        ref = kwargs["ref_outputs"].get("logps")
    return losses.preference(loss["name"], a, features, ref)


async def _pass(ctx: Context, adapter: Adapter, features: list[Feature], kwargs: dict[str, Any], *, training: bool,
                forward_only: bool, base_only: bool = False) -> dict[str, Any]:
    batch = _engine_batch(ctx, adapter, features, kwargs, training)
    job = ForwardBackward.build(batch.datums, forward_only=forward_only, loss_fn=batch.loss_fn,
                                loss_config=batch.config, base_only=base_only)
    out = await run(ctx, adapter, job)
    if not isinstance(out, ForwardBackwardResult):
        raise JobFailed("the worker answered a training batch with another result")
    # a value given by the batch (GRPO at ratio 1) leaves out the KL term the engine computed
    engine_loss, kl = float(out.metrics.get("loss:sum", 0.0)), float(out.metrics.get("kl:sum", 0.0))
    loss = engine_loss if batch.value is None else batch.value + kl
    # several targets per position (GKD): the first is the label, the logprob upstream's pass returns
    logps = [(d["logprobs"][:, 0] if d["logprobs"].ndim == 2 else d["logprobs"]).tolist() for d in out.datum_outputs()]
    return {"loss": loss, "logps": logps, "num_tokens": int(sum(int(f.mask.sum()) for f in features))}


def _record(adapter: Adapter, features: list[Feature], result: dict[str, Any], kwargs: dict[str, Any],
            training: bool) -> None:
    metrics.add_loss(adapter.progress, training, result["loss"], result["num_tokens"], summed_loss(adapter))
    metrics.add_rl(adapter.progress, adapter.settings, training, features, result["logps"], kwargs)


async def forward_backward(ctx: Context, adapter: Adapter, inputs: object, kwargs: dict[str, Any]) -> dict[str, Any]:
    check_forward_kwargs(adapter, kwargs)
    if kwargs.get("gradient_accumulation_steps"):
        adapter.settings["gas"] = kwargs["gradient_accumulation_steps"]
    features = _features(ctx, adapter, inputs)
    result = await _pass(ctx, adapter, features, kwargs, training=True, forward_only=False)
    _count_backward(adapter, result["num_tokens"])
    _record(adapter, features, result, kwargs, True)
    await save_state(ctx, adapter)
    return result


async def forward_only(ctx: Context, adapter: Adapter, inputs: object, kwargs: dict[str, Any]) -> dict[str, Any]:
    """No gradients; `disable_lora=True`: the base model alone (the reference logps of DPO)."""
    check_forward_kwargs(adapter, kwargs, training=False)
    features = _features(ctx, adapter, inputs)
    result = await _pass(ctx, adapter, features, kwargs, training=False, forward_only=True,
                         base_only=bool(kwargs.get("disable_lora")))
    metrics.add_loss(adapter.progress, False, result["loss"], result["num_tokens"], summed_loss(adapter))
    await save_state(ctx, adapter)
    return result


# --- the split form: forward (kept), calculate_loss (its loss), backward (the same batch with gradients) ---
async def forward(ctx: Context, adapter: Adapter, inputs: object, kwargs: dict[str, Any]) -> dict[str, Any]:
    check_forward_kwargs(adapter, kwargs, training=False)
    features = _features(ctx, adapter, inputs)
    result = await _pass(ctx, adapter, features, kwargs, training=False, forward_only=True)
    ctx.native.put_forward(adapter.model.id, {"inputs": inputs, "kwargs": {}})
    return result


def _pending(ctx: Context, adapter: Adapter) -> dict[str, Any]:
    pending = ctx.native.forward(adapter.model.id)
    if pending is None:
        raise BadRequest("no forward is waiting for this adapter: call forward(inputs) first")
    return dict(pending)


async def calculate_loss(ctx: Context, adapter: Adapter, kwargs: dict[str, Any]) -> float:
    """The adapter's loss on the waiting forward's batch (the loss kwargs, e.g. GRPO's advantages, are kept for
    its backward)."""
    pending = _pending(ctx, adapter)
    check_forward_kwargs(adapter, kwargs)
    features = _features(ctx, adapter, pending["inputs"])
    result = await _pass(ctx, adapter, features, kwargs, training=True, forward_only=True)
    ctx.native.put_forward(adapter.model.id, {"inputs": pending["inputs"], "kwargs": kwargs})
    return float(result["loss"])


async def backward(ctx: Context, adapter: Adapter, kwargs: dict[str, Any]) -> None:
    """The gradients of the waiting forward's batch under the adapter's loss (computed again: the engine keeps no
    graph between requests, so this equals a forward_backward of that batch)."""
    pending = _pending(ctx, adapter)
    if kwargs.get("gradient_accumulation_steps"):
        check_forward_kwargs(adapter, {"gradient_accumulation_steps": kwargs["gradient_accumulation_steps"]})
        adapter.settings["gas"] = kwargs["gradient_accumulation_steps"]
    features = _features(ctx, adapter, pending["inputs"])
    loss_kwargs = pending.get("kwargs") or {}
    result = await _pass(ctx, adapter, features, loss_kwargs, training=True, forward_only=False)
    ctx.native.drop_forward(adapter.model.id)
    _count_backward(adapter, result["num_tokens"])
    _record(adapter, features, result, loss_kwargs, True)
    await save_state(ctx, adapter)


def _count_backward(adapter: Adapter, tokens: int) -> None:
    p = adapter.progress
    p["backwards"] = p.get("backwards", 0) + 1
    window = p.setdefault("window", {"backwards": 0, "tokens": 0})
    window["backwards"] += 1
    window["tokens"] += tokens


# --- optimizer calls ---
def _window_full(adapter: Adapter) -> bool:
    return window_full(adapter.settings, adapter.progress)


def _grad_scale(adapter: Adapter) -> float:
    """1 / the window's label tokens (a summed loss) or 1 / its backwards (a mean loss), as upstream divides."""
    window = adapter.progress.get("window", {})
    tokens, backwards = window.get("tokens", 0), window.get("backwards", 0)
    return 1.0 / max(tokens if summed_loss(adapter) and tokens > 0 else backwards, 1)


def _optimizer(adapter: Adapter, max_grad_norm: float | None) -> AdamW | Adam | SGD:
    opt = adapter.settings.get("optimizer")
    if opt is None:
        raise BadRequest("no optimizer: call set_optimizer first (AdamW, Adam or SGD)")
    a, clip = opt["args"], max_grad_norm or 0.0
    if opt["name"] == "SGD":
        return SGD(learning_rate=a["lr"], momentum=a["momentum"], nesterov=a["nesterov"],
                   weight_decay=a["weight_decay"], grad_clip_norm=clip)
    kind = Adam if opt["name"] == "Adam" else AdamW
    return kind(learning_rate=a["lr"], beta1=a["betas"][0], beta2=a["betas"][1], eps=a["eps"],
                weight_decay=a["weight_decay"], grad_clip_norm=clip)


def _schedule(adapter: Adapter, lr: float) -> LRSchedule | None:
    sched = adapter.settings.get("scheduler")
    if sched is None or sched["name"] in ("constant", "ConstantScheduler"):
        return None
    a = sched["args"]
    if sched["name"] in ("CosineWarmupScheduler", "LinearWarmupScheduler"):
        kind: Literal["cosine", "linear"] = "cosine" if sched["name"] == "CosineWarmupScheduler" else "linear"
        return LRSchedule(kind=kind, warmup_steps=a["num_warmup_steps"], total_steps=a["num_training_steps"])
    if sched["name"] == "LinearLR":
        return LRSchedule(kind="linear", total_steps=a["total_iters"], start_ratio=a["start_factor"],
                          min_ratio=a["end_factor"])
    if sched["name"] == "CosineAnnealingLR":
        floor = a["eta_min"] / lr if lr > 0 else 0.0
        if floor > 1:
            raise BadRequest(f"CosineAnnealingLR eta_min {a['eta_min']} is above the learning rate {lr}")
        return LRSchedule(kind="cosine", total_steps=a["T_max"], min_ratio=floor)
    raise BadRequest(f"scheduler {sched['name']} is not available")


def _check_norm(norm_type: object) -> None:
    if norm_type not in (2, 2.0):
        raise BadRequest("only norm_type 2 (the L2 norm) is supported")


async def step(ctx: Context, adapter: Adapter, max_grad_norm: float | None, norm_type: object = 2) -> str:
    """One optimizer step once the accumulation window is full (clipping at `max_grad_norm`; None: the clip of a
    clip_grad_norm before it, if any); the gradient norm as upstream prints it, or "None" when the call was a
    no-op inside the window."""
    _check_norm(norm_type)
    if max_grad_norm is None:
        max_grad_norm = adapter.progress.get("pending_clip")
    if max_grad_norm is not None and (not isinstance(max_grad_norm, (int, float)) or not max_grad_norm >= 0):
        raise BadRequest("max_grad_norm must be a number >= 0")
    optimizer = _optimizer(adapter, max_grad_norm)
    if not _window_full(adapter):
        return "None"
    job = OptimStep(optimizer=optimizer, schedule=_schedule(adapter, optimizer.learning_rate),
                    grad_scale=_grad_scale(adapter))
    out = await run(ctx, adapter, job)
    if not isinstance(out, OptimStepResult):
        raise JobFailed("the worker answered an optimizer step with another result")
    adapter.progress["window"] = {"backwards": 0, "tokens": 0}
    adapter.progress.pop("pending_clip", None)
    adapter.progress["steps"] = out.step
    metrics.add_step(adapter.progress, out.metrics.get("grad_norm", 0.0), out.learning_rate)
    await save_state(ctx, adapter)
    return str(out.metrics.get("grad_norm", 0.0))


async def clip_grad_norm(ctx: Context, adapter: Adapter, max_grad_norm: float, norm_type: object) -> str:
    """The window's gradient norm (as the step divides them); the clip is applied by the next `step`, with the
    same arithmetic as clipping now (the coefficient comes from that norm). Inside a window: a no-op, "None"."""
    _check_norm(norm_type)
    if not isinstance(max_grad_norm, (int, float)) or not max_grad_norm >= 0:
        raise BadRequest("max_grad_norm must be a number >= 0")
    if not _window_full(adapter):
        return "None"
    out = await run(ctx, adapter, Gradients(action="norm", grad_scale=_grad_scale(adapter)))
    if not isinstance(out, GradientsResult):
        raise JobFailed("the worker answered a gradient norm with another result")
    adapter.progress["pending_clip"] = float(max_grad_norm)
    await save_state(ctx, adapter)
    return str(out.grad_norm)


async def zero_grad(ctx: Context, adapter: Adapter) -> None:
    """Drop a full window's gradients without a step; inside a window (or after a step) a no-op, as upstream."""
    if not _window_full(adapter):
        return
    out = await run(ctx, adapter, Gradients(action="clear"))
    if not isinstance(out, GradientsResult):
        raise JobFailed("the worker answered zero_grad with another result")
    adapter.progress["window"] = {"backwards": 0, "tokens": 0}
    adapter.progress.pop("pending_clip", None)
    await save_state(ctx, adapter)
