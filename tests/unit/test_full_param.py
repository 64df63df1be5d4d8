"""Full-parameter runs on the engine (workers/engine/full_param.py), on the tiny model: a run trains its own copy
(loss falls) while LoRA adapters train beside it in the same step, the shared base stays bit-identical, a full
checkpoint (safetensors shards + optimizer state) reloads to the same log-probs and is a Hugging Face folder that
transformers loads as it is, and a copy that does not fit the memory budget is refused up front."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest
import torch

from api_schemas.jobs import CreateModel, ForwardBackwardResult, JobResult, LoadWeights, ReleaseModel, SaveWeights
from tests.unit.engine_jobs import create, fb, job, optim, random_rows
from workers.checkpoints.store import CheckpointStore
from workers.engine.base_model import BaseModel
from workers.engine.trainer import Trainer
from workers.memory import MemoryLedger


def _hash(base: BaseModel) -> str:
    h = hashlib.sha256()
    for name, p in sorted(base.model.state_dict().items()):
        h.update(name.encode())
        h.update(p.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def _run(trainer: Trainer, *jobs) -> list[JobResult]:  # type: ignore[no-untyped-def]
    results: list[JobResult] = []
    trainer.execute_step(list(jobs), results.append)
    assert all(r.ok for r in results), [r.error for r in results]
    return results


def _logprobs(result: JobResult) -> np.ndarray:
    assert isinstance(result.output, ForwardBackwardResult)
    return np.concatenate([np.asarray(o["logprobs"]) for o in result.output.datum_outputs()])


@pytest.fixture()
def trainer(tiny_model_dir: Path, tmp_path: Path) -> Trainer:
    return Trainer(BaseModel("tiny", tiny_model_dir), CheckpointStore(tmp_path / "ckpt"))


def test_full_run_trains_its_copy_beside_lora_and_the_base_stays_identical(trainer: Trainer) -> None:
    before = _hash(trainer.base)
    rows = random_rows(np.random.default_rng(0), 3, 8, 12)
    _run(trainer, job("full", 0, CreateModel(lora=None)), create("lora", seed=1))
    losses = []
    for step in range(4):
        results = _run(trainer, fb("full", 2 * step + 1, rows), fb("lora", 2 * step + 1, rows))
        losses.append(float(results[0].output.metrics["loss:sum"]))  # type: ignore[union-attr]
        _run(trainer, optim("full", 2 * step + 2), optim("lora", 2 * step + 2))
    assert losses[-1] < 0.9 * losses[0], losses
    assert _hash(trainer.base) == before  # the shared base model was never written
    # a fresh LoRA adapter on the untouched base still sees the original model
    fresh = _run(trainer, create("probe"), fb("probe", 1, rows, forward_only=True))[1]
    ref = Trainer(BaseModel("tiny", trainer.base.folder), trainer.store)
    expected = _run(ref, create("probe"), fb("probe", 1, rows, forward_only=True))[1]
    np.testing.assert_array_equal(_logprobs(fresh), _logprobs(expected))


def test_full_checkpoint_reloads_to_the_same_logprobs_and_is_a_transformers_folder(trainer: Trainer) -> None:
    from transformers import AutoModelForCausalLM

    rows = random_rows(np.random.default_rng(1), 2, 6, 10)
    _run(trainer, job("full", 0, CreateModel(lora=None)))
    for step in range(2):
        _run(trainer, fb("full", 2 * step + 1, rows))
        _run(trainer, optim("full", 2 * step + 2))
    trained = _logprobs(_run(trainer, fb("full", 5, rows, forward_only=True))[0])
    _run(trainer, job("full", 6, SaveWeights(storage_key="t/full/weights/a", with_optimizer=True)))
    folder = trainer.store.existing("t/full/weights/a")
    assert folder is not None and sorted(p.name for p in folder.glob("model-*.safetensors")) == [
        "model-00001-of-00001.safetensors"]
    assert (folder / "optimizer.safetensors").exists() and (folder / "tokenizer.json").exists()

    _run(trainer, job("again", 0, LoadWeights(storage_key="t/full/weights/a", with_optimizer=True, create=True)))
    assert "again" in trainer.full
    reloaded = _logprobs(_run(trainer, fb("again", 1, rows, forward_only=True))[0])
    np.testing.assert_allclose(reloaded, trained, atol=1e-6, rtol=0)
    # its optimizer state came back too: one more step from both gives the same weights
    for model in ("full", "again"):
        _run(trainer, fb(model, 7 if model == "full" else 2, rows))
        _run(trainer, optim(model, 8 if model == "full" else 3))
    for a, b in zip(trainer.full.get("full").params, trainer.full.get("again").params):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)

    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    with torch.no_grad():
        for i, tokens in enumerate(rows):
            logp = torch.log_softmax(hf(input_ids=torch.tensor([tokens[:-1]])).logits[0], dim=-1)
            got = logp.gather(-1, torch.tensor(tokens[1:])[:, None])[:, 0].numpy()
            start = sum(len(r) - 1 for r in rows[:i])
            np.testing.assert_allclose(got, trained[start:start + len(tokens) - 1], atol=1e-5, rtol=0)


def test_release_frees_the_copy_and_a_copy_over_the_budget_is_refused(tiny_model_dir: Path, tmp_path: Path) -> None:
    ledger = MemoryLedger(budget_bytes=10**9)
    trainer = Trainer(BaseModel("tiny", tiny_model_dir), CheckpointStore(tmp_path / "ckpt"), ledger=ledger)
    _run(trainer, job("full", 0, CreateModel(lora=None)))
    assert list(ledger.reservations()) == ["full:full"] and ledger.reserved_bytes > 0
    _run(trainer, job("full", 1, ReleaseModel(reason="session_ended")))
    assert "full" not in trainer.full and ledger.reserved_bytes == 0

    small = Trainer(BaseModel("tiny", tiny_model_dir), CheckpointStore(tmp_path / "ckpt"),
                    ledger=MemoryLedger(budget_bytes=1000))
    result = small.execute(job("big", 0, CreateModel(lora=None)))
    assert not result.ok and result.error is not None and result.error.category.value == "user"
    assert "a full-parameter copy of 'tiny' (weights, gradients and optimizer state) needs" in result.error.message
    assert "of the memory budget" in result.error.message and "big" not in small.full
