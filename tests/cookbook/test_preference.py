"""tinker-cookbook's DPO loop (`preference.train_dpo.main`) on the examples' preference pairs (a local JSONL of
comparisons): the DPO loss falls from log 2 (policy == reference at the start) and the chosen answers win."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from tinker_cookbook.preference import train_dpo
from tinker_cookbook.preference.dpo_datasets import DPODatasetBuilderFromComparisons
from tinker_cookbook.preference.preference_datasets import ComparisonBuilderFromJsonl
from tinker_cookbook.supervised.types import ChatDatasetBuilderCommonConfig

from tests.cookbook.conftest import ROOT, metric_rows, write_jsonl
from tests.support.server import ServerProcess

pytestmark = pytest.mark.timeout(600)


def _comparisons(path: Path) -> Path:
    rows = []
    with open(ROOT / "examples" / "data" / "dpo_pairs.jsonl", encoding="utf-8") as f:
        for line in f:
            pair = json.loads(line)
            rows.append({"comparison": {"prompt_conversation": [{"role": "user", "content": pair["prompt"]}],
                                        "completion_A": [{"role": "assistant", "content": pair["chosen"]}],
                                        "completion_B": [{"role": "assistant", "content": pair["rejected"]}]},
                         "label": "A"})
    return write_jsonl(path, rows[:8])


def test_train_dpo_lowers_the_loss(cookbook_env: ServerProcess, model_dir: Path, tmp_path: Path) -> None:
    log_path = tmp_path / "dpo"
    config = train_dpo.Config(
        log_path=str(log_path), model_name=cookbook_env.base_model, recipe_name="twinkle_test",
        renderer_name="role_colon", base_url=cookbook_env.base_url, learning_rate=3e-3, lr_schedule="constant",
        num_epochs=4, dpo_beta=0.5, lora_rank=8, save_every=0, eval_every=0, infrequent_eval_every=0,
        dataset_builder=DPODatasetBuilderFromComparisons(
            comparison_builder=ComparisonBuilderFromJsonl(train_path=str(_comparisons(tmp_path / "pairs.jsonl"))),
            common_config=ChatDatasetBuilderCommonConfig(model_name_for_tokenizer=str(model_dir),
                                                         renderer_name="role_colon", max_length=128, batch_size=4)),
    )
    train_dpo.main(config)
    rows = [r for r in metric_rows(log_path) if "dpo_loss" in r]
    assert len(rows) == 8, rows  # 8 pairs / 4 a batch x 4 epochs
    losses = [r["dpo_loss"] for r in rows]
    assert losses[0] == pytest.approx(math.log(2), abs=1e-3), losses
    # the last epoch's two batches against the first's
    assert sum(losses[-2:]) < sum(losses[:2]) * 0.5 and all(r["margin"] > 0 for r in rows[-2:]), rows
