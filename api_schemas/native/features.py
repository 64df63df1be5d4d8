"""The native protocol's training rows: twinkle `InputFeature` dicts, read into token and label arrays.

A row is a JSON object with `input_ids` (the tokens) and `labels` of the same length, already shifted: `labels[i]`
is the token predicted at position i, -100 where no loss is taken (twinkle's template rolls them left by one). A
packed row (twinkle's PackingDataset, padding-free: `position_ids` start again at 0 where the next sequence
begins) is read as its sequences, one Feature each, as upstream's padding-free attention keeps them apart. Other
keys (`attention_mask`, `length`, a dataset's raw columns such as `messages`) are ignored; images, audio and video
inputs are refused (the served models are text-only). `input_ids` may also come as one row of a 2-D list, as a
collator leaves it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["IGNORE_INDEX", "Feature", "FeatureError", "is_feature_list", "read_features"]

IGNORE_INDEX = -100
_MULTIMODAL = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw", "input_features",
               "audio_values")


class FeatureError(ValueError):
    """A row that cannot be trained on; the message names the row and the field."""


@dataclass(frozen=True)
class Feature:
    input_ids: np.ndarray  # int64 (n,)
    labels: np.ndarray  # int64 (n,), IGNORE_INDEX where no loss is taken

    @property
    def mask(self) -> np.ndarray:
        return self.labels != IGNORE_INDEX

    @property
    def targets(self) -> np.ndarray:
        """The labels with -100 replaced by 0 (a valid id, weighted 0)."""
        return np.where(self.mask, self.labels, 0)


def is_feature_list(inputs: object) -> bool:
    """Upstream's dispatch: a list whose first element is a dict with `input_ids` holds InputFeatures (else
    Trajectories)."""
    rows = [inputs] if isinstance(inputs, Mapping) else inputs
    return isinstance(rows, Sequence) and bool(rows) and isinstance(rows[0], Mapping) and "input_ids" in rows[0]


def read_features(inputs: object, *, vocab_size: int, max_len: int, max_rows: int,
                  labels_required: bool = True) -> list[Feature]:
    rows = [inputs] if isinstance(inputs, Mapping) else inputs
    if not isinstance(rows, Sequence) or isinstance(rows, (str, bytes)) or not rows:
        raise FeatureError("inputs must be a non-empty list of InputFeature objects (input_ids, labels)")
    if len(rows) > max_rows:
        raise FeatureError(f"inputs hold {len(rows)} rows; at most {max_rows} per request")
    out = [f for i, row in enumerate(rows) for f in _unpack(i, row, _feature(i, row, vocab_size, labels_required))]
    if len(out) > max_rows:
        raise FeatureError(f"inputs hold {len(out)} sequences once packed rows are split; at most {max_rows}")
    long = next((i for i, f in enumerate(out) if f.input_ids.size > max_len), None)
    if long is not None:
        raise FeatureError(f"sequence {long} of the inputs has {out[long].input_ids.size} tokens; at most {max_len} "
                           "are accepted")
    return out


def _unpack(i: int, row: object, f: Feature) -> list[Feature]:
    """A packed row's sequences: where its 1-D `position_ids` (one per token) start again at 0."""
    pos = row.get("position_ids") if isinstance(row, Mapping) else None
    if pos is None:
        return [f]
    p = _ints(i, "position_ids", pos)
    if p.shape != f.input_ids.shape:
        return [f]  # not one position per token (e.g. a collator's layout): nothing to split by
    starts = [0, *np.flatnonzero(p[1:] == 0) + 1, p.size]
    return [Feature(f.input_ids[a:b], f.labels[a:b]) for a, b in zip(starts, starts[1:])]


def _feature(i: int, row: object, vocab_size: int, labels_required: bool) -> Feature:
    if not isinstance(row, Mapping):
        raise FeatureError(f"inputs[{i}] is not an InputFeature object")
    present = [k for k in _MULTIMODAL if row.get(k) is not None]
    if present:
        raise FeatureError(f"inputs[{i}] has {present}: the served models take text only")
    ids = _ints(i, "input_ids", row.get("input_ids"))
    if ids.size == 0:
        raise FeatureError(f"inputs[{i}].input_ids has no tokens")
    if ids.min() < 0 or ids.max() >= vocab_size:
        raise FeatureError(f"inputs[{i}].input_ids holds ids outside the vocabulary [0, {vocab_size})")
    raw = row.get("labels")
    if raw is None:
        if labels_required:
            raise FeatureError(f"inputs[{i}] has no labels (the template's encode sets them)")
        labels = np.full_like(ids, IGNORE_INDEX)
    else:
        labels = _ints(i, "labels", raw)
        if labels.shape != ids.shape:
            raise FeatureError(f"inputs[{i}].labels has {labels.size} entries for {ids.size} input_ids")
        bad = (labels != IGNORE_INDEX) & ((labels < 0) | (labels >= vocab_size))
        if bad.any():
            raise FeatureError(f"inputs[{i}].labels holds ids outside the vocabulary (and not -100)")
    return Feature(ids, labels)


def _ints(i: int, name: str, value: object) -> np.ndarray:
    if isinstance(value, Sequence) and len(value) == 1 and isinstance(value[0], Sequence):
        value = value[0]  # one row of a collated (1, n) batch
    if not isinstance(value, Sequence) or isinstance(value, (str, bytes)):
        raise FeatureError(f"inputs[{i}].{name} must be a list of integers")
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise FeatureError(f"inputs[{i}].{name} must hold integers only")
    try:
        return np.asarray(value, dtype=np.int64)
    except OverflowError:
        raise FeatureError(f"inputs[{i}].{name} holds an integer out of range") from None
