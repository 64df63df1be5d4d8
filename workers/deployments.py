"""Ray Serve deployments around the same runtime as the embedded and `twinkle-server worker` wirings
(workers/runtime.py: each replica builds its lanes from the model's WorkerSpec).

Per base model: one `TrainerDeployment` replica (the base model, its adapter pool with the spec's paging budgets
and the tenants' published resident-adapter quotas, the Dispatcher on the model's train lane with the spec's token
budget, with crash recovery: a replacement replica rebuilds adapters from snapshot + replay), a `SampleRouter`
(the sample lane's one consumer, which forwards each job to a sampler replica chosen by the sampling session, see
workers/session_router.py) and `SamplerDeployment` replicas (torch or vLLM backend, scaled independently). One
`PusherDeployment` uploads checkpoints to model hubs for every gateway (jobqueue/hub_push_queue.py).

Nothing here calls the gateway: jobs come from Redis and results go back to Redis, so the gateway stays a plain
FastAPI process. Every replica heartbeats into Redis (jobqueue/heartbeats.py) for `/readyz`, and fails Serve's
health check when its loop died (e.g. a lost lease), so Serve replaces it; the trainer's heartbeat also carries
what its runtime applies (token budget, paging budgets, adapters per tier). deploy/ray_app.py binds these classes
with the specs deploy/specs.py maps from the settings and the YAML config; workers/ never imports deploy/ or server/.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Awaitable, Callable

from pydantic import BaseModel, ConfigDict
from ray import serve
from ray.serve.handle import DeploymentHandle

from api_schemas.jobs import ErrorCategory, Job, JobError, JobResult, queue_name
from jobqueue import tracing
from jobqueue.base import LeaseLost
from jobqueue.heartbeats import Heartbeats
from jobqueue.metrics_feed import MetricsPublisher
from jobqueue.redis_queue import RedisQueue
from jobqueue.resident_limits import ResidentLimitFeed
from workers.runtime import Runtime, StorageSpec, WorkerSpec, hub_pusher

log = logging.getLogger("twinkle.deployments")


class WorkerOptions(BaseModel):
    """How every replica reaches Redis and reports its heartbeat (deploy/ray_app.py fills them from the settings).
    What a replica computes with is its WorkerSpec (workers/runtime.py), the same spec every wiring builds from."""

    model_config = ConfigDict(frozen=True)

    redis_url: str
    redis_prefix: str = "twinkle"
    result_ttl: float = 900.0
    job_ttl: float = 86400.0
    lease_ttl: float = 10.0
    reclaim_idle: float = 30.0
    heartbeat_seconds: float = 2.0
    metrics_seconds: float = 5.0  # how often the replica publishes its metrics (jobqueue/metrics_feed.py)
    otel_endpoint: str | None = None  # set: the replica traces its jobs (jobqueue/tracing.py) to this OTLP collector
    otel_service_name: str | None = None


class _Replica:
    """Redis queue, heartbeat and health of one replica; subclasses add their loops with `_spawn`."""

    async def _start(self, opts: WorkerOptions, info: dict[str, str]) -> None:
        import ray

        self.opts = opts
        tracing.setup_from(opts.otel_endpoint, opts.otel_service_name, f"ray:{info['kind']}")
        self.queue = RedisQueue(opts.redis_url, prefix=opts.redis_prefix, result_ttl=opts.result_ttl,
                                job_ttl=opts.job_ttl, lease_ttl=opts.lease_ttl, reclaim_idle=opts.reclaim_idle)
        ctx = serve.get_replica_context()
        self.deployment, self.replica = ctx.deployment, ctx.replica_tag
        self.node = ray.get_runtime_context().get_node_id()
        self.heartbeats = Heartbeats(self.queue.client, self.queue.keys)
        self.info = info
        self.tasks: list[asyncio.Task[None]] = []
        self._stops: list[Callable[[], None]] = []

    def _spawn(self, run: Callable[[], Awaitable[None]], stop: Callable[[], None] | None = None) -> None:
        self.tasks.append(asyncio.create_task(run(), name=f"{self.deployment}-{run.__name__}"))
        if stop is not None:
            self._stops.append(stop)

    def _begin_heartbeat(self) -> None:
        self._spawn(self._heartbeat)
        # the replica's registry reaches the gateways' /metrics through Redis, labelled worker=deployment#replica
        publisher = MetricsPublisher(self.queue.client, self.queue.keys, f"{self.deployment}#{self.replica}",
                                     self.opts.metrics_seconds)
        self._spawn(publisher.run, publisher.stop)

    async def _heartbeat(self) -> None:
        ttl = self.opts.heartbeat_seconds * 3
        while True:
            if any(t.done() for t in self.tasks if t is not asyncio.current_task()):
                return  # a loop died: stop claiming to be alive (check_health fails too)
            try:
                await self.heartbeats.beat(self.deployment, self.replica, os.getpid(), self.node, ttl,
                                           self.beat_info())
            except Exception:
                log.warning("heartbeat of %s failed", self.deployment, exc_info=True)
            await asyncio.sleep(self.opts.heartbeat_seconds)

    def beat_info(self) -> dict[str, object]:
        """What the heartbeat tells `/readyz` and operators about this replica."""
        return dict(self.info)

    async def check_health(self) -> None:
        """Serve calls this periodically; raising makes Serve replace the replica."""
        for t in self.tasks:
            if t.done():
                err = None if t.cancelled() else t.exception()
                raise RuntimeError(f"{t.get_name()} stopped: {err!r}")

    async def status(self) -> dict[str, object]:
        return {"deployment": self.deployment, "replica": self.replica, "pid": os.getpid(), "node": self.node,
                **self.info}

    async def __del__(self) -> None:  # Serve's graceful shutdown hook: give the leases back at once
        for stop in self._stops:
            stop()
        for t in self.tasks:
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        try:
            await self.heartbeats.leave(self.deployment, self.replica)
        finally:
            await self.queue.close()


def _build(spec: WorkerSpec, queue: RedisQueue, lanes: tuple[str, ...],
           resident_limit: ResidentLimitFeed | None = None) -> Runtime:
    """The replica's share of the runtime (blocking: loads weights), on Ray's CPU allotment."""
    if "train" in lanes or spec.sampler == "torch":  # torch computes here (vLLM runs its own processes)
        from workers.engine.threads import set_threads

        set_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1") or 1)))  # Ray sets it from num_cpus
    return Runtime.build(spec, queue, lanes=lanes, resident_limit=resident_limit, durable=True)


@serve.deployment(max_ongoing_requests=8)
class TrainerDeployment(_Replica):
    async def __init__(self, opts: WorkerOptions, spec: WorkerSpec) -> None:
        await self._start(opts, {"kind": "trainer", "base_model": spec.base_model})
        # the tenants' adapters-in-memory quotas, as the gateways publish them (jobqueue/resident_limits.py)
        feed = ResidentLimitFeed(self.queue.client, self.queue.keys, spec.default_resident_adapters,
                                 spec.quota_refresh_seconds)
        await feed.refresh()
        self.runtime = await asyncio.to_thread(_build, spec, self.queue, ("train",), feed)
        await self.queue.register_served(self.runtime.served)  # the gateways now list the model
        for run, stop in (*self.runtime.loops(), (feed.run, feed.stop)):
            self._spawn(run, stop)
        self._begin_heartbeat()
        log.info("trainer of %s ready (pid %d)", spec.base_model, os.getpid())

    def beat_info(self) -> dict[str, object]:
        try:
            return {**self.info, **self.runtime.status()}  # the budgets applied and the adapters per tier
        except RuntimeError:  # the pool changed while being counted: report it next beat
            return dict(self.info)


@serve.deployment(max_ongoing_requests=64)
class SamplerDeployment(_Replica):
    async def __init__(self, opts: WorkerOptions, spec: WorkerSpec) -> None:
        await self._start(opts, {"kind": "sampler", "base_model": spec.base_model})
        self.recent: dict[str, None] = {}  # sampling sessions served lately (insertion-ordered)
        # the torch sampler runs on a base model this replica loads once; vLLM loads the weights itself
        self.runtime = await asyncio.to_thread(_build, spec, self.queue, ("sample",))
        assert self.runtime.sampling is not None
        self.backend = self.runtime.sampling.backend  # the backend, with full-parameter checkpoints' samplers
        await self.backend.start()
        # The router consumes the queue; this worker object is used for its request handling only.
        self.worker = self.runtime.sampling
        self._begin_heartbeat()
        log.info("sampler of %s ready (pid %d)", spec.base_model, os.getpid())

    async def execute(self, job: Job) -> JobResult:
        self.recent.pop(job.model_id, None)  # most recent last: which sessions this replica serves
        self.recent[job.model_id] = None
        while len(self.recent) > 64:
            self.recent.pop(next(iter(self.recent)))
        return await self.worker.execute(job)

    def beat_info(self) -> dict[str, object]:
        return {**self.info, "sessions": list(self.recent)}

    async def __del__(self) -> None:
        await self.backend.close()
        await super().__del__()


@serve.deployment(max_ongoing_requests=8)
class SampleRouter(_Replica):
    """The sample lane's consumer: holds the lease of the model's sample stream, forwards, acknowledges."""

    async def __init__(self, opts: WorkerOptions, spec: WorkerSpec, sampler: DeploymentHandle,
                       attempts: int = 3) -> None:
        await self._start(opts, {"kind": "sample-router", "base_model": spec.base_model})
        self.sampler, self.attempts = sampler, attempts
        self.queue_name = queue_name(spec.base_model, "sample")
        self.spans = tracing.JobSpans(spec.base_model)  # the jobs' wait and run spans (tracing on only)
        self.inflight: set[asyncio.Task[None]] = set()
        self._spawn(self._consume)
        self._begin_heartbeat()

    async def _consume(self) -> None:
        while True:
            try:
                jobs = await self.queue.fetch(self.queue_name, 1.0)
            except LeaseLost:
                raise  # another router took over: this replica must be replaced
            except Exception:  # Redis away (a restart): keep the lease logic, try again shortly
                log.warning("fetching from %s failed; retrying", self.queue_name, exc_info=True)
                await asyncio.sleep(0.5)
                continue
            for job in jobs:
                if job.traceparent is not None:
                    self.spans.fetched(job)
                task = asyncio.create_task(self._forward(job))
                self.inflight.add(task)
                task.add_done_callback(self.inflight.discard)

    async def _forward(self, job: Job) -> None:
        result: JobResult | None = None
        if self.spans.open:
            self.spans.started((job,))
        for attempt in range(self.attempts):  # a sampler replica that died mid-request: another one retries
            try:
                handle = self.sampler.options(multiplexed_model_id=job.model_id)
                result = await handle.execute.remote(job)
                break
            except Exception as e:  # noqa: BLE001 - RayActorError and friends; the job itself is fine
                log.warning("sample job %s: sampler call failed (attempt %d): %r", job.job_id, attempt + 1, e)
                await asyncio.sleep(0.5 * (attempt + 1))
        if result is None:
            result = JobResult(job_id=job.job_id, error=JobError(
                category=ErrorCategory.SERVER, message="no sampler replica could serve the request"))
        await self.queue.complete(result)
        if self.spans.open:
            self.spans.finished(result)


@serve.deployment(max_ongoing_requests=8)
class PusherDeployment(_Replica):
    """Uploads checkpoints to the Hugging Face Hub / ModelScope for every gateway (requests come via Redis)."""

    async def __init__(self, opts: WorkerOptions, storage: StorageSpec, concurrency: int = 2) -> None:
        from jobqueue.hub_push_queue import HubPushConsumer
        from jobqueue.sealing import cluster_secret

        await self._start(opts, {"kind": "hub-pusher"})
        secret = cluster_secret(storage.data_dir)  # from this node's env or data dir, never through Ray
        if secret is None:
            log.warning("no server secret here (TWINKLE_SIGNING_SECRET): every hub push will fail")
        self.pool = hub_pusher(storage, concurrency)
        self.consumer = HubPushConsumer(self.queue.client, self.queue.keys, secret, self.pool,
                                        name=f"{self.replica}-{os.getpid()}", concurrency=concurrency)
        self._spawn(self.consumer.run, self.consumer.stop)
        self._begin_heartbeat()

    async def __del__(self) -> None:
        self.pool.close()
        await super().__del__()


@serve.deployment(num_replicas=1, ray_actor_options={"num_cpus": 0}, max_ongoing_requests=16)
class Supervisor:
    """The application's ingress: holds handles to every deployment (so Serve deploys them) and reports status."""

    def __init__(self, **deployments: DeploymentHandle) -> None:
        self.deployments = deployments

    async def status(self) -> dict[str, object]:
        return {name: await h.status.remote() for name, h in self.deployments.items()}
