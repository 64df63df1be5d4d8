"""Worker side of the Redis queue for one queue (one lane of a base model): lease, consumer group, reads, reclaims.

Exactly one worker process runs a queue's jobs at a time: it holds the lease (SET NX PX, renewed in the
background, fenced in every acknowledgement). A worker that takes over after its predecessor died first
reclaims the entries the dead consumer had read but never acknowledged (XAUTOCLAIM), then reads new ones.
Later, entries of any other consumer idle longer than `reclaim_idle` are claimed as well (XPENDING + XCLAIM).
The worker's own pending entries are re-read only after a read failed (the connection dropped, Redis restarted):
Redis may have delivered entries whose answer never arrived, and nobody else would ever run them while this worker
holds the lease. Those the worker already has (`running`: the scheduler may hold them for a while) are left out.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
import uuid

import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from jobqueue import redis_scripts as lua
from jobqueue.base import LeaseLost
from jobqueue.keys import GROUP, Keys

log = logging.getLogger(__name__)

Entry = tuple[str, dict[bytes, bytes]]  # stream entry id, fields


class StreamConsumer:
    def __init__(
        self, client: aioredis.Redis, keys: Keys, queue_name: str, lease_ttl: float, reclaim_idle: float, batch: int
    ) -> None:
        self.client = client
        self.stream = keys.stream(queue_name)
        self.lease_key = keys.lease(queue_name)
        self.queue_name = queue_name
        self.name = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.token = self.name
        self.lease_ttl = lease_ttl
        self.reclaim_idle = reclaim_idle
        self.batch = batch
        self.held = False
        self.lost = False
        self._renewer: asyncio.Task[None] | None = None
        self._takeover_done = False
        self._next_reclaim = 0.0
        self._reread_own = False  # a read failed: entries may have been delivered without their answer

    async def ensure_group(self) -> None:
        try:  # id 0: jobs queued before any worker existed are delivered too
            await self.client.xgroup_create(self.stream, GROUP, id="0", mkstream=True)
        except ResponseError as e:
            if "BUSYGROUP" not in str(e):
                raise

    async def acquire(self, timeout: float) -> bool:
        """Take the lease, waiting up to `timeout` for a previous holder's lease to run out."""
        if self.lost:
            raise LeaseLost(f"lease of {self.queue_name} was lost")
        if self.held:
            return True
        deadline = time.monotonic() + timeout
        while True:
            if await self.client.set(self.lease_key, self.token, nx=True, px=int(self.lease_ttl * 1000)):
                break
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            pttl = await self.client.pttl(self.lease_key)
            await asyncio.sleep(min(left, max(pttl, 10) / 1000))  # sleep exactly until the other lease expires
        self.held = True
        await self.ensure_group()
        self._renewer = asyncio.create_task(self._renew(), name=f"twinkle-lease-{self.queue_name}")
        log.info("worker %s holds the lease of %s", self.name, self.queue_name)
        return True

    async def _renew(self) -> None:
        ms = int(self.lease_ttl * 1000)
        while True:
            await asyncio.sleep(self.lease_ttl / 3)
            try:
                ok = await self.client.eval(lua.RENEW, 1, self.lease_key, self.token, ms)
            except Exception:  # noqa: BLE001 - a blip; the next renewal retries before the lease runs out
                log.warning("lease renewal of %s failed", self.queue_name, exc_info=True)
                continue
            if not ok:
                log.error("lease of %s was lost; this worker must stop", self.queue_name)
                self.lost, self.held = True, False
                return

    async def read(self, timeout: float, running: frozenset[str] = frozenset()) -> list[Entry]:
        """Entries to run: a dead predecessor's first, then, after a failed read, this consumer's own pending ones
        that are not `running` (entry ids the worker has), else new ones (blocking up to `timeout` for one)."""
        try:
            return await self._read(timeout, running)
        except Exception:  # the answer may be lost after Redis delivered or claimed (and, with AOF, recorded) entries
            self._reread_own = True
            raise

    async def _read(self, timeout: float, running: frozenset[str]) -> list[Entry]:
        claimed = await self._reclaim()
        if claimed:
            return claimed
        if self._reread_own:
            own = await self._own_pending(running)
            self._reread_own = False
            if own:
                log.warning("re-read %d jobs of %s delivered while a read failed", len(own), self.queue_name)
                return own
        block = max(1, int(timeout * 1000)) if timeout > 0 else None  # None: no BLOCK (0 would wait forever)
        try:
            reply = await self.client.xreadgroup(GROUP, self.name, {self.stream: ">"}, count=self.batch, block=block)
        except ResponseError as e:
            if "NOGROUP" not in str(e):
                raise
            log.warning("consumer group of %s is gone (Redis restarted without persistence?); recreating", self.queue_name)
            await self.ensure_group()
            return []
        return [(_s(i), f) for _, entries in (reply or []) for i, f in entries if f]

    async def _own_pending(self, running: frozenset[str]) -> list[Entry]:
        """This consumer's delivered, unacknowledged entries (XREADGROUP from id 0), minus those `running`."""
        out: list[Entry] = []
        after = "0"
        while True:
            reply = await self.client.xreadgroup(GROUP, self.name, {self.stream: after}, count=self.batch)
            entries = [(_s(i), f) for _, rows in (reply or []) for i, f in rows]
            if not entries:
                return out
            out += [(i, f) for i, f in entries if f and i not in running]  # no fields: deleted since
            after = entries[-1][0]

    async def _reclaim(self) -> list[Entry]:
        if not self._takeover_done:  # right after taking the lease every other consumer is dead: take all
            out: list[Entry] = []
            start = "0-0"
            while True:
                reply = await self.client.xautoclaim(self.stream, GROUP, self.name, 0, start, count=self.batch)
                start, entries = _s(reply[0]), reply[1]
                out += [(_s(i), f) for i, f in entries if f]
                if start == "0-0":
                    break
            self._takeover_done = True  # only now: a takeover cut short by a failure starts again
            await self._drop_other_consumers()
            if out:
                log.warning("reclaimed %d unacknowledged jobs of %s from a dead worker", len(out), self.queue_name)
            self._next_reclaim = time.monotonic() + self.reclaim_idle
            return out
        if time.monotonic() < self._next_reclaim:
            return []
        self._next_reclaim = time.monotonic() + self.reclaim_idle
        idle_ms = int(self.reclaim_idle * 1000)
        pending = await self.client.xpending_range(self.stream, GROUP, "-", "+", self.batch, idle=idle_ms)
        ids = [p["message_id"] for p in pending if _s(p["consumer"]) != self.name]
        if not ids:
            return []
        entries = await self.client.xclaim(self.stream, GROUP, self.name, idle_ms, ids)
        return [(_s(i), f) for i, f in entries if f]

    async def _drop_other_consumers(self) -> None:
        for c in await self.client.xinfo_consumers(self.stream, GROUP):
            name = _s(c["name"])
            if name != self.name and int(c["pending"]) == 0:
                await self.client.xgroup_delconsumer(self.stream, GROUP, name)

    async def release(self) -> None:
        if self._renewer is not None:
            self._renewer.cancel()
            await asyncio.gather(self._renewer, return_exceptions=True)
            self._renewer = None
        if self.held:
            await self.client.eval(lua.RELEASE, 1, self.lease_key, self.token)
            self.held = False


def _s(v: bytes | str) -> str:
    return v.decode() if isinstance(v, bytes) else v

