"""Embedded mode: gateway + in-process queue + the worker, in one process (the default `twinkle-server serve`)."""

from __future__ import annotations

from fastapi import FastAPI

from deploy.specs import spec_from_settings
from jobqueue.local_queue import LocalQueue
from server.app import create_app
from server.config import Settings
from server.services.tenant_limits import TenantLimits
from workers.runtime import Runtime


def build_embedded_app(settings: Settings) -> FastAPI:
    limits = TenantLimits(settings)  # the gateway's quotas; the engine reads each tenant's adapters-in-memory limit
    queue = LocalQueue(result_ttl=settings.result_ttl_seconds)
    runtime = Runtime.build(spec_from_settings(settings), queue, resident_limit=limits.resident_adapters)
    served = runtime.served
    return create_app(settings, queue, {served.name: served}, background=[run for run, _ in runtime.loops()],
                      pusher=runtime.hub_pusher(), limits=limits)
