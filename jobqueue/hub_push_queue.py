"""Hub pushes through Redis: the gateway's `pusher` in the Ray wiring, and the consumer the pusher deployment runs.

Gateway side (`RedisHubPusher`, an `api_schemas.hub.HubPusher`): seals the push spec (it holds the tenant's token)
under the cluster secret (jobqueue/sealing.py, bound to the push id), stores it under a short-lived key, adds the
push id to a stream, and waits for the outcome
with a blocking pop (a push, not a poll), reading the upload's progress from a key the pusher refreshes about every
second between pops. Pusher side (`HubPushConsumer`): a consumer group over that stream, so any
number of pusher replicas share the work; each push runs once, on the uploader it was given (threads). A pusher that
dies mid-upload leaves its entry pending; a live one claims it after `reclaim_idle` and reports the push as
interrupted (the spec, and so the token, was deleted when first taken).
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from api_schemas.hub import HubPusher, HubPushFailed, HubPushOutcome, HubPushSpec, Progress
from jobqueue.keys import Keys
from jobqueue.sealing import Sealer, SealError

log = logging.getLogger(__name__)

GROUP = "pushers"
_PURPOSE = b"hub-push-spec"
PROGRESS_SECONDS = 1.0  # how often a running push's progress is published and read


class RedisHubPusher:
    def __init__(self, client: aioredis.Redis, keys: Keys, secret: bytes, timeout: float = 6 * 3600,
                 spec_ttl: float = 3600) -> None:
        self.client, self.keys = client, keys
        self.sealer = Sealer(secret, _PURPOSE)
        self.timeout, self.spec_ttl = timeout, spec_ttl

    async def __call__(self, spec: HubPushSpec, progress: Progress) -> HubPushOutcome:
        push_id = uuid.uuid4().hex
        body = spec.model_dump(mode="json") | {"token": spec.token.get_secret_value()}
        sealed = self.sealer.seal(json.dumps(body).encode(), aad=push_id.encode())  # opens only as this push
        async with self.client.pipeline(transaction=True) as pipe:
            pipe.set(self.keys.hub_push_spec(push_id), sealed, ex=max(1, int(self.spec_ttl)))
            pipe.xadd(self.keys.hub_push_stream, {"id": push_id})
            await pipe.execute()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout
        while (left := deadline - loop.time()) > 0:
            popped = await self.client.blpop([self.keys.hub_push_result(push_id)], timeout=min(left, PROGRESS_SECONDS))
            if popped is not None:
                await self.client.delete(self.keys.hub_push_progress(push_id))
                outcome = json.loads(popped[1])
                if outcome.get("error"):
                    raise HubPushFailed(outcome["error"])
                return HubPushOutcome(url=outcome["url"])
            if (figures := await self.client.get(self.keys.hub_push_progress(push_id))) is not None:
                done, total = (int(x) for x in figures.split())
                progress(done, total)
        raise HubPushFailed("no checkpoint pusher finished the push in time (is the pusher deployment running?)")


class HubPushConsumer:
    """Runs pushes taken from the stream on `pusher` (workers/checkpoints/hub.HubPusherPool), `concurrency` at once."""

    def __init__(self, client: aioredis.Redis, keys: Keys, secret: bytes | None, pusher: HubPusher,
                 name: str, concurrency: int = 2, reclaim_idle: float = 900.0, result_ttl: float = 3600) -> None:
        self.client, self.keys, self.pusher, self.name = client, keys, pusher, name
        self.sealer = Sealer(secret, _PURPOSE) if secret is not None else None
        self.concurrency, self.reclaim_idle, self.result_ttl = concurrency, reclaim_idle, result_ttl
        self._tasks: set[asyncio.Task[None]] = set()
        self._stopping = False

    async def run(self) -> None:
        stream = self.keys.hub_push_stream
        try:
            await self.client.xgroup_create(stream, GROUP, id="0", mkstream=True)
        except ResponseError as e:
            if "BUSYGROUP" not in str(e):
                raise
        try:
            while not self._stopping:
                free = self.concurrency - len(self._tasks)
                if free <= 0:  # every uploader busy: take no more work until one finishes
                    await asyncio.wait(set(self._tasks), return_when=asyncio.FIRST_COMPLETED)
                    continue
                for entry_id, fields in await self._claim(free) or await self._read(free):
                    task = asyncio.create_task(self._handle(entry_id, fields.get(b"id", b"").decode()))
                    self._tasks.add(task)
                    task.add_done_callback(self._tasks.discard)
        finally:
            for task in list(self._tasks):
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _read(self, count: int) -> list[tuple[str, dict[bytes, bytes]]]:
        reply: Any = await self.client.xreadgroup(GROUP, self.name, {self.keys.hub_push_stream: ">"}, count=count,
                                                  block=2000)
        return [(_s(i), f) for _, entries in (reply or []) for i, f in entries if f]

    async def _claim(self, count: int) -> list[tuple[str, dict[bytes, bytes]]]:
        reply: Any = await self.client.xautoclaim(self.keys.hub_push_stream, GROUP, self.name,
                                                  int(self.reclaim_idle * 1000), "0-0", count=count)
        return [(_s(i), f) for i, f in reply[1] if f]

    async def _handle(self, entry_id: str, push_id: str) -> None:
        outcome: dict[str, str]
        blob = await self.client.getdel(self.keys.hub_push_spec(push_id))
        try:
            if blob is None:
                raise HubPushFailed("the push was interrupted (a pusher stopped, or the request expired); push again")
            if self.sealer is None:
                raise HubPushFailed("the checkpoint pusher does not know the server secret "
                                    "(set TWINKLE_SIGNING_SECRET on the worker nodes, the same as the gateway's)")
            raw = blob if isinstance(blob, bytes) else blob.encode()
            spec = HubPushSpec.model_validate_json(self.sealer.unseal(raw, aad=push_id.encode()))
            log.info("pushing %s to %s (%s)", spec.storage_key, spec.repo_id, spec.provider)
            outcome = {"url": (await self._push(push_id, spec)).url}
        except (HubPushFailed, SealError) as e:
            outcome = {"error": str(e)}
        except Exception as e:  # the pusher reports its own failures; this guards the loop
            log.exception("hub push %s crashed", push_id)
            outcome = {"error": f"the checkpoint pusher failed: {type(e).__name__}"}
        key = self.keys.hub_push_result(push_id)
        async with self.client.pipeline(transaction=True) as pipe:
            pipe.rpush(key, json.dumps(outcome))
            pipe.expire(key, max(1, int(self.result_ttl)))
            pipe.xack(self.keys.hub_push_stream, GROUP, entry_id)
            pipe.xdel(self.keys.hub_push_stream, entry_id)
            await pipe.execute()

    async def _push(self, push_id: str, spec: HubPushSpec) -> HubPushOutcome:
        """The upload, with its latest progress published under the push's progress key while it runs."""
        latest: list[tuple[int, int]] = []  # set from the uploader's threads; read here
        upload = asyncio.ensure_future(self.pusher(spec, lambda done, total: latest.append((done, total))))
        key, sent = self.keys.hub_push_progress(push_id), None
        while not upload.done():
            await asyncio.wait([upload], timeout=PROGRESS_SECONDS)
            if latest and latest[-1] != sent:
                sent = latest[-1]
                del latest[:-1]
                await self.client.set(key, f"{sent[0]} {sent[1]}", ex=max(1, int(self.result_ttl)))
        return upload.result()

    def stop(self) -> None:
        self._stopping = True


def _s(v: bytes | str) -> str:
    return v.decode() if isinstance(v, bytes) else v
