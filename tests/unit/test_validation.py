"""check_forward_backward (server/services/validation.py): the batch's value checks run at once, and a failing
batch still names its first problem in datum order, as a datum-by-datum check would."""

from __future__ import annotations

import numpy as np
import pytest

from api_schemas.models import ServedModel
from api_schemas.tinker.proto import DecodedDatum, DecodedForwardBackward
from server.errors import BadRequest
from server.services.validation import check_forward_backward

SERVED = ServedModel(name="m", vocab_size=100, max_context=64, tokenizer_id="m")


def _datum(tokens: list[int], targets: list[int] | np.ndarray, weights: list[float]) -> DecodedDatum:
    return DecodedDatum(tokens=np.asarray(tokens, dtype=np.int64),
                        inputs={"target_tokens": np.asarray(targets, dtype=np.int64),
                                "weights": np.asarray(weights, dtype=np.float32)})


def _check(*data: DecodedDatum) -> None:
    req = DecodedForwardBackward(model_id="m", seq_id=1, loss_fn="cross_entropy", loss_fn_config={},
                                 forward_only=False, data=list(data))
    check_forward_backward(req, SERVED, max_datums=16)


def test_a_good_batch_passes() -> None:
    _check(_datum([1, 2, 3], [2, 3, 4], [1, 1, 1]), _datum([5, 6], [6, 7], [0.5, 1]))


@pytest.mark.parametrize(("data", "message"), [
    # a value problem in datum 0 comes before a shape problem in datum 1
    ((_datum([1, 2], [2, 100], [1, 1]), _datum([1, 2], [2], [1, 1])), "datum 0: target_tokens holds token ids"),
    ((_datum([1, 2], [2, 3], [1, float("nan")]), _datum([1, 200], [2, 3], [1, 1])),
     "datum 0: loss_fn_inputs['weights'] contains NaN or Inf"),
    # and a shape problem in datum 0 before a value problem in datum 1
    ((_datum([1, 2], [2], [1, 1]), _datum([-1, 2], [2, 3], [1, 1])), "datum 0: target_tokens has shape [1]"),
    ((_datum([1, 2], [2, 3], [1, 1]), _datum([1, 2], [2, 3], [1, float("inf")]), _datum([1, 200], [2, 3], [1, 1])),
     "datum 1: loss_fn_inputs['weights'] contains NaN or Inf"),
    ((_datum([1, 2], [2, 3], [1, 1]), _datum([1, 200], [2, 3], [1, 1])), "datum 1: model_input holds token ids"),
])
def test_a_bad_batch_names_its_first_problem(data: tuple[DecodedDatum, ...], message: str) -> None:
    with pytest.raises(BadRequest) as e:
        _check(*data)
    assert e.value.message.startswith(message), e.value.message
