"""The Tinker loss-function table: what each `loss_fn` needs, and validation before anything is queued.

Pure data (no torch): the gateway imports it to reject a bad forward_backward with a 400 before queueing,
and the engine (`workers/engine/losses.py`) runs the same checks and reads the resolved config from here,
so both sides agree on names, inputs and defaults. Names follow `tinker/types/loss_fn_type.py` (SDK 0.38.0);
formulas and defaults follow the Tinker loss docs (cookbook `docs/losses.mdx`). `custom` is a loss uploaded with
create_custom_loss: this table checks its loss_id and target_tokens, `custom_loss.py` its graph and inputs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Mapping

__all__ = [
    "LOSS_SPECS",
    "SUPPORTED_LOSSES",
    "LossSpec",
    "LossSpecError",
    "resolve_loss_config",
    "validate_loss_request",
]


class LossSpecError(ValueError):
    """A forward_backward request names an unknown or unsupported loss, or its inputs/config are wrong."""


@dataclass(frozen=True)
class LossSpec:
    name: str
    required_inputs: frozenset[str]
    # Optional per-datum inputs. The SDK types `clip_low_threshold` / `clip_high_threshold` as loss_fn_inputs
    # (tinker/types/datum.py), so clipped losses accept them per datum (one value) or per token.
    optional_inputs: frozenset[str] = frozenset()
    config_defaults: Mapping[str, float] = field(default_factory=lambda: MappingProxyType({}))
    # Numeric config keys that have no documented default and must therefore be given.
    required_config: frozenset[str] = frozenset()
    # Set when this server cannot run the loss; validation then rejects it with this reason.
    unsupported_reason: str | None = None
    # String-valued config keys, all required (custom: loss_id).
    text_config: frozenset[str] = frozenset()
    # True when inputs beyond required/optional are the loss's own business (custom losses declare theirs).
    extra_inputs_ok: bool = False
    # A loss of the native protocol only (its DPOLoss): unknown to Tinker clients, whose table is the SDK's.
    native_only: bool = False
    # Inputs only the native protocol sends (the engine's check accepts them, the Tinker table does not).
    native_inputs: frozenset[str] = frozenset()

    @property
    def config_keys(self) -> frozenset[str]:
        return frozenset(self.config_defaults) | self.required_config | self.text_config


_RL_INPUTS = frozenset({"target_tokens", "logprobs", "advantages"})
_CLIP_INPUTS = frozenset({"clip_low_threshold", "clip_high_threshold"})
# PPO's documented defaults (epsilon 0.2 each side). The docs give cispo's and gspo's thresholds "similarly to
# PPO" without restating defaults, so the same ones are used; clients that care pass them explicitly.
_CLIP_DEFAULTS = MappingProxyType({"clip_low_threshold": 0.8, "clip_high_threshold": 1.2})
# The native GRPO family's KL penalty (GRPOLoss beta > 0): per token kl_weights * (exp(d) - d - 1),
# d = kl_ref_logprobs - lp (the k3 estimator), added to the loss's own per-token term.
KL_INPUTS = frozenset({"kl_ref_logprobs", "kl_weights"})

_SPECS: tuple[LossSpec, ...] = (
    LossSpec("cross_entropy", frozenset({"target_tokens", "weights"}), native_inputs=KL_INPUTS),
    LossSpec("importance_sampling", _RL_INPUTS),
    LossSpec("ppo", _RL_INPUTS, _CLIP_INPUTS, _CLIP_DEFAULTS, native_inputs=KL_INPUTS),
    LossSpec("cispo", _RL_INPUTS, _CLIP_INPUTS, _CLIP_DEFAULTS, native_inputs=KL_INPUTS),
    # The docs show `beta` only as "custom beta" and never state a default; guessing one would silently
    # change the objective, so it must be given.
    LossSpec("dro", _RL_INPUTS, required_config=frozenset({"beta"})),
    LossSpec("gspo", _RL_INPUTS | {"sequence_ratio_mask"}, _CLIP_INPUTS, _CLIP_DEFAULTS, native_inputs=KL_INPUTS),
    # Its config (the SDK docstring names `kl_coeff`) is undocumented, so no keys or defaults are listed.
    LossSpec(
        "stable_reinforce",
        _RL_INPUTS,
        unsupported_reason=(
            "stable_reinforce is not supported by this server: its objective (alpha in Tinker) is not "
            "published, and it needs per-sequence stability records captured at sampling time "
            "(record_stability_info=True) that this server's samplers do not record. "
            "Use ppo, cispo, gspo or importance_sampling instead."
        ),
    ),
    # SAPO (the native protocol's SAPOLoss): per token -g(r) A with the soft gate g(r) = sigmoid(tau (r - 1)) * 4 /
    # tau, tau = tau_pos where A > 0 and tau_neg elsewhere, r = exp(lp - logprobs).
    LossSpec("sapo", _RL_INPUTS, config_defaults=MappingProxyType({"tau_pos": 1.0, "tau_neg": 1.0}), native_only=True,
             native_inputs=KL_INPUTS),
    # Preference losses (the native protocol's DPOLoss and its variants, SimPOLoss, CPOLoss, ORPOLoss): datums in
    # (chosen, rejected) pairs, in order; `weights` mark the response tokens (0/1), `ref_logprobs` the reference
    # model's logprobs of the same targets (zeros: reference-free). `loss_type` (sigmoid | hinge | ipo | kto_pair |
    # orpo) picks the pair term, averaged over pairs and weighted by pref_weight, plus sft_weight * the chosen tokens'
    # mean NLL: not a sum over tokens, so it is computed for the whole batch at once (workers/engine/losses.py `_dpo`).
    LossSpec("dpo", frozenset({"target_tokens", "weights", "ref_logprobs"}),
             config_defaults=MappingProxyType({"beta": 0.1, "label_smoothing": 0.0, "sft_weight": 0.0, "gamma": 0.0,
                                               "normalize": 0.0, "pref_weight": 1.0}),
             text_config=frozenset({"loss_type"}), native_only=True),
    # Distillation (the native protocol's GKDLoss with a teacher's top-k logprobs): target_tokens (N, 1 + K) = the
    # label token (its logprob is returned, not in the loss), then the teacher's top-k token ids at each position;
    # teacher_logprobs (N, 1 + K) their logprobs (column 0 unused), weights (N, 1 + K) = 1 / the batch's label tokens
    # on label positions (0 elsewhere and in column 0). Per position, both sides are renormalised over the K ids at
    # `temperature` and the generalised JSD of the pair (beta: the teacher's weight in the mixture; 0 =
    # KL(teacher || student), 1 = KL(student || teacher)) is weighted by weights[:, 1].
    LossSpec("gkd", frozenset({"target_tokens", "teacher_logprobs", "weights"}),
             config_defaults=MappingProxyType({"beta": 0.5, "temperature": 1.0}), native_only=True),
    # A loss uploaded with create_custom_loss, named by loss_fn_config["loss_id"]. The inputs it reads are declared
    # with it (api_schemas/tinker/custom_loss.py checks them once the gateway has resolved the loss); others are
    # ignored, as the SDK's client-side run of the same loss ignores them.
    LossSpec("custom", frozenset({"target_tokens"}), text_config=frozenset({"loss_id"}), extra_inputs_ok=True),
)

LOSS_SPECS: Mapping[str, LossSpec] = MappingProxyType({s.name: s for s in _SPECS})
# The loss a sample request's `record_stability_info=True` prepares for (the SDK: "StableReinforce training").
STABILITY_LOSS = "stable_reinforce"


def stability_refusal() -> str | None:
    """Why a sample request asking for stability records is refused (the loss's own reason), None once offered:
    the client learns it at its first sample, not after a whole batch was sampled for a forward_backward."""
    return LOSS_SPECS[STABILITY_LOSS].unsupported_reason


# What a Tinker client may name (the native protocol's losses map onto these and the native-only ones).
SUPPORTED_LOSSES: tuple[str, ...] = tuple(s.name for s in _SPECS if s.unsupported_reason is None and not s.native_only)


def _number(loss_fn: str, key: str, value: float | str) -> float:
    # bool is an int subclass; a True threshold is a client bug, not 1.0.
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise LossSpecError(f"{loss_fn}: loss_fn_config[{key!r}] must be a number, got {value!r}")
    if math.isnan(value) or (math.isinf(value) and key != "clip_high_threshold"):  # +inf there: no upper clip
        raise LossSpecError(f"{loss_fn}: loss_fn_config[{key!r}] must be a finite number, got {value!r}")
    return float(value)


def resolve_loss_config(loss_fn: str, config: Mapping[str, float | str], engine: bool = False) -> dict[str, float]:
    """Check `config` against the loss's keys and value ranges; return every key with defaults filled in.
    `engine`: the worker's check, which also knows the native-only losses."""
    spec = _spec(loss_fn, engine)
    unknown = sorted(set(config) - spec.config_keys)
    if unknown:
        allowed = ", ".join(sorted(spec.config_keys)) or "none"
        raise LossSpecError(f"{loss_fn}: unknown loss_fn_config key(s) {unknown}; allowed: {allowed}")
    missing = sorted((spec.required_config | spec.text_config) - set(config))
    if missing:
        raise LossSpecError(f"{loss_fn}: loss_fn_config must set {missing} (there is no documented default)")
    resolved = dict(spec.config_defaults)
    for key, value in config.items():
        if key in spec.text_config:
            if not isinstance(value, str) or not value:
                raise LossSpecError(f"{loss_fn}: loss_fn_config[{key!r}] must be a string, got {value!r}")
            continue  # not a number: read by the caller from `config`
        resolved[key] = _number(loss_fn, key, value)

    if "clip_low_threshold" in resolved:
        lo, hi = resolved["clip_low_threshold"], resolved["clip_high_threshold"]
        _check_clip_thresholds(loss_fn, lo, hi)
    if "beta" in resolved and not (math.isfinite(resolved["beta"]) and resolved["beta"] >= 0):
        raise LossSpecError(f"{loss_fn}: beta must be a finite number >= 0, got {resolved['beta']}")
    if any(not (math.isfinite(resolved.get(k, 1.0)) and resolved.get(k, 1.0) > 0) for k in ("tau_pos", "tau_neg")):
        raise LossSpecError(f"{loss_fn}: tau_pos and tau_neg must be finite numbers > 0")
    if loss_fn == "gkd" and not (resolved["beta"] <= 1 and math.isfinite(resolved["temperature"])
                                 and resolved["temperature"] > 0):
        raise LossSpecError(f"{loss_fn}: beta must be in [0, 1] and temperature a finite number > 0")
    if not 0 <= resolved.get("label_smoothing", 0.0) <= 0.5:
        raise LossSpecError(f"{loss_fn}: label_smoothing must be in [0, 0.5]")
    if not (math.isfinite(resolved.get("sft_weight", 0.0)) and resolved.get("sft_weight", 0.0) >= 0):
        raise LossSpecError(f"{loss_fn}: sft_weight must be a finite number >= 0")
    return resolved


def _check_clip_thresholds(loss_fn: str, lo: float, hi: float) -> None:
    """Ratio clip bounds: 0 <= lo <= hi; hi may be +inf (no upper clip). torch.clamp with lo > hi is silently wrong."""
    if not (math.isfinite(lo) and lo >= 0):
        raise LossSpecError(f"{loss_fn}: clip_low_threshold must be a finite number >= 0, got {lo}")
    if math.isnan(hi) or hi < lo:
        raise LossSpecError(
            f"{loss_fn}: clip_high_threshold ({hi}) must be >= clip_low_threshold ({lo}); "
            "they are ratio bounds such as 0.8 and 1.2, not epsilons"
        )


def validate_loss_request(
    loss_fn: str, input_keys_per_datum: list[set[str]], config: Mapping[str, float | str], engine: bool = False
) -> None:
    """Raise LossSpecError naming what is wrong: the loss name, a datum's loss_fn_inputs keys, or the config.
    `engine`: the worker's check (native-only losses too); without it, the Tinker client's table."""
    spec = _spec(loss_fn, engine)
    if not input_keys_per_datum:
        raise LossSpecError(f"{loss_fn}: the request has no datums")
    allowed = spec.required_inputs | spec.optional_inputs | (spec.native_inputs if engine else frozenset())
    for i, keys in enumerate(input_keys_per_datum):
        missing = sorted(spec.required_inputs - keys)
        if missing:
            raise LossSpecError(
                f"{loss_fn}: datum {i} is missing loss_fn_inputs {missing} "
                f"(required: {sorted(spec.required_inputs)})"
            )
        # Rejecting extras matters: a misspelled or unsupported key (e.g. a "mask") would otherwise be ignored
        # and the user would train on something other than what they think.
        extra = sorted(keys - allowed)
        if extra and not spec.extra_inputs_ok:
            raise LossSpecError(
                f"{loss_fn}: datum {i} has loss_fn_inputs {extra} that this loss does not use "
                f"(allowed: {sorted(allowed)})"
            )
    resolve_loss_config(loss_fn, config, engine)


def _spec(loss_fn: str, engine: bool = False) -> LossSpec:
    spec = LOSS_SPECS.get(loss_fn)
    if spec is None or (spec.native_only and not engine):
        raise LossSpecError(f"unknown loss_fn {loss_fn!r}; supported: {', '.join(SUPPORTED_LOSSES)}")
    if spec.unsupported_reason is not None:
        raise LossSpecError(spec.unsupported_reason)
    return spec
