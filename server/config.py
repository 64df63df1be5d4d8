"""The one settings object of a process: env prefix TWINKLE_, command-line flags override env, validated at start."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

DEFAULT_BASE_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"


def user_model_cache() -> Path:
    """Where converted models live for every data dir of this user: $XDG_CACHE_HOME (or ~/.cache)/twinkle-server."""
    root = os.environ.get("XDG_CACHE_HOME") or "~/.cache"
    return Path(root).expanduser() / "twinkle-server" / "models"


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="TWINKLE_", extra="ignore")

    host: str = "127.0.0.1"  # the address the gateway listens on
    port: int = Field(8000, ge=0, le=65535)  # its port (0: any free one)
    data_dir: Path = Path("./twinkle-data")  # SQLite database, checkpoints, spills, the server secret
    # converted models (the default's GGUF conversion), shared by every data dir: converted once per machine
    model_cache_dir: Path = Field(default_factory=user_model_cache)
    # The served base models: each an HF/ModelScope id or a local HF folder (`--base-model`, repeatable; env:
    # comma-separated). `served_model_name` names them for clients, in the same order (default: the source itself),
    # so a model loaded from a folder is not known by its path. `skip_failed_models`: a model that fails to load is
    # left out and reported by /readyz, instead of failing the start.
    base_model: Annotated[list[str], NoDecode] = Field(default_factory=lambda: [DEFAULT_BASE_MODEL], min_length=1)
    served_model_name: Annotated[list[str], NoDecode] = Field(default_factory=list)  # see base_model
    skip_failed_models: bool = False  # see base_model
    database_url: str | None = None  # default: SQLite file in data_dir
    redis_url: str | None = None  # set -> Redis queue (cluster wiring); unset -> in-process queue
    backend: Literal["embedded", "ray"] = "embedded"  # ray: the compute side as Ray Serve deployments
    dtype: Literal["float32", "bfloat16", "float16", "float64"] = "float32"  # the base models' dtype
    device: str = "cpu"  # cpu, cuda, cuda:N
    sampler: Literal["torch", "vllm"] = "torch"  # sampler backend (workers/sampling/)
    sampler_max_batch_rows: int = Field(64, gt=0)  # sequences decoded together in one forward pass
    sampler_max_loaded_adapters: int = Field(32, gt=0)  # weight versions a sampler keeps loaded
    sample_default_max_tokens: int = Field(256, gt=0)  # when a request omits max_tokens

    long_poll_seconds: float = Field(25.0, gt=0, lt=40)  # the SDK times retrieve_future out at 45 s
    result_ttl_seconds: float = Field(900.0, ge=300)  # how long a finished future stays retrievable
    seq_gap_timeout_seconds: float = Field(60.0, gt=0)  # a missing seq_id is skipped after this long
    session_timeout_seconds: float = Field(900.0, gt=0)  # a session without heartbeat is released

    # Datums per forward_backward request the SDK may send (its default 1024); smaller values make it chunk.
    client_fwdbwd_max_chunk_len: int = Field(1024, gt=0)
    max_request_bytes: int = Field(64 * 1024 * 1024, gt=0)  # largest request body
    max_datums_per_request: int = Field(4096, gt=0)  # datums in one forward(_backward)
    max_lora_rank: int = Field(128, gt=0)  # largest LoRA rank accepted
    # what one tenant holds at once (server/services/tenant_caps.py): live sessions (not finished, heartbeat within
    # session_timeout_seconds), training runs in them (Tinker models and native adapters) and sampling sessions
    # made by create_sampling_session in them. One more is refused with a 429 naming the setting.
    max_sessions_per_tenant: int = Field(1000, gt=0)
    max_models_per_tenant: int = Field(1000, gt=0)  # see max_sessions_per_tenant
    max_sampling_sessions_per_tenant: int = Field(10_000, gt=0)  # see max_sessions_per_tenant
    # capacity_info's max_loras (native protocol) for a tenant without a live-model quota: the adapters one base
    # model is sized to carry (idle ones page to host memory and disk)
    native_capacity_adapters: int = Field(1000, gt=0)
    # server-held datasets of the native protocol (twinkle_client.dataset / dataloader; in the gateway's memory,
    # server/services/native/processor_store.py): objects, rows and JSON bytes one tenant may hold at a time
    native_processor_objects_per_tenant: int = Field(20, gt=0)
    native_processor_rows_per_tenant: int = Field(100_000, gt=0)  # see native_processor_objects_per_tenant
    native_processor_bytes_per_tenant: int = Field(32 * 1024 * 1024, gt=0)  # see native_processor_objects_per_tenant
    # API keys (server/auth/keys.py): a cached key is re-read from SQL after auth_cache_seconds, or sooner after a
    # key change: each gateway looks for one every auth_check_seconds (the key generation, in Redis or SQL) and
    # the key commands wait that long before they return, so the change applies everywhere once they have; a
    # key's first use in each audit_key_use_seconds window is written to the audit log (per gateway)
    auth_cache_seconds: float = Field(5.0, ge=0)
    auth_check_seconds: float = Field(1.0, ge=0, le=60)  # see auth_cache_seconds
    audit_key_use_seconds: float = Field(3600.0, gt=0)  # see auth_cache_seconds
    log_level: str = "INFO"  # below DEBUG, libraries' INFO logs are off (jobqueue/logs.py)
    log_format: Literal["text", "json"] = "text"  # json: one object per line, with request ids
    # One log line per HTTP request (uvicorn's access log). Off by default: the SDK's long-polls and heartbeats
    # make it a stream of lines, and its synchronous writes cost the gateway CPU on every request.
    access_log: bool = False
    # OpenTelemetry tracing (the `otel` extra; jobqueue/tracing.py, docs/OPERATOR.md "Tracing"): set, every process
    # (gateway, `twinkle-server worker`, Ray replicas) exports spans of each request, its jobs' wait in the queue and
    # their run in the worker, over OTLP/HTTP to this collector (its base URL, e.g. http://collector:4318;
    # /v1/traces is added unless the URL ends with it). Unset: no tracing, and no cost.
    otel_endpoint: str | None = None
    # the traces' service.name (unset: OTEL_SERVICE_NAME, else twinkle-server)
    otel_service_name: str | None = None
    # FastAPI's native OpenTelemetry instrumentation (tracing, metrics, logs through the global OTel providers; with
    # otel_endpoint set, its spans go to the same collector). Not needed for otel_endpoint's spans
    otel_telemetry: bool = False
    # Prometheus `/metrics` (server/api/metrics.py): open unless a token is set (then `Authorization: Bearer <it>`);
    # separate workers publish their registries into Redis this often (jobqueue/metrics_feed.py)
    metrics_token: SecretStr | None = None
    metrics_publish_seconds: float = Field(5.0, gt=0)  # see metrics_token

    # cluster wiring (redis_url set): see jobqueue/redis_queue.py and deploy/worker.py
    redis_prefix: str = "twinkle"  # every Redis key starts with it (jobqueue/keys.py)
    gateway_runs_worker: bool = False  # with Redis: also run the base model's trainer inside `serve`
    job_ttl_seconds: float = Field(86400.0, gt=0)  # how long a queued job (and its dedup key) is remembered
    worker_lease_seconds: float = Field(10.0, gt=0)  # a dead worker's jobs move on after at most this long
    reclaim_idle_seconds: float = Field(30.0, gt=0)  # another consumer's unacknowledged job is claimed after this
    snapshot_every_steps: int = Field(10, gt=0)  # optim_steps between durable adapter snapshots

    # checkpoint lifecycle (server/services/checkpoints.py, downloads.py, hub_push.py)
    storage_url: str | None = None  # fsspec URL (s3://bucket/prefix, ...); default: a folder in data_dir
    tenant_storage_quota_bytes: int | None = Field(None, gt=0)  # per tenant, over all its checkpoints
    signing_secret: SecretStr | None = None  # signs download URLs, encrypts hub tokens; default: a file in data_dir
    public_base_url: str | None = None  # base of signed download URLs; default: the URL the client called
    download_url_ttl_seconds: int = Field(3600, ge=60, le=7 * 24 * 3600)  # lifetime of a signed checkpoint URL
    max_custom_losses_per_session: int = Field(64, gt=0)  # create_custom_loss beyond it: 400
    maintenance_interval_seconds: float = Field(30.0, gt=0)  # TTL sweep, stale pending saves, auto-push
    hf_endpoint: str = "https://huggingface.co"  # Hugging Face hub (model download, hub push)
    modelscope_endpoint: str = "https://www.modelscope.cn"  # ModelScope hub
    hub_push_concurrency: int = Field(2, gt=0)  # hub uploads running at once

    # multi-tenant engine (workers/scheduler.py, workers/engine/paging.py) and quotas (server/services/quotas.py)
    train_token_budget: int | None = Field(None, gt=0)  # padded tokens in one merged pass; None: 4096 CPU, 32768 GPU
    train_threads: int = Field(0, ge=0)  # the trainer's intra-op threads; 0: measured per pass size (engine/threads.py)
    adapter_device_budget_bytes: int | None = Field(None, ge=0)  # attached adapters; None: 1/8 of the device memory
    adapter_host_budget_bytes: int | None = Field(None, ge=0)  # paged-out adapters in RAM, then disk; None: 1/4 of RAM
    quota_max_models: int | None = Field(None, ge=0)  # defaults for tenants without their own (tenants set-quota)
    quota_max_resident_adapters: int | None = Field(None, gt=0)  # see quota_max_models
    quota_tokens_per_minute: int | None = Field(None, gt=0)  # see quota_max_models
    quota_max_concurrent_requests: int | None = Field(None, gt=0)  # see quota_max_models
    # HTTP requests per minute per tenant (a token bucket, shared by a cluster's gateways through Redis; futures
    # polling and heartbeats are not counted) and the burst above it (default: a minute's worth); over: 429
    quota_requests_per_minute: int | None = Field(None, gt=0)
    quota_request_burst: int | None = Field(None, gt=0)  # see quota_requests_per_minute
    quota_cache_seconds: float = Field(5.0, ge=0)  # a changed quota applies within this many seconds
    # what one process's base models and full-parameter copies may take in memory (workers/memory.py): a model or
    # a copy beyond it is refused up front, saying what it needs. None: the memory free when it is loaded
    memory_budget_bytes: int | None = Field(None, gt=0)
    # full-parameter training (server/services/full_param.py): the served models that offer it ("*": all), how many
    # runs (each a private copy of the model) one model carries at once (others wait), and the lease's time limit
    full_param_models: Annotated[list[str], NoDecode] = Field(default_factory=list)
    full_param_runs_per_model: int = Field(1, gt=0)  # see full_param_models
    full_param_lease_seconds: float = Field(3600.0, gt=0)  # see full_param_models

    @field_validator("base_model", "served_model_name", "full_param_models", mode="before")
    @classmethod
    def _comma_list(cls, v: object) -> object:
        if isinstance(v, str):
            return [x.strip() for x in v.split(",") if x.strip()]
        return v

    @model_validator(mode="after")
    def _model_names(self) -> Settings:
        if len(self.served_model_name) > len(self.base_model):
            raise ValueError(f"{len(self.served_model_name)} served model names for {len(self.base_model)} base models")
        names = [name for name, _ in self.served_models]
        duplicated = sorted({n for n in names if names.count(n) > 1})
        if duplicated:
            raise ValueError(f"served model names must be unique; repeated: {duplicated}")
        return self

    @property
    def served_models(self) -> list[tuple[str, str]]:
        """(the name clients use, where the model comes from) of each served base model, in order."""
        names = self.served_model_name + self.base_model[len(self.served_model_name):]
        return list(zip(names, self.base_model))

    @field_validator("data_dir", "model_cache_dir")
    @classmethod
    def _absolute(cls, v: Path) -> Path:
        return v.expanduser().resolve()

    @property
    def sqlalchemy_url(self) -> str:
        return self.database_url or f"sqlite+aiosqlite:///{self.data_dir / 'twinkle.db'}"

    @property
    def checkpoint_dir(self) -> Path:
        return self.data_dir / "checkpoints"

    @property
    def storage_location(self) -> str:
        """Where checkpoints live, for jobqueue.storage.CheckpointStorage (gateway and workers alike)."""
        return self.storage_url or str(self.checkpoint_dir)

    @property
    def storage_cache_dir(self) -> Path:
        return self.data_dir / "storage-cache"
