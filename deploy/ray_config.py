"""The Ray Serve application config (`twinkle-server serve --backend ray --config deploy/ray-app.yaml`), validated.

One YAML file describes the cluster side: which base models are served, how many replicas of each deployment run
and on which resources (CPUs, GPUs, custom resources that pin a deployment to a node), the sampler backend, and the
limits that the gateway and the workers must agree on. Unknown keys are errors, so a typo fails at start with a
message naming the field (`load_config`), never a silent default. Connection settings (Redis, SQL, storage) stay in
the environment (`TWINKLE_*`), shared with the gateway.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

DEFAULT_CONFIG = Path(__file__).with_name("ray-app.yaml")  # shipped with the package


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, protected_namespaces=())


class Resources(_Strict):
    """Ray resources of each replica (`ray_actor_options`)."""

    num_cpus: float = Field(1.0, ge=0)
    num_gpus: float = Field(0.0, ge=0)
    memory_bytes: int | None = Field(None, gt=0)
    resources: dict[str, float] = Field(default_factory=dict)  # custom resources, e.g. {"trainer_node": 1}

    def actor_options(self) -> dict[str, Any]:
        opts: dict[str, Any] = {"num_cpus": self.num_cpus, "num_gpus": self.num_gpus}
        if self.memory_bytes is not None:
            opts["memory"] = self.memory_bytes
        if self.resources:
            opts["resources"] = dict(self.resources)
        return opts


class Health(_Strict):
    health_check_period_s: float = Field(5.0, gt=0)
    health_check_timeout_s: float = Field(30.0, gt=0)
    graceful_shutdown_timeout_s: float = Field(20.0, ge=0)


class TrainerSpec(Resources, Health):
    """The one trainer replica of a base model: the base model and its adapter pool."""


class Autoscaling(_Strict):
    min_replicas: int = Field(1, ge=0)
    max_replicas: int = Field(4, ge=1)
    target_ongoing_requests: float = Field(16.0, gt=0)

    @model_validator(mode="after")
    def _ordered(self) -> Autoscaling:
        if self.min_replicas > self.max_replicas:
            raise ValueError("min_replicas must not exceed max_replicas")
        return self


class SamplerSpec(Resources, Health):
    """Sampler replicas of a base model; a sampling session sticks to one replica (rendezvous hashing)."""

    backend: Literal["torch", "vllm"] = "torch"
    replicas: int = Field(1, ge=1)
    autoscaling: Autoscaling | None = None  # when set, replaces the fixed `replicas`
    max_ongoing_requests: int = Field(64, gt=0)  # requests one replica batches together
    max_batch_rows: int = Field(64, gt=0)
    max_loaded_adapters: int = Field(32, gt=0)


class RouterSpec(Resources):
    """The sample-lane consumer of a base model: reads the Redis stream, forwards to the sampler replicas."""

    num_cpus: float = Field(0.1, ge=0)


class ModelSpec(_Strict):
    name: str = Field(min_length=1)  # what clients pass as base_model
    path: str | None = None  # local HF folder, hub id or modelscope://; default: `name`
    dtype: Literal["float32", "bfloat16", "float16", "float64"] = "float32"
    device: str = "cpu"
    trainer: TrainerSpec = Field(default_factory=TrainerSpec)
    sampler: SamplerSpec = Field(default_factory=SamplerSpec)
    router: RouterSpec = Field(default_factory=RouterSpec)

    @model_validator(mode="after")
    def _gpu_device(self) -> ModelSpec:
        if self.device.startswith("cuda") and self.trainer.num_gpus <= 0:
            raise ValueError("device is cuda but trainer.num_gpus is 0: give the trainer a GPU")
        return self

    @property
    def source(self) -> str:
        return self.path or self.name


class PusherSpec(Resources):
    """The checkpoint-pusher deployment (uploads to the Hugging Face Hub / ModelScope)."""

    num_cpus: float = Field(0.1, ge=0)
    replicas: int = Field(1, ge=1)
    concurrency: int = Field(2, gt=0)  # uploads at once per replica


class Limits(_Strict):
    """Settings the gateway and the workers share; each overrides the same `TWINKLE_*` setting."""

    worker_lease_seconds: float | None = Field(None, gt=0)
    reclaim_idle_seconds: float | None = Field(None, gt=0)
    snapshot_every_steps: int | None = Field(None, gt=0)
    seq_gap_timeout_seconds: float | None = Field(None, gt=0)
    result_ttl_seconds: float | None = Field(None, ge=300)
    job_ttl_seconds: float | None = Field(None, gt=0)
    max_lora_rank: int | None = Field(None, gt=0)
    train_token_budget: int | None = Field(None, gt=0)  # padded tokens of one merged pass (the trainer replicas)
    train_threads: int | None = Field(None, ge=0)  # the trainer replicas' intra-op threads; 0: chosen per pass size
    adapter_device_budget_bytes: int | None = Field(None, ge=0)  # adapter paging (workers/engine/paging.py)
    adapter_host_budget_bytes: int | None = Field(None, ge=0)
    quota_max_resident_adapters: int | None = Field(None, gt=0)  # tenants without their own quota
    memory_budget_bytes: int | None = Field(None, gt=0)  # per replica: its base model (workers/memory.py)
    max_request_bytes: int | None = Field(None, gt=0)
    max_datums_per_request: int | None = Field(None, gt=0)
    sample_default_max_tokens: int | None = Field(None, gt=0)


class RayCluster(_Strict):
    address: str | None = None  # "auto", "HOST:PORT" or "ray://HOST:10001"; none: start a local cluster
    namespace: str = "twinkle"
    num_cpus: int | None = Field(None, gt=0)  # of a local cluster this process starts
    num_gpus: int | None = Field(None, ge=0)


class RayAppConfig(_Strict):
    app_name: str = Field("twinkle", pattern=r"^[A-Za-z0-9_-]+$")
    ray: RayCluster = Field(default_factory=RayCluster)
    models: list[ModelSpec] = Field(min_length=1)
    pusher: PusherSpec = Field(default_factory=PusherSpec)
    limits: Limits = Field(default_factory=Limits)

    @model_validator(mode="after")
    def _unique(self) -> RayAppConfig:
        names = [m.name for m in self.models]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"models: base model {dup[0]!r} is listed twice")
        slugs = [slug(n) for n in names]
        if len(set(slugs)) != len(slugs):
            raise ValueError("models: two base model names map to the same deployment name")
        return self

    def fingerprint(self) -> str:
        return hashlib.sha256(self.model_dump_json().encode()).hexdigest()[:16]


class ConfigError(ValueError):
    """The application config is invalid; the message names the file and each offending field."""


def slug(name: str) -> str:
    """A deployment-name-safe form of a base model name, unique per name (readable part + short hash)."""
    readable = "".join(c if c.isalnum() else "-" for c in name.rsplit("/", 1)[-1]).strip("-")[:40] or "model"
    return f"{readable}-{hashlib.sha256(name.encode()).hexdigest()[:6]}"


def parse_config(data: Any, source: str = "config") -> RayAppConfig:
    try:
        return RayAppConfig.model_validate(data if data is not None else {})
    except ValidationError as e:
        lines = []
        for err in e.errors():
            where = ".".join(str(p) for p in err["loc"]) or "(top level)"
            lines.append(f"  {where}: {err['msg']}")
        raise ConfigError(f"invalid Ray application config {source}:\n" + "\n".join(lines)) from None


def load_config(path: Path | str) -> RayAppConfig:
    import yaml

    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"Ray application config {p} does not exist")
    try:
        data = yaml.safe_load(p.read_text())
    except yaml.YAMLError as e:
        raise ConfigError(f"Ray application config {p} is not valid YAML: {e}") from None
    return parse_config(data, str(p))
