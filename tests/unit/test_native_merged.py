"""One engine for both client families: a native tenant's batches (built by the gateway's native service from
InputFeature rows: CrossEntropyLoss and GRPOLoss) and a Tinker tenant's batch (from the SDK's protobuf request) are
picked by the scheduler for ONE merged step, and each tenant's gradients in it equal its solo run (fp32 1e-5)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from tinker.proto import tinker_public_pb2 as pb

from api_schemas.jobs import ForwardBackward, Job
from api_schemas.native.features import Feature
from api_schemas.tinker.proto import batch_datums, decode_forward_backward, parse_forward_backward
from server.services.native.losses import cross_entropy, grpo_datums
from tests.unit.engine_jobs import job
from tests.unit.test_merged import _grads, _rel, _step, _trainer
from workers.scheduler import Scheduler


def _feature(rng: np.random.Generator, n: int, start: int) -> Feature:
    ids = rng.integers(3, 300, size=n)
    labels = np.full(n, -100)
    labels[start:-1] = ids[start + 1:]
    return Feature(ids.astype(np.int64), labels.astype(np.int64))


def _native_jobs(rng: np.random.Generator) -> list[Job]:
    ce = cross_entropy([_feature(rng, 9, 2), _feature(rng, 14, 5)], summed=False)
    feats = [_feature(rng, 12, 6) for _ in range(3)]
    old = [(-rng.random(int(f.mask.sum())) * 3).tolist() for f in feats]
    grpo = grpo_datums(feats, [1.0, -0.5, -0.5], old, epsilon=0.2, epsilon_high=0.28)
    return [job(m, 3, ForwardBackward.build(b.datums, forward_only=False, loss_fn=b.loss_fn, loss_config=b.config))
            for m, b in (("a", ce), ("c", grpo))]


def _tinker_job(rng: np.random.Generator) -> Job:
    msg = pb.ForwardBackwardRequest(model_id="b", seq_id=3, loss_fn="cross_entropy")
    for n in (7, 20):
        tokens = rng.integers(3, 300, size=n + 1)
        d = pb.Datum(model_input=[pb.Chunk(encoded_text=pb.EncodedTextChunk(tokens=tokens[:-1].astype("<i4").tobytes()))])
        d.loss_fn_inputs["target_tokens"].CopyFrom(pb.Tensor(dense=tokens[1:].astype("<i8").tobytes(), dtype=pb.DTYPE_INT64, shape=[n]))
        d.loss_fn_inputs["weights"].CopyFrom(pb.Tensor(dense=np.ones(n, "<f4").tobytes(), dtype=pb.DTYPE_FLOAT32, shape=[n]))
        msg.data.append(d)
    req = decode_forward_backward(parse_forward_backward(msg.SerializeToString()))
    return job("b", 3, ForwardBackward.build(batch_datums(req), forward_only=False, loss_fn="cross_entropy"))


def test_native_and_tinker_batches_share_a_merged_step_with_solo_gradients(tiny_model_dir: Path, tmp_path: Path) -> None:
    t = _trainer(tiny_model_dir, tmp_path, "float32")  # models a..d, each one step in (seq 0..2)
    rng = np.random.default_rng(5)
    jobs = _native_jobs(rng) + [_tinker_job(rng)]
    scheduler = Scheduler(gap_timeout=60.0)
    for m in ("a", "b", "c"):
        scheduler.resume(m, 3)
    for j in jobs:
        assert scheduler.add(j, now=0.0) is None
    step = scheduler.next_step(now=0.0)
    assert step is not None and step.merged and {j.model_id for j in step.jobs} == {"a", "b", "c"}  # one pass
    solo = {}
    for j in jobs:
        r = t.execute(j)
        assert r.ok, r.error
        solo[j.model_id] = _grads(t, j.model_id)
    for r in _step(t, list(step.jobs)):
        assert r.ok, r.error
    for j in jobs:
        assert _rel(_grads(t, j.model_id), solo[j.model_id]) < 1e-5, j.model_id
