"""Settings onto the compute side's one spec (workers/runtime.WorkerSpec), for every wiring.

`specs_from_settings` (one spec per `--base-model`) serves embedded mode, `twinkle-server worker` and a gateway that runs a worker; `spec_from_ray`
serves the Ray application (deploy/ray_app.py), where the YAML config names the models and their sampler, and
everything else comes from the same settings (with the config's `limits` applied first, deploy/ray_app.apply_limits).
tests/unit/test_worker_spec.py checks that every field of the spec is carried.
"""

from __future__ import annotations

from deploy.ray_config import ModelSpec, RayAppConfig
from server.config import Settings
from workers.runtime import StorageSpec, WorkerSpec

MIN_QUOTA_REFRESH_SECONDS = 1.0  # quota_cache_seconds may be 0 (no cache): a worker still re-reads at most 1/s


def storage_from_settings(settings: Settings) -> StorageSpec:
    return StorageSpec(data_dir=settings.data_dir, location=settings.storage_location,
                       cache_dir=settings.storage_cache_dir, model_cache=settings.model_cache_dir)


def specs_from_settings(settings: Settings) -> list[WorkerSpec]:
    """One spec per served base model (`--base-model`, repeatable), each named by its served name."""
    return [spec_from_settings(settings, index) for index in range(len(settings.base_model))]


def spec_from_settings(settings: Settings, index: int = 0) -> WorkerSpec:
    """The spec of the settings' `index`-th base model (the first by default)."""
    name, source = settings.served_models[index]
    return WorkerSpec(
        base_model=name,
        source=None if source == name else source,
        storage=storage_from_settings(settings),
        dtype=settings.dtype,
        device=settings.device,
        adapter_device_budget_bytes=settings.adapter_device_budget_bytes,
        adapter_host_budget_bytes=settings.adapter_host_budget_bytes,
        default_resident_adapters=settings.quota_max_resident_adapters,
        quota_refresh_seconds=max(settings.quota_cache_seconds, MIN_QUOTA_REFRESH_SECONDS),
        train_token_budget=settings.train_token_budget,
        train_threads=settings.train_threads,
        seq_gap_timeout=settings.seq_gap_timeout_seconds,
        snapshot_every_steps=settings.snapshot_every_steps,
        sampler=settings.sampler,
        sampler_max_batch_rows=settings.sampler_max_batch_rows,
        sampler_max_loaded_adapters=settings.sampler_max_loaded_adapters,
        max_lora_rank=settings.max_lora_rank,
        hub_push_concurrency=settings.hub_push_concurrency,
        memory_budget_bytes=settings.memory_budget_bytes,
    )


def spec_from_ray(config: RayAppConfig, model: ModelSpec, settings: Settings) -> WorkerSpec:
    """One served model of the Ray application: the model, its dtype/device and sampler from the YAML config;
    paging, token budget, timeouts, snapshots, rank and storage from the settings (limits already applied)."""
    base = spec_from_settings(settings).model_dump()
    base.update(
        base_model=model.name, source=model.source, dtype=model.dtype, device=model.device,
        sampler=model.sampler.backend, sampler_max_batch_rows=model.sampler.max_batch_rows,
        sampler_max_loaded_adapters=model.sampler.max_loaded_adapters,
        hub_push_concurrency=config.pusher.concurrency,
    )
    return WorkerSpec.model_validate(base)
