"""Workers' Prometheus metrics through Redis: each worker process publishes its registry, the gateways show it.

A `twinkle-server worker` or a Ray replica has no HTTP port of its own to scrape (several replicas share a node,
and the gateway is the one address an operator knows), so it rewrites its field of `Keys.metrics` every few
seconds with its registry in the text exposition format and an expiry. A gateway's `/metrics` reads the hash,
drops expired fields, and merges every worker's families into its own with a `worker` label
(server/services/metrics.py). In embedded mode the workers share the gateway's process and registry: nothing is
published. `TenantLabels` bounds the tenant label of per-tenant counters, on both sides.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import threading
import time
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from prometheus_client import REGISTRY, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from jobqueue.keys import Keys

log = logging.getLogger(__name__)


class TenantLabels:
    """Tenant id -> its metric label: itself for the first `limit` ids seen by this process, then "other".
    Tenant ids are generated (never a name or client text), and the label set stays bounded."""

    def __init__(self, limit: int = 50) -> None:
        self.limit = limit
        self._known: set[str] = set()
        self._lock = threading.Lock()

    def __call__(self, tenant_id: str) -> str:
        if tenant_id in self._known:
            return tenant_id
        with self._lock:
            if len(self._known) < self.limit:
                self._known.add(tenant_id)
                return tenant_id
        return "other"


def worker_id(kind: str) -> str:
    """A worker process's name in the `worker` label: its role, host and pid."""
    return f"{kind}@{socket.gethostname()}:{os.getpid()}"


class MetricsPublisher:
    """Rewrites this process's field of `Keys.metrics` every `period` seconds (`run`, stopped by `stop`)."""

    def __init__(self, client: Any, keys: Keys, worker: str, period: float = 5.0, registry: Collector = REGISTRY) -> None:
        self.client, self.keys, self.worker, self.period, self.registry = client, keys, worker, period, registry
        self._stopping = asyncio.Event()

    async def publish(self) -> None:
        text = generate_latest(self.registry)
        body = f"{time.time() + 3 * self.period:.3f}\n".encode() + text
        async with self.client.pipeline(transaction=True) as pipe:
            pipe.hset(self.keys.metrics, self.worker, body)
            pipe.expire(self.keys.metrics, max(1, int(self.period * 6)))  # the hash goes with the last worker
            await pipe.execute()

    async def run(self) -> None:
        while not self._stopping.is_set():
            try:
                await self.publish()
            except Exception:  # noqa: BLE001 - Redis briefly away: the next period publishes again
                log.warning("publishing the metrics of %s failed", self.worker, exc_info=True)
            try:
                await asyncio.wait_for(self._stopping.wait(), self.period)
            except TimeoutError:
                pass
        try:
            await self.client.hdel(self.keys.metrics, self.worker)
        except Exception:  # noqa: BLE001 - it expires on its own
            pass

    def stop(self) -> None:
        self._stopping.set()


async def read_worker_metrics(client: Any, keys: Keys) -> dict[str, bytes]:
    """{worker id: Prometheus text} of the workers whose publication has not expired (expired ones are pruned)."""
    raw: Mapping[bytes, bytes] = await client.hgetall(keys.metrics)
    now, live, dead = time.time(), {}, []
    for field, value in raw.items():
        head, _, text = value.partition(b"\n")
        try:
            expired = float(head) < now
        except ValueError:
            expired = True
        name = field.decode() if isinstance(field, bytes) else str(field)
        if expired:
            dead.append(field)
        else:
            live[name] = text
    if dead:
        await client.hdel(keys.metrics, *dead)
    return live


class Merged(Collector):
    """The families of `local` plus every worker's, each worker's samples labelled `worker`; families of the same
    name become one (the exposition format allows each name once)."""

    def __init__(self, local: Collector, workers: Mapping[str, bytes]) -> None:
        self.local, self.workers = local, workers

    def collect(self) -> Iterator[Metric]:
        families: dict[str, Metric] = {}
        for family in self.local.collect():
            families[family.name] = family
        for worker, text in self.workers.items():
            for family in _parse(text.decode(errors="replace")):
                into = families.get(family.name)
                if into is None:
                    into = families[family.name] = Metric(family.name, family.documentation, family.type, family.unit)
                into.samples.extend(s._replace(labels={**s.labels, "worker": worker}) for s in family.samples)
        yield from families.values()


def _parse(text: str) -> Iterable[Metric]:
    try:
        return list(text_string_to_metric_families(text))
    except ValueError:  # a garbled publication shows nothing rather than failing the scrape
        log.warning("unreadable worker metrics skipped")
        return []
