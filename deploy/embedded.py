"""Embedded mode: gateway + in-process queue + the workers of every served base model, in one process (the default
`twinkle-server serve`)."""

from __future__ import annotations

from fastapi import FastAPI

from deploy.specs import specs_from_settings
from jobqueue.local_queue import LocalQueue
from server.app import create_app
from server.config import Settings
from server.services.tenant_limits import TenantLimits
from workers.runtime import Runtime


def build_embedded_app(settings: Settings) -> FastAPI:
    limits = TenantLimits(settings)  # the gateway's quotas; the engine reads each tenant's adapters-in-memory limit
    queue = LocalQueue(result_ttl=settings.result_ttl_seconds)
    runtimes, failed = Runtime.build_all(specs_from_settings(settings), queue, resident_limit=limits.resident_adapters,
                                         skip_failed=settings.skip_failed_models)
    served = {rt.served.name: rt.served for rt in runtimes}
    return create_app(settings, queue, served, background=[run for rt in runtimes for run, _ in rt.loops()],
                      pusher=runtimes[0].hub_pusher(), limits=limits, unavailable=failed)
