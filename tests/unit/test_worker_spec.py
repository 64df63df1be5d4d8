"""The compute side's one spec and builder (workers/runtime.py): the settings and the Ray application config carry
every field of WorkerSpec (deploy/specs.py), the config's limits name real settings, and the runtime built from a
spec applies it (paging budgets and spill dir, per-tenant resident limits, token budget, gap timeout, recovery
only on a durable queue, the torch sampler sharing the trainer's weights)."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from deploy.ray_config import Limits, parse_config
from deploy.specs import spec_from_ray, spec_from_settings, specs_from_settings, storage_from_settings
from server.config import Settings
from workers.runtime import Runtime, StorageSpec, WorkerSpec

# A value unlike the default for every setting a spec is built from.
SETTINGS = {
    "base_model": "org/some-model", "dtype": "bfloat16", "device": "cuda:1", "adapter_device_budget_bytes": 12345,
    "adapter_host_budget_bytes": 678, "quota_max_resident_adapters": 3, "quota_cache_seconds": 7.5,
    "train_token_budget": 777, "seq_gap_timeout_seconds": 12.0, "snapshot_every_steps": 4, "sampler": "vllm",
    "sampler_max_batch_rows": 9, "sampler_max_loaded_adapters": 5, "max_lora_rank": 16, "hub_push_concurrency": 6,
    "storage_url": "memory://ckpt", "memory_budget_bytes": 10**9, "train_threads": 3,
    "model_cache_dir": "/models/cache",
}


def _settings(tmp_path: Path, **extra: object) -> Settings:
    return Settings(data_dir=tmp_path, **{**SETTINGS, **extra})  # type: ignore[arg-type]


def _carried(spec: WorkerSpec, default: WorkerSpec) -> list[str]:
    """Fields of `spec` still at the value a spec of default settings has (none should be)."""
    return [f for f in WorkerSpec.model_fields if getattr(spec, f) == getattr(default, f)]


def test_spec_from_settings_carries_every_field(tmp_path: Path) -> None:
    spec = spec_from_settings(_settings(tmp_path))
    default = spec_from_settings(Settings(data_dir=tmp_path / "other"))
    assert _carried(spec, default) == ["source"]  # the settings name the model by its source: no separate field
    assert spec.model_dump() == {
        "base_model": "org/some-model", "source": None,
        "storage": {"data_dir": tmp_path.resolve(), "location": "memory://ckpt",
                    "cache_dir": tmp_path.resolve() / "storage-cache", "model_cache": Path("/models/cache")},
        "dtype": "bfloat16", "device": "cuda:1", "adapter_device_budget_bytes": 12345,
        "adapter_host_budget_bytes": 678, "default_resident_adapters": 3, "quota_refresh_seconds": 7.5,
        "train_token_budget": 777, "seq_gap_timeout": 12.0, "snapshot_every_steps": 4, "sampler": "vllm",
        "sampler_max_batch_rows": 9, "sampler_max_loaded_adapters": 5, "max_lora_rank": 16,
        "hub_push_concurrency": 6, "memory_budget_bytes": 10**9, "train_threads": 3,
    }
    assert spec.model_source == "org/some-model" and spec.storage.spill_dir == tmp_path.resolve() / "adapter-spill"
    # a quota cache of 0 (no cache) still has the worker re-read at most once a second
    assert spec_from_settings(_settings(tmp_path, quota_cache_seconds=0)).quota_refresh_seconds == 1.0


def test_spec_from_ray_carries_every_field(tmp_path: Path) -> None:
    from deploy.ray_app import apply_limits

    config = parse_config({
        "models": [{"name": "served-name", "path": "/models/m", "dtype": "float16", "device": "cuda",
                    "trainer": {"num_gpus": 1},
                    "sampler": {"backend": "vllm", "max_batch_rows": 11, "max_loaded_adapters": 7}}],
        "pusher": {"concurrency": 5},
        "limits": {"train_token_budget": 999, "adapter_device_budget_bytes": 1, "adapter_host_budget_bytes": 0,
                   "quota_max_resident_adapters": 2, "snapshot_every_steps": 3, "seq_gap_timeout_seconds": 9.0,
                   "max_lora_rank": 32, "memory_budget_bytes": 2**30, "train_threads": 1},
    })
    settings = apply_limits(Settings(data_dir=tmp_path, quota_cache_seconds=2.0, storage_url="memory://x"), config)
    spec = spec_from_ray(config, config.models[0], settings)
    default_config = parse_config({"models": [{"name": "m"}]})
    default = spec_from_ray(default_config, default_config.models[0], Settings(data_dir=tmp_path / "other"))
    assert _carried(spec, default) == []
    assert spec.model_dump() == {
        "base_model": "served-name", "source": "/models/m", "storage": storage_from_settings(settings).model_dump(),
        "dtype": "float16", "device": "cuda", "adapter_device_budget_bytes": 1, "adapter_host_budget_bytes": 0,
        "default_resident_adapters": 2, "quota_refresh_seconds": 2.0, "train_token_budget": 999,
        "seq_gap_timeout": 9.0, "snapshot_every_steps": 3, "sampler": "vllm", "sampler_max_batch_rows": 11,
        "sampler_max_loaded_adapters": 7, "max_lora_rank": 32, "hub_push_concurrency": 5,
        "memory_budget_bytes": 2**30, "train_threads": 1,
    }
    # settings the YAML leaves alone come from the TWINKLE_* environment, as in every other wiring
    env_only = apply_limits(_settings(tmp_path), default_config)
    env_spec = spec_from_ray(default_config, default_config.models[0], env_only)
    assert (env_spec.adapter_device_budget_bytes, env_spec.train_token_budget) == (12345, 777)


def test_ray_config_limits_are_settings() -> None:
    """apply_limits copies each limit onto the setting of the same name: a limit without one would be dropped."""
    assert set(Limits.model_fields) <= set(Settings.model_fields)


def test_spec_is_frozen_and_strict(tmp_path: Path) -> None:
    storage = StorageSpec(data_dir=tmp_path, location=str(tmp_path / "c"), cache_dir=tmp_path / "cache")
    spec = WorkerSpec(base_model="m", storage=storage)
    with pytest.raises(ValidationError, match="frozen"):
        spec.device = "cuda"  # type: ignore[misc]
    with pytest.raises(ValidationError, match="token_budget"):
        WorkerSpec(base_model="m", storage=storage, token_budget=5)  # type: ignore[call-arg]


def _spec(tmp_path: Path, model: Path, **kw: object) -> WorkerSpec:
    storage = StorageSpec(data_dir=tmp_path, location=str(tmp_path / "ckpt"), cache_dir=tmp_path / "cache")
    return WorkerSpec(base_model="tiny", source=str(model), storage=storage, **kw)  # type: ignore[arg-type]


def test_runtime_applies_the_spec(tiny_model_dir: Path, tmp_path: Path) -> None:
    from jobqueue.local_queue import LocalQueue
    from tests.unit.engine_jobs import create, fb, optim

    limits = {"t-a": 1}
    spec = _spec(tmp_path, tiny_model_dir, adapter_device_budget_bytes=0, adapter_host_budget_bytes=0,
                 default_resident_adapters=4, train_token_budget=321, seq_gap_timeout=7.0)
    rt = Runtime.build(spec, LocalQueue(), resident_limit=limits.get)
    assert rt.served.name == "tiny" and rt.served.vocab_size > 0
    assert rt.trainer is not None and rt.dispatcher is not None and rt.sampler is not None
    cfg = rt.trainer.pool.pager.config
    assert (cfg.device_budget_bytes, cfg.host_budget_bytes, cfg.spill_dir) == (0, 0, tmp_path / "adapter-spill")
    assert cfg.tenant_resident_limit is not None and cfg.tenant_resident_limit("t-a") == 1
    assert rt.dispatcher.scheduler.token_budget == 321 and rt.dispatcher.scheduler.gap_timeout == 7.0
    assert rt.dispatcher.recovery is None  # the in-process queue keeps nothing to recover from
    assert rt.trainer.threads.fixed == 0  # the default: measured per pass size
    assert rt.sampler.base is rt.base  # type: ignore[attr-defined]  # the torch sampler shares the weights
    assert [run.__self__ for run, _ in rt.loops()] == [rt.dispatcher, rt.sampling]  # type: ignore[attr-defined]

    trainer = rt.trainer
    for j in (create("a"), fb("a", 1, [[5, 6, 7, 8]]), optim("a", 2), create("b")):
        assert trainer.execute(j).ok
    status = rt.status()
    assert status["token_budget"] == 321
    assert status["paging"] == {"device_budget_bytes": 0, "host_budget_bytes": 0,  # type: ignore[comparison-overlap]
                                "tiers": {"device": 1, "host": 0, "disk": 1}}  # a spilled to disk, b in use last
    assert list((tmp_path / "adapter-spill").rglob("*.safetensors"))


def test_runtime_defaults_and_lanes(tiny_model_dir: Path, tmp_path: Path) -> None:
    from jobqueue.local_queue import LocalQueue

    spec = _spec(tmp_path, tiny_model_dir, default_resident_adapters=2)
    rt = Runtime.build(spec, LocalQueue(), lanes=("train",), durable=True)
    assert rt.sampler is None and rt.sampling is None and len(rt.loops()) == 1
    assert rt.dispatcher is not None and rt.dispatcher.recovery is not None
    assert rt.dispatcher.recovery.snapshot_every == spec.snapshot_every_steps
    assert rt.dispatcher.scheduler.token_budget == 4096  # None: the engine's default on a CPU
    cfg = rt.trainer.pool.pager.config  # type: ignore[union-attr]
    assert cfg.tenant_resident_limit is not None and cfg.tenant_resident_limit("anyone") == 2
    with pytest.raises(ValueError, match="unknown lanes"):
        Runtime.build(spec, LocalQueue(), lanes=("training",))


def test_several_base_models_each_get_a_spec_named_by_its_served_name(tmp_path: Path) -> None:
    settings = Settings(data_dir=tmp_path, base_model=["org/a", "/models/b", "org/c"],
                        served_model_name=["a", "b"])
    specs = specs_from_settings(settings)
    assert [(s.base_model, s.source) for s in specs] == [("a", "org/a"), ("b", "/models/b"), ("org/c", None)]
    assert all(s.storage == specs[0].storage for s in specs)  # one data dir and checkpoint storage for all
    # the environment takes a comma-separated list
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TWINKLE_BASE_MODEL", "org/a, org/b")
        mp.setenv("TWINKLE_SERVED_MODEL_NAME", "a")
        assert Settings(data_dir=tmp_path).served_models == [("a", "org/a"), ("org/b", "org/b")]
    with pytest.raises(ValidationError, match="repeated"):
        Settings(data_dir=tmp_path, base_model=["org/a", "org/b"], served_model_name=["x", "x"])
    with pytest.raises(ValidationError, match="2 served model names for 1 base models"):
        Settings(data_dir=tmp_path, base_model=["org/a"], served_model_name=["x", "y"])
