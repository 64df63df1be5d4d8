"""The LoRA config of `add_adapter_to_model`: twinkle's serialised peft `LoraConfig`, read into a `LoraSpec`.

The client sends `json.dumps(LoraConfig.__dict__)` plus `"_TWINKLE_TYPE_": "LoraConfig"`, as a JSON *string* (a
JSON object is accepted too). Its key set depends on the client's peft version, so unknown keys are ignored; the
keys that change the adapter are read, and a value this server cannot honour is refused by name rather than
silently dropped.
"""

from __future__ import annotations

import json
from typing import Any

from api_schemas.training import ATTN_MODULES, LORA_TARGETS, MLP_MODULES, LoraSpec

__all__ = ["LoraConfigError", "parse_lora_config"]

MAX_CONFIG_CHARS = 64 * 1024

# keys whose non-default values this server does not implement, with the value that is accepted
_MUST_BE: dict[str, tuple[object, ...]] = {
    "use_dora": (False, None),
    "bias": ("none", None),
    "exclude_modules": (None, [], ()),
    "layers_to_transform": (None,),
    "layers_pattern": (None, [], ()),
    "rank_pattern": ({}, None),
    "alpha_pattern": ({}, None),
    "modules_to_save": (None, [], ()),
    "target_parameters": (None, [], ()),
    "trainable_token_indices": (None,),
    "fan_in_fan_out": (False, None),
    # peft's default init (kaiming-uniform A, zero B: a new adapter computes exactly the base model) is the one the
    # engine makes; PiSSA / OLoRA / LoftQ / EVA / CorDA and random inits would change the base weights or the output
    "init_lora_weights": (True, None),
    "lora_bias": (False, None),
    "use_qalora": (False, None),
    "layer_replication": (None,),
    "alora_invocation_tokens": (None,),
}


class LoraConfigError(ValueError):
    """The config cannot be read, or asks for something this server does not do; the message says which key."""


def parse_lora_config(config: object, max_rank: int, seed: int) -> LoraSpec:
    """The adapter `config` asks for (a JSON string or object), within the server's `max_rank`."""
    data = _as_dict(config)
    marker = data.pop("_TWINKLE_TYPE_", "LoraConfig")
    if marker != "LoraConfig":
        raise LoraConfigError(f"config must be a LoraConfig, got a {marker!r}")
    peft_type = data.get("peft_type")
    if peft_type not in (None, "LORA"):
        raise LoraConfigError(f"peft_type {peft_type!r} is not supported; only LORA adapters are offered")
    for key, allowed in _MUST_BE.items():
        if key in data and data[key] not in allowed:
            raise LoraConfigError(f"LoraConfig {key}={data[key]!r} is not supported by this server "
                                  f"(accepted: {allowed[0]!r})")
    rank = data.get("r", 8)
    if not isinstance(rank, int) or isinstance(rank, bool) or not 1 <= rank <= max_rank:
        raise LoraConfigError(f"LoraConfig r must be an integer from 1 to {max_rank}, got {rank!r}")
    alpha = data.get("lora_alpha", 8)
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not 0 < alpha <= 1e6:
        raise LoraConfigError(f"LoraConfig lora_alpha must be a number > 0, got {alpha!r}")
    rslora = data.get("use_rslora", False)
    if not isinstance(rslora, bool):
        raise LoraConfigError(f"LoraConfig use_rslora must be true or false, got {rslora!r}")
    dropout = data.get("lora_dropout") or 0.0
    if not isinstance(dropout, (int, float)) or isinstance(dropout, bool) or not 0 <= dropout <= 0.9:
        raise LoraConfigError(f"LoraConfig lora_dropout must be a number from 0 to 0.9, got {dropout!r}")
    return LoraSpec(rank=rank, seed=seed, alpha=float(alpha), rslora=rslora, dropout=float(dropout),
                    modules=_targets(data.get("target_modules")))


def _as_dict(config: object) -> dict[str, Any]:
    if isinstance(config, str):
        if len(config) > MAX_CONFIG_CHARS:
            raise LoraConfigError(f"config is longer than {MAX_CONFIG_CHARS} characters")
        try:
            config = json.loads(config)
        except ValueError as e:
            raise LoraConfigError(f"config is not valid JSON: {e}") from None
    if not isinstance(config, dict):
        raise LoraConfigError("config must be a serialised LoraConfig (a JSON object or its JSON string)")
    return dict(config)


def _targets(target: object) -> tuple[str, ...]:
    """Layer-name suffixes: `all-linear` is peft's every linear layer but the output head."""
    if target is None or target == "all-linear":
        return ATTN_MODULES + MLP_MODULES
    names = [target] if isinstance(target, str) else target
    if not isinstance(names, (list, tuple)) or not names or not all(isinstance(n, str) for n in names):
        raise LoraConfigError("LoraConfig target_modules must be 'all-linear' or a list of layer names")
    unknown = sorted(set(names) - set(LORA_TARGETS))
    if unknown:
        raise LoraConfigError(f"LoraConfig target_modules {unknown} are not targetable here; "
                              f"accepted: 'all-linear' or names from {list(LORA_TARGETS)}")
    return tuple(n for n in LORA_TARGETS if n in set(names))
