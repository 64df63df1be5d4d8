"""Push wake-ups for the Redis queue: one pub/sub subscription per process fans messages out to local waiters.

A waiter registers its event *before* it checks Redis for what it waits on, and the subscription is confirmed
before the first check, so a PUBLISH that follows the write it announces can never be missed. If the
subscription drops, every waiter is woken to check again once it is back.

Messages are names ("j:<job id>", "f:<feed>", "s:served"), or "r:<job id>|<small result>": a completion that
carries its result (see redis_scripts.COMPLETE), handed to the job's waiters so they need not read it back.
"""

from __future__ import annotations

import asyncio
import logging
from collections import defaultdict

import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

log = logging.getLogger(__name__)


class Waiter(asyncio.Event):
    """Set by a push for its name; `payload` holds the result bytes when the push carried them."""

    payload: bytes | None = None


class PushWaiters:
    def __init__(self, client: aioredis.Redis, channel: str) -> None:
        self._client = client
        self._channel = channel
        self._events: dict[str, set[Waiter]] = defaultdict(set)
        self._ready = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def register(self, name: str) -> Waiter:
        ev = Waiter()
        self._events[name].add(ev)
        return ev

    def unregister(self, name: str, ev: Waiter) -> None:
        events = self._events.get(name)
        if events is not None:
            events.discard(ev)
            if not events:
                del self._events[name]

    async def ready(self, timeout: float) -> bool:
        """Start the subscription if needed; True once it is confirmed (within `timeout`)."""
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._listen(), name="twinkle-redis-pushes")
        elif self._ready.is_set():  # the usual case: no wait_for (it would make a task per call)
            return True
        try:
            await asyncio.wait_for(self._ready.wait(), timeout)
        except asyncio.TimeoutError:
            return False
        return True

    async def _listen(self) -> None:
        backoff = 0.05
        while True:
            pubsub = self._client.pubsub()
            try:
                await pubsub.subscribe(self._channel)
                while True:  # the confirmation comes first; nothing before it is ours
                    msg = await pubsub.get_message(timeout=5.0)
                    if msg is not None and msg["type"] == "subscribe":
                        break
                self._ready.set()
                backoff = 0.05
                self._wake_all()  # anything published while we were away: let every waiter look again
                while True:
                    msg = await pubsub.get_message(ignore_subscribe_messages=True, timeout=30.0)
                    if msg is not None and msg["type"] == "message":
                        try:
                            self._on_message(msg["data"])
                        except ValueError:  # not ours (UnicodeDecodeError included): the subscription goes on
                            log.warning("ignoring a malformed push %r", msg["data"][:80])
            except (RedisConnectionError, RedisTimeoutError, OSError) as e:
                self._ready.clear()
                log.warning("redis push subscription lost (%s); reconnecting", e)
                self._wake_all()
                await asyncio.sleep(backoff)  # reconnect back-off, not a result poll
                backoff = min(backoff * 2, 2.0)
            finally:
                try:
                    await pubsub.aclose()
                except Exception:  # noqa: BLE001 - the connection may already be gone
                    pass

    def _on_message(self, data: bytes) -> None:
        if data.startswith(b"r:"):
            job_id, _, payload = data[2:].partition(b"|")
            self._wake("j:" + job_id.decode(), payload)
        else:
            self._wake(data.decode())

    def _wake(self, name: str, payload: bytes | None = None) -> None:
        for ev in self._events.get(name, ()):
            if payload is not None:
                ev.payload = payload
            ev.set()

    def _wake_all(self) -> None:
        for events in self._events.values():
            for ev in events:
                ev.set()

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        self._ready.clear()
