"""What a training model is made of and how it steps, as the job contract carries it: the LoRA spec (rank, targets,
alpha, rsLoRA, dropout), the optimizers (AdamW, Adam, SGD) and the learning-rate schedule. Used by api_schemas/jobs.py
(CreateModel, OptimStep) and read by the engine (workers/engine/adapter_pool.py, optim.py)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field


class Frozen(BaseModel):
    """The contract's models: immutable, no unknown fields, bytes as base64 and inf/nan as constants in JSON."""

    model_config = ConfigDict(frozen=True, extra="forbid", ser_json_bytes="base64", val_json_bytes="base64",
                              ser_json_inf_nan="constants")


# The layers an adapter can target, by name suffix (train_attn, train_mlp, train_unembed select the groups).
ATTN_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
UNEMBED_MODULES = ("lm_head",)
LORA_TARGETS = ATTN_MODULES + MLP_MODULES + UNEMBED_MODULES


class LoraSpec(Frozen):
    rank: int
    seed: int | None = None
    train_attn: bool = True
    train_mlp: bool = True
    train_unembed: bool = True
    # The native client's LoraConfig (the Tinker SDK sends none of these): the scale's alpha (None: the server's
    # default), rsLoRA (alpha / sqrt(rank) instead of alpha / rank), and the targeted layers by name suffix
    # (e.g. q_proj, down_proj) instead of the three groups above (None: the groups).
    alpha: float | None = None
    rslora: bool = False
    modules: tuple[str, ...] | None = None
    dropout: float = Field(0.0, ge=0, lt=1)  # PEFT's lora_dropout on the adapter's input, in training passes


class AdamW(Frozen):
    """torch.optim.AdamW's update, with global grad-norm clipping of the adapter's own parameters first."""

    kind: Literal["adamw"] = "adamw"
    learning_rate: float
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0  # <= 0: no clipping


class SGD(Frozen):
    """torch.optim.SGD's update (momentum, dampening 0, optional Nesterov), after the same clipping."""

    kind: Literal["sgd"] = "sgd"
    learning_rate: float
    momentum: float = 0.0
    nesterov: bool = False
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0


class Adam(AdamW):
    """torch.optim.Adam's update (and its defaults): weight decay as L2, added to the clipped gradient, not
    decoupled as AdamW's."""

    kind: Literal["adam"] = "adam"  # type: ignore[assignment]
    beta2: float = 0.999
    eps: float = 1e-8


Optimizer = Annotated[AdamW | Adam | SGD, Field(discriminator="kind")]


class LRSchedule(Frozen):
    """Scales the step's learning rate by where the model is in its schedule (the engine counts the steps).

    factor(step) = step / warmup_steps during warm-up, then 1 (constant), a linear decay or a half cosine from
    `start_ratio` down (or up) to `min_ratio` at `total_steps` (and `min_ratio` after it)."""

    kind: Literal["constant", "linear", "cosine"] = "constant"
    warmup_steps: int = 0
    total_steps: int | None = None  # needed by linear and cosine
    min_ratio: float = 0.0  # the factor at total_steps
    start_ratio: float = 1.0  # the factor where the decay starts (torch's LinearLR start_factor)
