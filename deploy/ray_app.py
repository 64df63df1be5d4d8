"""The Ray wiring of `twinkle-server serve --backend ray`: build the Serve application from the YAML config, deploy
it on a Ray cluster (started here, or joined with --ray-address), then run the gateway as a plain FastAPI process
on Redis and SQL.

`app_builder` is the same application for `serve run deploy.ray_app:app_builder config=...` and for a KubeRay
RayService (deploy/kuberay/): connection settings come from the `TWINKLE_*` environment of the Ray nodes.
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Any

from fastapi import FastAPI

from deploy.ray_config import DEFAULT_CONFIG, RayAppConfig, load_config, slug
from deploy.specs import spec_from_ray, storage_from_settings
from server.config import Settings

log = logging.getLogger(__name__)


def apply_limits(settings: Settings, config: RayAppConfig) -> Settings:
    """The config's limits override the environment's, in the gateway and in the deployments alike."""
    update = config.limits.model_dump(exclude_none=True)
    return settings.model_copy(update=update) if update else settings


def worker_options(settings: Settings):  # type: ignore[no-untyped-def]
    from workers.deployments import WorkerOptions

    if not settings.redis_url:
        raise ValueError("the Ray backend needs TWINKLE_REDIS_URL (or --redis-url): the deployments talk to Redis")
    return WorkerOptions(
        redis_url=settings.redis_url, redis_prefix=settings.redis_prefix, result_ttl=settings.result_ttl_seconds,
        job_ttl=settings.job_ttl_seconds, lease_ttl=settings.worker_lease_seconds,
        reclaim_idle=settings.reclaim_idle_seconds, metrics_seconds=settings.metrics_publish_seconds,
        otel_endpoint=settings.otel_endpoint, otel_service_name=settings.otel_service_name,
    )


def deployment_names(config: RayAppConfig) -> dict[str, dict[str, Any]]:
    """Every deployment the application runs, with what `/readyz` reports about it."""
    out: dict[str, dict[str, Any]] = {}
    for m in config.models:
        s = slug(m.name)
        sampler_n = m.sampler.autoscaling.min_replicas if m.sampler.autoscaling else m.sampler.replicas
        out[f"trainer-{s}"] = {"kind": "trainer", "base_model": m.name, "replicas": 1}
        out[f"sampler-{s}"] = {"kind": "sampler", "base_model": m.name, "replicas": sampler_n}
        out[f"sample-router-{s}"] = {"kind": "sample-router", "base_model": m.name, "replicas": 1}
    out["hub-pusher"] = {"kind": "hub-pusher", "replicas": config.pusher.replicas}
    return out


def build_application(config: RayAppConfig, settings: Settings):  # type: ignore[no-untyped-def]
    from ray.serve.config import AutoscalingConfig, RequestRouterConfig

    from workers import deployments as d
    from workers.session_router import SessionAffinityRouter

    opts = worker_options(settings)
    handles: dict[str, Any] = {}
    for m in config.models:
        s = slug(m.name)
        model = spec_from_ray(config, m, settings)  # the replicas of this model build their runtime from it
        t, sp = m.trainer, m.sampler
        handles[f"trainer_{len(handles)}"] = d.TrainerDeployment.options(
            name=f"trainer-{s}", num_replicas=1, ray_actor_options=t.actor_options(),
            health_check_period_s=t.health_check_period_s, health_check_timeout_s=t.health_check_timeout_s,
            graceful_shutdown_timeout_s=t.graceful_shutdown_timeout_s,
        ).bind(opts, model)
        scale: dict[str, Any] = {"num_replicas": sp.replicas}
        if sp.autoscaling is not None:
            scale = {"autoscaling_config": AutoscalingConfig(**sp.autoscaling.model_dump())}
        sampler = d.SamplerDeployment.options(
            name=f"sampler-{s}", ray_actor_options=sp.actor_options(), max_ongoing_requests=sp.max_ongoing_requests,
            health_check_period_s=sp.health_check_period_s, health_check_timeout_s=sp.health_check_timeout_s,
            graceful_shutdown_timeout_s=sp.graceful_shutdown_timeout_s,
            request_router_config=RequestRouterConfig(request_router_class=SessionAffinityRouter), **scale,
        ).bind(opts, model)
        handles[f"router_{len(handles)}"] = d.SampleRouter.options(
            name=f"sample-router-{s}", num_replicas=1, ray_actor_options=m.router.actor_options(),
        ).bind(opts, model, sampler)
    p = config.pusher
    handles["pusher"] = d.PusherDeployment.options(
        name="hub-pusher", num_replicas=p.replicas, ray_actor_options=p.actor_options(),
    ).bind(opts, storage_from_settings(settings), p.concurrency)
    return d.Supervisor.options(name="supervisor").bind(**handles)


def app_builder(args: dict[str, str]):  # type: ignore[no-untyped-def]
    """Serve application builder (`import_path: deploy.ray_app:app_builder`, `args: {config: PATH}`), used by
    `serve run`/`serve deploy` and KubeRay. Settings come from this node's `TWINKLE_*` environment; the deployments
    it builds are declared in Redis for the gateways' `/readyz`."""
    config = load_config(args.get("config") or os.environ.get("TWINKLE_RAY_CONFIG") or DEFAULT_CONFIG)
    settings = apply_limits(Settings(), config)
    app = build_application(config, settings)
    asyncio.run(_declare(settings, config, app_fingerprint(config, settings)))
    return app


