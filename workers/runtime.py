"""The compute side of one base model, built from one spec: the ONE wiring embedded mode, `twinkle-server worker`
and the Ray Serve deployments all use.

`WorkerSpec` holds every setting the compute side reads (which model, where it lives, paging budgets, the merged
step's token budget, sampler options, snapshots, hub uploads); deploy/specs.py fills it from the settings or from
the Ray application config, and nothing else declares those settings again. `Runtime.build` loads what the
requested lanes need: the train lane gets the base model, a Trainer with the spec's PagingConfig and a Dispatcher
with its token budget (and crash recovery when the queue keeps durable state); the sample lane gets the sampler
backend and a SamplerWorker (the torch sampler shares the trainer's weights when both lanes run here).

A tenant's adapters-in-memory limit is its quota, which lives in the gateway's SQL: the wiring passes
`resident_limit` (tenant -> int | None). Embedded mode passes the gateway's TenantLimits; a separate worker or a
Ray replica passes a `jobqueue.resident_limits.ResidentLimitFeed`, which reads what the gateways publish into
Redis, so workers/ never reads SQL or imports server/.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, Field

from api_schemas.jobs import queue_name
from api_schemas.models import ServedModel
from workers.checkpoints.hub import HubPusherPool
from workers.checkpoints.store import CheckpointStore
from workers.memory import MemoryLedger, MemoryRefused, parameter_count, weights_bytes

if TYPE_CHECKING:  # the engine and samplers import torch: loaded only when a lane is built
    from jobqueue.base import WorkerQueue
    from workers.dispatcher import Dispatcher
    from workers.engine.base_model import BaseModel as Base
    from workers.engine.paging import PagingConfig
    from workers.engine.trainer import Trainer
    from workers.sampling.base import SamplerBackend
    from workers.sampling.worker import SamplerWorker

log = logging.getLogger(__name__)

LANES = ("train", "sample")
ResidentLimit = Callable[[str], int | None]
Loop = tuple[Callable[[], Awaitable[None]], Callable[[], None]]


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", protected_namespaces=())


class StorageSpec(_Frozen):
    """Where a worker keeps files: its data dir (converted models, adapter spills, the server secret) and the
    checkpoint storage it shares with the gateway (a folder or an fsspec URL, with a local cache)."""

    data_dir: Path
    location: str
    cache_dir: Path
    model_cache: Path | None = None  # converted models, shared by data dirs; None: <data dir>/models

    @property
    def models_dir(self) -> Path:
        return self.model_cache or self.data_dir / "models"

    @property
    def spill_dir(self) -> Path:
        return self.data_dir / "adapter-spill"


class WorkerSpec(_Frozen):
    """Everything the compute side of one base model is built from (deploy/specs.py maps settings onto it)."""

    base_model: str = Field(min_length=1)  # what clients pass as base_model
    source: str | None = None  # local folder, hub id or modelscope://...; default: base_model
    storage: StorageSpec
    dtype: Literal["float32", "bfloat16", "float16", "float64"] = "float32"
    device: str = "cpu"
    # paging (workers/engine/paging.py); None: 1/8 of the device's memory, 1/4 of the RAM (workers/memory.py)
    adapter_device_budget_bytes: int | None = Field(None, ge=0)
    adapter_host_budget_bytes: int | None = Field(None, ge=0)
    default_resident_adapters: int | None = Field(None, gt=0)  # a tenant's limit until its quota is known
    quota_refresh_seconds: float = Field(5.0, gt=0)  # how often a worker re-reads the published quotas
    # the train lane (workers/dispatcher.py, workers/recovery.py)
    train_token_budget: int | None = Field(None, gt=0)  # None: the engine's default (4096 CPU, 32768 GPU)
    train_threads: int = Field(0, ge=0)  # intra-op threads of the trainer's passes; 0: measured per pass size
    seq_gap_timeout: float = Field(60.0, gt=0)
    snapshot_every_steps: int = Field(10, gt=0)
    # the sample lane (workers/sampling/)
    sampler: Literal["torch", "vllm"] = "torch"
    sampler_max_batch_rows: int = Field(64, gt=0)
    sampler_max_loaded_adapters: int = Field(32, gt=0)
    max_lora_rank: int = Field(128, gt=0)  # the largest rank the gateway accepts (vLLM sizes its slots for it)
    # hub uploads (workers/checkpoints/hub.py)
    hub_push_concurrency: int = Field(2, gt=0)
    # what the process's base models and full-parameter copies may take (workers/memory.py); None: the free memory
    memory_budget_bytes: int | None = Field(None, gt=0)

    @property
    def model_source(self) -> str:
        return self.source or self.base_model


def checkpoint_store(storage: StorageSpec) -> CheckpointStore:
    return CheckpointStore(storage.location, storage.cache_dir)


def hub_pusher(storage: StorageSpec, concurrency: int) -> HubPusherPool:
    """Hub uploads on their own threads, reading checkpoints from the shared storage."""
    return HubPusherPool(checkpoint_store(storage), concurrency)


def model_folder(spec: WorkerSpec) -> Path:
    """The local HF folder of the base model (converted once per machine into the model cache, or downloaded;
    blocking)."""
    from workers.engine.model_assets import resolve_base_model

    spec.storage.data_dir.mkdir(parents=True, exist_ok=True)
    return resolve_base_model(spec.model_source, spec.storage.data_dir, spec.storage.models_dir)


def served_model(name: str, folder: Path) -> ServedModel:
    """What the gateways list and validate against, read from the folder (no weights loaded)."""
    from workers.engine.model_assets import tokenizer_id_for

    cfg = json.loads((folder / "config.json").read_text())
    return ServedModel(name=name, vocab_size=int(cfg["vocab_size"]),
                       max_context=int(cfg.get("max_position_embeddings", 2048)),
                       tokenizer_id=tokenizer_id_for(folder), arch=(cfg.get("architectures") or [None])[0])


def _accelerator_threads(device: str) -> int:
    """On an accelerator the host threads barely matter to a pass: keep torch's count, measure nothing."""
    import torch

    return 0 if device == "cpu" else torch.get_num_threads()


