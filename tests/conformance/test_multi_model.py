"""Several base models in one embedded server (`--base-model` repeated, `--served-model-name`): each tenant trains
on its own choice, each model's log-probs equal an independent transformers + PEFT computation on that model, the
capabilities of both protocols and /v1/models list both by their served names (never a folder path), and a request
for a model not served is a 404 that names the served ones. A model that fails to load stops the start with a
message naming it, or, with --skip-failed-models, is left out and reported by /readyz."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import tinker
from tinker import types

from tests.support.process import free_port, quiet_env
from tests.support.peft_check import assert_logprobs_match_peft
from tests.support.server import ServerProcess
from tests.support.tiny_model import build_tiny_model

NAMES = ("tiny-a", "tiny-b")


@pytest.fixture(scope="module")
def second_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A different tiny model: other weights, other head layout, a smaller vocabulary."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny-b") / "model", seed=7, vocab_size=320,
                            num_attention_heads=2, num_key_value_heads=1)


@pytest.fixture(scope="module")
def two_models(tiny_model_dir: Path, second_model_dir: Path,
               tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    srv = ServerProcess(tmp_path_factory.mktemp("two-models"), str(tiny_model_dir),
                        args=("--served-model-name", NAMES[0], "--base-model", str(second_model_dir),
                              "--served-model-name", NAMES[1]))
    srv.api_key_a = srv.create_key("tenant-a")  # type: ignore[attr-defined]
    srv.api_key_b = srv.create_key("tenant-b")  # type: ignore[attr-defined]
    srv.folders = {NAMES[0]: tiny_model_dir, NAMES[1]: second_model_dir}  # type: ignore[attr-defined]
    srv.start()
    yield srv
    srv.stop()


def _batch(vocab: int, seed: int) -> list[types.Datum]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(3):
        tokens = rng.integers(5, vocab - 1, size=11).tolist()
        out.append(types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                               loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * 10}))
    return out


def test_capabilities_list_both_by_served_name(two_models: ServerProcess) -> None:
    key = two_models.api_key_a  # type: ignore[attr-defined]
    with tinker.ServiceClient(base_url=two_models.base_url, api_key=key) as sc:
        caps = sc.get_server_capabilities()
    assert sorted(m.model_name for m in caps.supported_models) == list(NAMES)
    headers = {"Authorization": f"Bearer {key}"}
    cards = httpx.get(f"{two_models.base_url}/v1/models", headers=headers).json()["data"]
    assert sorted(c["id"] for c in cards) == list(NAMES)
    native = httpx.get(f"{two_models.base_url}/api/v1/twinkle/get_server_capabilities", headers=headers)
    assert native.status_code == 200, native.text
    assert sorted(m["model_name"] for m in native.json()["supported_models"]) == list(NAMES)
    ready = httpx.get(f"{two_models.base_url}/readyz").json()
    models = next(c for c in ready["checks"] if c["name"] == "models")
    assert models["ok"] and models["detail"] == f"served: {NAMES[0]}, {NAMES[1]}"


def test_each_tenant_trains_its_own_model_and_logprobs_match_transformers(two_models: ServerProcess) -> None:
    pytest.importorskip("peft")

    folders: dict[str, Path] = two_models.folders  # type: ignore[attr-defined]
    keys = (two_models.api_key_a, two_models.api_key_b)  # type: ignore[attr-defined]
    for name, key, seed in zip(NAMES, keys, (1, 2)):
        vocab = int(json.loads((folders[name] / "config.json").read_text())["vocab_size"])
        data = _batch(vocab, seed)
        with tinker.ServiceClient(base_url=two_models.base_url, api_key=key) as sc:
            tc = sc.create_lora_training_client(base_model=name, rank=4, seed=seed).result()
            losses = []
            for _ in range(4):
                losses.append(tc.forward_backward(data, "cross_entropy").result().metrics["loss:sum"])
                tc.optim_step(types.AdamParams(learning_rate=2e-2)).result()
            assert losses[-1] < losses[0], (name, losses)
            fwd = tc.forward(data, "cross_entropy").result()
            path = tc.save_weights_for_sampler(f"check-{name}").result().path
        run_id, kind, ckpt = path.removeprefix("tinker://").split("/")
        (folder,) = two_models.data_dir.glob(f"checkpoints/*/{run_id}/{kind}/{ckpt}")
        assert_logprobs_match_peft(folders[name], folder, data, fwd.loss_fn_outputs)


def test_unserved_model_is_a_404_naming_the_served_ones(two_models: ServerProcess) -> None:
    key = two_models.api_key_a  # type: ignore[attr-defined]
    with tinker.ServiceClient(base_url=two_models.base_url, api_key=key) as sc:
        with pytest.raises(tinker.NotFoundError) as err:
            sc.create_lora_training_client(base_model="org/not-served", rank=4).result()
    assert all(n in str(err.value) for n in NAMES), err.value
    # the folder a model was loaded from is not a name clients can use
    folder = str(two_models.folders[NAMES[1]])  # type: ignore[attr-defined]
    r = httpx.post(f"{two_models.base_url}/v1/chat/completions", headers={"Authorization": f"Bearer {key}"},
                   json={"model": folder, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert r.status_code == 404 and NAMES[0] in r.json()["detail"], r.text


def _serve(data_dir: Path, *args: str) -> subprocess.Popen[str]:
    cmd = [sys.executable, "-m", "deploy.cli", "serve", "--host", "127.0.0.1", "--port", str(free_port()),
           "--data-dir", str(data_dir), *args]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=quiet_env(None))


def test_a_model_that_fails_to_load_stops_the_start(tiny_model_dir: Path, tmp_path: Path) -> None:
    missing = tmp_path / "no-such-model"
    proc = _serve(tmp_path / "data", "--base-model", str(tiny_model_dir), "--base-model", str(missing))
    _, err = proc.communicate(timeout=180)
    assert proc.returncode == 2, err
    assert f"error: base model '{missing}'" in err and "could not be loaded" in err, err


def test_a_model_over_the_memory_budget_is_refused_saying_what_it_needs(tiny_model_dir: Path, tmp_path: Path) -> None:
    proc = _serve(tmp_path / "data", "--base-model", str(tiny_model_dir), "--memory-budget-bytes", "100000")
    _, err = proc.communicate(timeout=180)
    assert proc.returncode == 2, err
    assert "needs 0." in err and "of the memory budget" in err and "M parameters in float32" in err, err


def test_skip_failed_models_starts_without_it_and_readyz_says_why(tiny_model_dir: Path, tmp_path: Path) -> None:
    missing = tmp_path / "no-such-model"
    srv = ServerProcess(tmp_path / "data", str(tiny_model_dir),
                        args=("--base-model", str(missing), "--skip-failed-models"))
    srv.start()
    try:
        ready = httpx.get(f"{srv.base_url}/readyz")
        models = next(c for c in ready.json()["checks"] if c["name"] == "models")
        assert models["ok"] and ready.status_code == 200, ready.text
        assert models["detail"].startswith(f"served: {tiny_model_dir}; failed to load: {missing} ("), models
    finally:
        srv.stop()
