"""Checks a forward_backward request against the served model before anything is queued (-> 400 with a reason)."""

from __future__ import annotations

import numpy as np

from api_schemas.models import ServedModel
from api_schemas.tinker.custom_loss import CustomLossProgram, check_custom_inputs
from api_schemas.losses import LossSpecError, validate_loss_request
from api_schemas.tinker.proto import DecodedDatum, DecodedForwardBackward
from api_schemas.tinker.provenance import ProvenanceError, check_tiling
from server.errors import BadRequest


def check_forward_backward(
    req: DecodedForwardBackward, served: ServedModel, max_datums: int, custom: CustomLossProgram | None = None
) -> None:
    """`custom`: the graph a loss_fn "custom" request names; its inputs are checked by their declared ranks."""
    if not req.data:
        raise BadRequest("forward_backward needs at least one datum")
    if len(req.data) > max_datums:
        raise BadRequest(f"{len(req.data)} datums in one request; the limit is {max_datums}")
    try:
        validate_loss_request(req.loss_fn, [set(d.inputs) for d in req.data], req.loss_fn_config)
        if custom is not None:
            check_custom_inputs(custom, [{k: tuple(v.shape) for k, v in d.inputs.items()} for d in req.data])
    except (LossSpecError, ValueError) as e:
        raise BadRequest(str(e)) from e
    # The value checks run over the whole batch at once (numpy calls cost more than these small arrays); only when
    # one fails are they repeated datum by datum, so the first problem is named as before.
    ids_ok = _ids_in(req.data, served.vocab_size)
    finite_ok = _all_finite(req.data)
    for i, d in enumerate(req.data):
        n = len(d.tokens)
        if n == 0:
            raise BadRequest(f"datum {i}: model_input is empty")
        if n > served.max_context:
            raise BadRequest(f"datum {i}: {n} tokens exceed the model's context of {served.max_context}")
        if not ids_ok:
            _check_ids(f"datum {i}: model_input", d.tokens, served.vocab_size)
        targets = d.inputs.get("target_tokens")
        if targets is not None:
            if targets.dtype.kind != "i":
                raise BadRequest(f"datum {i}: target_tokens must be int64")
            if targets.ndim not in (1, 2) or targets.shape[0] != n:
                raise BadRequest(
                    f"datum {i}: target_tokens has shape {list(targets.shape)}; expected ({n},) or ({n}, K)"
                )
            if not ids_ok:
                _check_ids(f"datum {i}: target_tokens", targets, served.vocab_size)
        if d.provenance is not None:
            try:
                check_tiling(d.provenance, n, n if targets is None else targets.shape[0])
            except ProvenanceError as e:
                raise BadRequest(f"datum {i}: {e}") from e
        for name, arr in d.inputs.items():
            if not finite_ok and arr.dtype.kind == "f" and not np.isfinite(arr).all():
                raise BadRequest(f"datum {i}: loss_fn_inputs[{name!r}] contains NaN or Inf")
            if custom is not None and name != "target_tokens":
                continue  # a custom loss's inputs have the ranks it declared, not necessarily the datum's length
            if arr.ndim == 0 or arr.shape[0] != n:
                raise BadRequest(
                    f"datum {i}: loss_fn_inputs[{name!r}] has shape {list(arr.shape)}; its first dimension must be {n}"
                )


def _check_ids(what: str, ids: np.ndarray, vocab: int) -> None:
    if ids.size and (ids.min() < 0 or ids.max() >= vocab):
        raise BadRequest(f"{what} holds token ids outside the vocabulary [0, {vocab})")


def _ids_in(data: list[DecodedDatum], vocab: int) -> bool:
    """Whether every token id of the batch (model inputs and target_tokens) is inside the vocabulary."""
    ids = [d.tokens for d in data] + [t.ravel() for d in data if (t := d.inputs.get("target_tokens")) is not None]
    flat = np.concatenate(ids)
    return bool(flat.size == 0 or (flat.min() >= 0 and flat.max() < vocab))


def _all_finite(data: list[DecodedDatum]) -> bool:
    """Whether no float loss input of the batch holds NaN or Inf."""
    floats = [a.ravel() for d in data for a in d.inputs.values() if a.dtype.kind == "f"]
    return not floats or bool(np.isfinite(np.concatenate(floats)).all())
