"""The native protocol's allow-lists: every `*_cls` name a twinkle client may send, and the kwargs each accepts.

The twinkle client names a server-side class for each slot of an adapter (`set_loss("CrossEntropyLoss", ...)`,
`set_optimizer("AdamW", lr=...)`, ...). Upstream imports whatever it is told to; here a name is a key of the table of
its slot, its kwargs are validated by that entry's model (unknown kwargs refused), and the result is plain data the
gateway turns into engine jobs. Nothing is imported, downloaded or unpickled because a client named it: a name
outside the table, a hub plugin id (`ms://...`, `hf://...`) or a kwarg outside the schema is a ComponentError
(a 400 naming what is accepted).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

__all__ = ["COMPONENTS", "REFUSED", "Component", "ComponentError", "Slot", "resolve"]

Slot = Literal["loss", "optimizer", "scheduler", "metric", "template", "processor", "patch"]


class ComponentError(ValueError):
    """A `*_cls` name or its kwargs that the server does not accept; the message says what it does accept."""


class Component(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)  # NaN / Inf: refused by name


# --- losses (twinkle.loss): each maps onto an engine loss; the formulas are the engine's (api_schemas/losses.py)
class CrossEntropyLoss(Component):
    """-log p(label) over the labels that are not -100: averaged over the batch's label tokens (`mean`, the class
    default) or summed (`sum`, the adapter's default) with the gradients of an accumulation window divided by its
    label tokens at the step, as upstream does."""

    ignore_index: Literal[-100] = -100
    reduction: Literal["mean", "sum"] = "mean"


class ChunkedCrossEntropyLoss(CrossEntropyLoss):
    """CrossEntropyLoss computed in chunks upstream (a memory saving): the same loss here."""

    chunk_size: int = Field(..., ge=1)


class LigerFusedLinearCrossEntropyLoss(CrossEntropyLoss):
    """CrossEntropyLoss fused with the head upstream (a kernel): the same loss here, summed by default."""

    reduction: Literal["mean", "sum"] = "sum"
    label_smoothing: float = Field(0.0, ge=0, le=0)
    softcap: None = None


class GRPOLoss(Component):
    """Upstream's GRPO objective: per token -min(r A, clip(r, 1 - epsilon, 1 + epsilon_high) A) + beta KL,
    r = exp(logp - old_logp), KL = exp(ref - logp) - (ref - logp) - 1 with the `ref_logps` the client sends
    (forward_only(disable_lora=True) of the same rows), averaged over each sequence's label tokens, then over the
    batch."""

    epsilon: float = Field(0.2, ge=0, lt=1)
    epsilon_high: float | None = Field(None, ge=0)
    beta: float = Field(0.0, ge=0, le=100)
    entropy_coef: float = Field(0.0, ge=0, le=0)  # only 0 (no entropy bonus) is offered
    ignore_index: Literal[-100] = -100


class PPOLoss(GRPOLoss):
    """GRPOLoss's objective averaged over all the batch's label tokens (`token-mean`) or per sequence first."""

    loss_agg_mode: Literal["token-mean", "seq-mean-token-mean"] = "token-mean"


class GSPOLoss(GRPOLoss):
    """The ratio of each token is its sequence's mean log ratio, exponentiated (sequence-level importance)."""


class CISPOLoss(GRPOLoss):
    """-sg(min(r, 1 + epsilon)) A logp, averaged over the batch's label tokens."""


class BNPOLoss(GRPOLoss):
    """GRPOLoss averaged over the batch's label tokens."""


class DRGRPOLoss(GRPOLoss):
    """GRPOLoss summed and divided by rows x max_completion_length."""

    max_completion_length: int = Field(1024, ge=1)


class SAPOLoss(GRPOLoss):
    """Soft-gated policy loss: -sigmoid(tau (r - 1)) * 4 / tau * A, tau_pos for A > 0, tau_neg otherwise."""

    tau_pos: float = Field(1.0, gt=0)
    tau_neg: float = Field(1.0, gt=0)


class DPOLoss(Component):
    """Upstream's DPO on (chosen, rejected) row pairs; reference logps from a `disable_lora` forward_only."""

    beta: float = Field(0.1, gt=0)
    label_smoothing: float = Field(0.0, ge=0, le=0.5)
    ignore_index: Literal[-100] = -100
    loss_type: Literal["sigmoid", "hinge", "ipo", "kto_pair"] = "sigmoid"
    reference_free: bool = False
    sft_weight: float = Field(0.0, ge=0)


class SimPOLoss(Component):
    """-logsigmoid(beta * (mean logp chosen - mean logp rejected) - gamma), no reference model."""

    beta: float = Field(2.5, gt=0)
    gamma: float = 0.5
    ignore_index: Literal[-100] = -100


class CPOLoss(Component):
    """Reference-free sigmoid DPO plus bc_coef * the chosen rows' mean NLL."""

    beta: float = Field(0.1, gt=0)
    bc_coef: float = Field(1.0, ge=0)
    ignore_index: Literal[-100] = -100


class ORPOLoss(Component):
    """The chosen rows' mean NLL plus lambda_orpo * -logsigmoid(log odds ratio of the mean logps)."""

    lambda_orpo: float = Field(0.1, ge=0)
    ignore_index: Literal[-100] = -100


class GKDLoss(Component):
    """Generalised JSD between student and teacher over the teacher's top-k ids per label position (the
    teacher_topk_logprobs / teacher_topk_indices the client sends, e.g. a served teacher's prompt logprobs);
    beta 0: KL(teacher || student), 1: KL(student || teacher)."""

    beta: float = Field(0.5, ge=0, le=1)
    temperature: float = Field(1.0, gt=0, le=100)
    ignore_index: Literal[-100] = -100
    chunk_size: int = Field(512, ge=1)  # memory only upstream


# --- optimizers (torch.optim; upstream's defaults: lr 1e-5, weight_decay 0.01 in the param group)
class AdamW(Component):
    lr: float = Field(1e-5, ge=0)
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = Field(1e-8, ge=0)
    weight_decay: float = Field(0.01, ge=0)
    amsgrad: Literal[False] = False
    foreach: bool | None = None  # implementation choices of torch's; the update is the same
    fused: bool | None = None


class Adam(AdamW):
    """torch.optim.Adam: weight decay as L2 on the gradient."""


class SGD(Component):
    lr: float = Field(1e-5, ge=0)
    momentum: float = Field(0.0, ge=0)
    nesterov: bool = False
    dampening: float = Field(0.0, ge=0, le=0)  # only 0
    weight_decay: float = Field(0.01, ge=0)
    foreach: bool | None = None


# --- learning-rate schedulers (torch.optim.lr_scheduler and twinkle.module.scheduler), by optimizer step
class CosineWarmupScheduler(Component):
    num_warmup_steps: int = Field(ge=0)
    num_training_steps: int = Field(ge=1)
    num_cycles: float = Field(0.5, ge=0.5, le=0.5)  # only the half cosine


class LinearWarmupScheduler(Component):
    num_warmup_steps: int = Field(ge=0)
    num_training_steps: int = Field(ge=1)


class LinearLR(Component):
    start_factor: float = Field(1.0 / 3, gt=0, le=1)
    end_factor: float = Field(1.0, ge=0, le=1)
    total_iters: int = Field(5, ge=1)


class CosineAnnealingLR(Component):
    T_max: int = Field(ge=1)  # noqa: N815 - torch's own argument name
    eta_min: float = Field(0.0, ge=0)


class ConstantScheduler(Component):
    """The optimizer's rate at every step (also what no scheduler means)."""


# --- metrics (twinkle.metric), reported and reset by calculate_metric
class LossMetric(Component):
    pass


class Accuracy(Component):
    pass


class TrainMetric(Component):
    pass


class DPOMetric(Component):
    beta: float = Field(0.1, gt=0)


class GRPOMetric(Component):
    epsilon: float = Field(0.2, ge=0, lt=1)
    epsilon_high: float | None = Field(None, ge=0)


# --- templates: the served model's own chat template, whatever the name (the tokenizer is the server's)
class Template(Component):
    model_id: str | None = None  # the client's tokenizer id; the server always uses the served model's own
    use_chat_template: Literal[True] = True
    max_length: int | None = Field(None, ge=1)
    truncation_strategy: Literal["raise", "left", "right", "delete"] = "raise"
    default_system: str | None = Field(None, max_length=8192)
    enable_thinking: bool = True


# --- the collator (padding is the engine's business: any choice gives the same rows)
class InputProcessor(Component):
    padding_side: Literal["left", "right"] = "right"
    padding_free: bool = False
    framework: Literal["transformers"] = "transformers"
    device_mesh: None = None


COMPONENTS: dict[Slot, dict[str, type[Component]]] = {
    "loss": {"CrossEntropyLoss": CrossEntropyLoss, "ChunkedCrossEntropyLoss": ChunkedCrossEntropyLoss,
             "LigerFusedLinearCrossEntropyLoss": LigerFusedLinearCrossEntropyLoss, "GKDLoss": GKDLoss,
             "GRPOLoss": GRPOLoss, "PPOLoss": PPOLoss, "GSPOLoss": GSPOLoss,
             "CISPOLoss": CISPOLoss, "BNPOLoss": BNPOLoss, "DRGRPOLoss": DRGRPOLoss, "SAPOLoss": SAPOLoss,
             "DPOLoss": DPOLoss,
             "SimPOLoss": SimPOLoss, "CPOLoss": CPOLoss, "ORPOLoss": ORPOLoss},
    "optimizer": {"AdamW": AdamW, "Adam": Adam, "SGD": SGD},
    "scheduler": {
        "CosineWarmupScheduler": CosineWarmupScheduler, "LinearWarmupScheduler": LinearWarmupScheduler,
        "LinearLR": LinearLR, "CosineAnnealingLR": CosineAnnealingLR, "constant": ConstantScheduler,
        "ConstantScheduler": ConstantScheduler,
    },
    "metric": {"LossMetric": LossMetric, "Accuracy": Accuracy, "TrainMetric": TrainMetric, "DPOMetric": DPOMetric,
               "GRPOMetric": GRPOMetric},
    "template": {"Template": Template, "Qwen3_5Template": Template},
    "processor": {"InputProcessor": InputProcessor},
    "patch": {},  # patches change the model every tenant shares: none is offered
}


# Names upstream has that no client can use against a served causal LM with LoRA adapters, each with the reason
_HEAD = "the served model is a causal LM whose adapters train its LoRA weights only"
REFUSED: dict[Slot, dict[str, str]] = {
    "loss": {
        "MSELoss": f"MSELoss compares logits to labels of the same shape (a regression head); {_HEAD}, and its "
                   "vocabulary logits have no such labels (upstream fails on them too)",
        "PPOValueLoss": f"PPOValueLoss trains a value head (upstream's TransformersValueModel, which refuses LoRA); "
                        f"{_HEAD} and has none",
        "InfonceLoss": "InfonceLoss needs sentence embeddings (forward with task='embedding'), which this server's "
                       "engine does not compute: it trains on token logprobs only",
    },
    "template": {
        "DeepseekV4Template": "DeepseekV4Template encodes DeepSeek-V4's own chat format, and no DeepSeek-V4 model is "
                              "served here; use Template (the served model's own chat template)",
    },
}


def resolve(slot: Slot, name: object, kwargs: dict[str, Any]) -> tuple[str, Component]:
    """(name, validated kwargs) of an allowed component; ComponentError naming what is accepted otherwise."""
    table = COMPONENTS[slot]
    accepted = ", ".join(sorted(table)) or "none"
    refused = REFUSED.get(slot, {})
    if isinstance(name, str) and name in refused:
        raise ComponentError(f"{slot} {name} is not offered: {refused[name]}; accepted: {accepted}")
    if not isinstance(name, str) or name not in table:
        hint = " (hub plugins are not loaded by this server)" if isinstance(name, str) and "://" in name else ""
        raise ComponentError(f"{slot} {name!r} is not offered by this server{hint}; accepted: {accepted}")
    entry = table[name]
    try:
        return name, entry.model_validate(kwargs)
    except ValidationError as e:
        fields = ", ".join(entry.model_fields) or "none"
        problems = "; ".join(f"{'.'.join(str(p) for p in err['loc']) or name}: {err['msg']}" for err in e.errors())
        raise ComponentError(f"{slot} {name} arguments: {problems} (accepted arguments: {fields})") from None
