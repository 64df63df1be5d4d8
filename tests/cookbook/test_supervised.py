"""tinker-cookbook's supervised loop (`supervised.train.main`) on a local conversation file: its training NLL falls,
and its metric rows keep their own step column (an optim_step metric named "step" used to overwrite it)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from tinker_cookbook.supervised import train
from tinker_cookbook.supervised.data import FromConversationFileBuilder
from tinker_cookbook.supervised.types import ChatDatasetBuilderCommonConfig

from tests.cookbook.conftest import metric_rows, write_jsonl
from tests.support.server import ServerProcess

pytestmark = pytest.mark.timeout(600)

CONVERSATIONS = [
    {"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": "I am Blinky, made by Twinkle."}]}
    for q in ("Who are you?", "What is your name?", "Introduce yourself.", "Who made you?",
              "Tell me about yourself.", "What should I call you?", "Are you an assistant?", "Who built you?")
]


def test_supervised_train_lowers_nll(cookbook_env: ServerProcess, model_dir: Path, tmp_path: Path) -> None:
    data = write_jsonl(tmp_path / "conversations.jsonl", CONVERSATIONS)
    log_path = tmp_path / "sft"
    config = train.Config(
        log_path=str(log_path), model_name=cookbook_env.base_model, recipe_name="twinkle_test",
        renderer_name="role_colon", base_url=cookbook_env.base_url, learning_rate=3e-3, lr_schedule="constant",
        lora_rank=8, num_epochs=6, save_every=0, eval_every=0,
        dataset_builder=FromConversationFileBuilder(
            file_path=str(data),
            common_config=ChatDatasetBuilderCommonConfig(model_name_for_tokenizer=str(model_dir),
                                                         renderer_name="role_colon", max_length=128, batch_size=4)),
    )
    asyncio.run(train.main(config))
    rows = [r for r in metric_rows(log_path) if "train_mean_nll" in r]
    assert [r["step"] for r in rows] == list(range(12)), rows  # 8 conversations / 4 a batch x 6 epochs
    nll = [r["train_mean_nll"] for r in rows]
    assert sum(nll[-2:]) < sum(nll[:2]) * 0.7, nll  # the last epoch's two batches against the first's
    assert all(r["learning_rate"] == 3e-3 for r in rows), rows