def paging_config(spec: WorkerSpec, resident_limit: ResidentLimit | None = None) -> PagingConfig:
    from workers.engine.paging import PagingConfig

    from workers.memory import default_adapter_budgets

    default = spec.default_resident_adapters
    device_default, host_default = default_adapter_budgets(spec.device)
    device_budget, host_budget = spec.adapter_device_budget_bytes, spec.adapter_host_budget_bytes
    return PagingConfig(
        device_budget_bytes=device_default if device_budget is None else device_budget,
        host_budget_bytes=host_default if host_budget is None else host_budget,
        spill_dir=spec.storage.spill_dir,
        tenant_resident_limit=resident_limit if resident_limit is not None else (lambda _tenant: default),
    )


class ModelLoadError(RuntimeError):
    """A base model could not be loaded at start (the message names it and says why)."""


@dataclass
class Runtime:
    """The built compute side of one base model. `loops()` are the coroutines a wiring runs (with their stops)."""

    spec: WorkerSpec
    served: ServedModel
    store: CheckpointStore
    folder: Path
    ledger: MemoryLedger = field(default_factory=MemoryLedger)  # this process's reservations (shared by runtimes)
    base: Base | None = None  # loaded when a lane needs the weights in this process
    trainer: Trainer | None = None
    dispatcher: Dispatcher | None = None
    sampler: SamplerBackend | None = None
    sampling: SamplerWorker | None = None
    _loops: list[Loop] = field(default_factory=list)

    @classmethod
    def build(cls, spec: WorkerSpec, queue: WorkerQueue, *, lanes: tuple[str, ...] = LANES,
              resident_limit: ResidentLimit | None = None, durable: bool = False,
              ledger: MemoryLedger | None = None) -> Runtime:
        """Load and wire the lanes asked for (blocking: loads weights). `resident_limit`: a tenant's
        adapters-in-memory quota (default: the spec's default for every tenant). `durable`: the queue keeps models'
        durable state (Redis), so the train lane snapshots and rebuilds adapters (workers/recovery.py); the
        in-process queue keeps nothing, so snapshots there would be wasted. `ledger`: the process's memory
        reservations (several runtimes in one process share one); a model that does not fit raises MemoryRefused
        before its weights are read."""
        if set(lanes) - set(LANES):
            raise ValueError(f"unknown lanes {sorted(set(lanes) - set(LANES))}; known: {list(LANES)}")
        store = checkpoint_store(spec.storage)
        folder = model_folder(spec)
        ledger = ledger or MemoryLedger(spec.memory_budget_bytes)
        rt = cls(spec=spec, served=served_model(spec.base_model, folder), store=store, folder=folder, ledger=ledger)
        if "train" in lanes or ("sample" in lanes and spec.sampler == "torch"):
            from workers.engine.base_model import BaseModel as Base

            ledger.reserve(f"base:{spec.base_model}", f"base model {spec.base_model!r} "
                           f"({parameter_count(folder) / 1e6:.1f} M parameters in {spec.dtype})",
                           weights_bytes(folder, spec.dtype), spec.device)
            log.info("loading base model %s from %s", spec.base_model, folder)
            rt.base = Base(spec.base_model, folder, dtype=spec.dtype, device=spec.device)
        if "train" in lanes:
            rt._build_train(queue, resident_limit, durable)
        if "sample" in lanes:
            rt._build_sample(queue)
        return rt

    def _build_train(self, queue: WorkerQueue, resident_limit: ResidentLimit | None, durable: bool) -> None:
        from workers.dispatcher import Dispatcher
        from workers.engine.threads import ThreadChooser
        from workers.engine.trainer import Trainer
        from workers.recovery import Recovery

        spec = self.spec
        assert self.base is not None
        trainer = Trainer(self.base, self.store, paging_config(spec, resident_limit), ledger=self.ledger,
                          threads=ThreadChooser(fixed=spec.train_threads or _accelerator_threads(spec.device)))
        recovery = Recovery(trainer, self.store, snapshot_every=spec.snapshot_every_steps) if durable else None
        dispatcher = Dispatcher(  # merged multi-tenant steps (the Trainer is a StepEngine)
            queue, queue_name(spec.base_model, "train"), trainer.execute, gap_timeout=spec.seq_gap_timeout,
            recovery=recovery, token_budget=spec.train_token_budget,
        )
        self.trainer, self.dispatcher = trainer, dispatcher
        self._loops.append((dispatcher.run, dispatcher.stop))
        from workers.metrics import occupancy

        occupancy.watch(trainer)  # twinkle_adapters{base_model, tier}, read at each scrape

    def _build_sample(self, queue: WorkerQueue) -> None:
        from workers.sampling.base import SamplerConfig
        from workers.sampling.factory import build_sampler
        from workers.sampling.full_checkpoints import FullCheckpointSampling
        from workers.sampling.worker import SamplerWorker

        spec = self.spec
        self.sampler = build_sampler(
            spec.sampler, spec.base_model, self.folder, self.store, dtype=spec.dtype, device=spec.device,
            max_batch_rows=spec.sampler_max_batch_rows, max_loaded_adapters=spec.sampler_max_loaded_adapters,
            max_lora_rank=spec.max_lora_rank,
            shared_base=self.base,  # one copy of the weights (workers/sampling/torch_sampler.py says why it is safe)
        )
        config = SamplerConfig(model_name=spec.base_model, model_folder=self.folder, dtype=spec.dtype,
                               device=spec.device, max_batch_rows=spec.sampler_max_batch_rows)
        # full-parameter checkpoints are sampled from their own weights; everything else by the backend
        serving = FullCheckpointSampling(self.sampler, config, self.store, self.ledger)
        self.sampling = SamplerWorker(queue, queue_name(spec.base_model, "sample"), serving)
        self._loops.append((self.sampling.run, self.sampling.stop))

    @classmethod
    def build_all(cls, specs: list[WorkerSpec], queue: WorkerQueue, *, lanes: tuple[str, ...] = LANES,
                  resident_limit: ResidentLimit | None = None, durable: bool = False,
                  skip_failed: bool = False) -> tuple[list[Runtime], dict[str, str]]:
        """The runtimes of several base models in one process, sharing one memory ledger, and {name: why} of
        those that failed to load. A failure stops the start (ModelLoadError naming the model) unless
        `skip_failed`; with it, the failed models are left out (at least one must load)."""
        ledger = MemoryLedger(specs[0].memory_budget_bytes if specs else None)
        built: list[Runtime] = []
        failed: dict[str, str] = {}
        for spec in specs:
            try:
                built.append(cls.build(spec, queue, lanes=lanes, resident_limit=resident_limit, durable=durable,
                                       ledger=ledger))
            except Exception as e:  # noqa: BLE001 - reported with the model's name (or skipped, if asked)
                reason = str(e) if isinstance(e, MemoryRefused) else f"{type(e).__name__}: {e}"
                if not skip_failed:
                    raise ModelLoadError(f"base model {spec.base_model!r} (from {spec.model_source}) could not be "
                                         f"loaded: {reason}") from e
                log.error("base model %r (from %s) is left out: %s", spec.base_model, spec.model_source, reason)
                failed[spec.base_model] = reason[:1000]
        if not built:
            raise ModelLoadError(f"no base model could be loaded: {failed}")
        return built, failed

    def loops(self) -> list[Loop]:
        """(run, stop) of each lane's consumer loop: the dispatcher, then the sampler worker."""
        return list(self._loops)

    def hub_pusher(self) -> HubPusherPool:
        return hub_pusher(self.spec.storage, self.spec.hub_push_concurrency)

    def status(self) -> dict[str, object]:
        """What the compute side applies (for heartbeats and operators): budgets, and the adapters per tier."""
        out: dict[str, object] = {"base_model": self.spec.base_model}
        if self.dispatcher is not None:
            out["token_budget"] = self.dispatcher.scheduler.token_budget
        if self.trainer is not None:
            cfg = self.trainer.pool.pager.config
            out["paging"] = {"device_budget_bytes": cfg.device_budget_bytes,
                             "host_budget_bytes": cfg.host_budget_bytes, "tiers": self.tiers()}
        return out

    def tiers(self) -> dict[str, int]:
        """The trainer's adapters per tier (device, host, disk); empty without a trainer."""
        return self.trainer.pool.tiers() if self.trainer is not None else {}