def app_fingerprint(config: RayAppConfig, settings: Settings) -> str:
    """Changes when anything the deployments are built from changes (config, or the settings they receive)."""
    import hashlib

    specs = "|".join(spec_from_ray(config, m, settings).model_dump_json() for m in config.models)
    body = f"{config.fingerprint()}|{worker_options(settings).model_dump_json()}|{specs}"
    return hashlib.sha256(body.encode()).hexdigest()[:16]


def deploy(settings: Settings, config: RayAppConfig, address: str | None) -> bool:
    """Connect to (or start) Ray and deploy the application; returns whether this process owns the cluster."""
    import ray
    from ray import serve
    from ray.serve.config import ProxyLocation

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    address = address or config.ray.address
    if address:
        ray.init(address=address, namespace=config.ray.namespace, log_to_driver=False)
    else:  # a local cluster that lives as long as this process
        ray.init(namespace=config.ray.namespace, num_cpus=config.ray.num_cpus, num_gpus=config.ray.num_gpus,
                 include_dashboard=False, log_to_driver=False)
    serve.start(proxy_location=ProxyLocation.Disabled)  # no HTTP ingress: jobs arrive through Redis
    fingerprint = app_fingerprint(config, settings)
    declared, _ = asyncio.run(_declared(settings))
    apps = serve.status().applications
    if declared == fingerprint and config.app_name in apps and apps[config.app_name].status != "DEPLOY_FAILED":
        log.info("Ray application %r is already deployed with this config; not redeploying", config.app_name)
    else:
        log.info("deploying Ray application %r (%s)", config.app_name, ", ".join(deployment_names(config)))
        serve.run_many([serve.RunTarget(target=build_application(config, settings), name=config.app_name,
                                        route_prefix=None)],
                       wait_for_ingress_deployment_creation=False, wait_for_applications_running=False)
    asyncio.run(_declare(settings, config, fingerprint))
    return not address


async def _declared(settings: Settings) -> tuple[str | None, dict[str, Any]]:
    from deploy.cluster import redis_queue
    from jobqueue.heartbeats import Heartbeats

    queue = redis_queue(settings)
    try:
        return await Heartbeats(queue.client, queue.keys).declared()
    finally:
        await queue.client.aclose()


async def _declare(settings: Settings, config: RayAppConfig, fingerprint: str) -> None:
    from deploy.cluster import redis_queue
    from jobqueue.heartbeats import Heartbeats

    queue = redis_queue(settings)
    try:
        await Heartbeats(queue.client, queue.keys).declare(deployment_names(config), fingerprint)
    finally:
        await queue.client.aclose()


def build_ray_gateway_app(settings: Settings) -> FastAPI:
    """The gateway of the Ray wiring: Redis queue, served models from the registry, hub pushes to the pusher, and
    the tenants' resident-adapter quotas published for the trainer replicas."""
    from api_schemas.models import ServedModel
    from deploy.cluster import follow_registry, publish_resident_limits, redis_queue, shared_auth
    from jobqueue.hub_push_queue import RedisHubPusher
    from server.app import create_app
    from server.services.secrets import load_secret

    queue = redis_queue(settings)
    served: dict[str, ServedModel] = {}
    pusher = RedisHubPusher(queue.client, queue.keys, load_secret(settings))
    background = [lambda: follow_registry(queue, served), lambda: publish_resident_limits(settings, queue)]
    return create_app(settings, queue, served, background=background, pusher=pusher,
                      shared=shared_auth(queue, settings.auth_check_seconds))


def serve_ray(settings: Settings, config: RayAppConfig, address: str | None, deploy_app: bool = True) -> int:
    """`twinkle-server serve --backend ray`: deploy (unless someone else does, e.g. KubeRay), then serve the gateway
    until stopped."""
    from deploy.console import run_gateway
    from server.services.secrets import load_secret

    settings = apply_limits(settings, config)
    load_secret(settings)  # created before any pusher replica looks for it (same data dir on one machine)
    owns_cluster = deploy(settings, config, address) if deploy_app else False
    if deploy_app and not owns_cluster:
        import ray

        ray.shutdown()  # the application lives on in the cluster; the gateway needs only Redis and SQL
    try:
        run_gateway(build_ray_gateway_app(settings), settings)
    finally:
        if owns_cluster:
            import ray

            ray.shutdown()
    return 0
