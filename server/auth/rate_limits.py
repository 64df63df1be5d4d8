"""Per-tenant rate limits: a token bucket (pure arithmetic, time passed in), and the gateway's request limiter.

The bucket holds at most `burst` tokens (default: one minute's) and refills continuously. A request may take its
tokens when the bucket holds them; a request larger than a whole bucket may go once the bucket is full and leaves
it in debt, so nothing is ever too big to run, only delayed. Admission (server/services/quotas.py) charges
training and sampling tokens to such a bucket; `RequestLimiter` charges each HTTP request one token.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass
class TokenBucket:
    per_minute: float
    level: float
    updated: float  # the time `level` was computed at
    burst: float | None = None  # the most it holds (None: per_minute)

    @classmethod
    def full(cls, per_minute: float, now: float, burst: float | None = None) -> TokenBucket:
        return cls(per_minute, burst if burst is not None else per_minute, now, burst)

    @property
    def rate(self) -> float:
        return self.per_minute / 60.0

    @property
    def capacity(self) -> float:
        return self.burst if self.burst is not None else self.per_minute

    def _refill(self, now: float) -> None:
        if now > self.updated:
            self.level = min(self.capacity, self.level + (now - self.updated) * self.rate)
            self.updated = now

    def wait(self, tokens: float, now: float) -> float:
        """Seconds until `tokens` may be taken (0: now)."""
        self._refill(now)
        need = min(tokens, self.capacity)  # more than a bucketful: wait for a full bucket, go into debt
        return 0.0 if self.level >= need else (need - self.level) / self.rate

    def take(self, tokens: float, now: float) -> None:
        self._refill(now)
        self.level -= tokens

    def resize(self, per_minute: float, now: float) -> None:
        """Apply a changed quota; the tokens already used stay used."""
        self._refill(now)
        self.per_minute = per_minute
        self.level = min(self.level, self.capacity)


log = logging.getLogger(__name__)

# KEYS: the tenant's bucket (Keys.request_bucket). ARGV: tokens per millisecond, burst.
# Returns 0 (one token taken) or the milliseconds until one is there (nothing taken). Redis' clock: every gateway
# shares it, so their clocks need not agree.
_TAKE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local rate, burst = tonumber(ARGV[1]), tonumber(ARGV[2])
local v = redis.call('HMGET', KEYS[1], 'level', 'at')
local level, at = tonumber(v[1]) or burst, tonumber(v[2]) or now
if now > at then level = math.min(burst, level + (now - at) * rate) else now = at end
if level < 1 then return math.ceil((1 - level) / rate) end
level = level - 1
redis.call('HSET', KEYS[1], 'level', tostring(level), 'at', tostring(now))
redis.call('PEXPIRE', KEYS[1], math.ceil((burst - level) / rate) + 1000)
return 0
"""


class RequestLimiter:
    """Each tenant's request rate: `wait(tenant, per_minute, burst)` takes one request's token (0.0) or says how
    many seconds until one is there. In-process buckets, or one Redis bucket per tenant shared by every gateway of
    a cluster (`client`: the queue's Redis client; `bucket`: Keys.request_bucket)."""

    def __init__(self, client: Any = None, bucket: Callable[[str], str] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._script = client.register_script(_TAKE) if client is not None else None
        self._bucket = bucket
        self._clock = clock
        self._local: dict[str, TokenBucket] = {}
        self._warned = float("-inf")  # when Redis being away was last logged (once a minute at most)

    async def wait(self, tenant_id: str, per_minute: int, burst: int | None) -> float:
        cap = max(1, burst if burst is not None else per_minute)
        if per_minute <= 0:
            return 60.0  # a tenant limited to no requests: always told to come back later
        if self._script is not None and self._bucket is not None:
            try:
                waited = await self._script(keys=[self._bucket(tenant_id)], args=[per_minute / 60_000.0, cap])
            except Exception as e:  # Redis away: the request goes (what it needs from Redis will answer for it)
                if self._clock() - self._warned >= 60:
                    self._warned = self._clock()
                    log.warning("request rate limits not applied: Redis: %s: %s", type(e).__name__, e)
                return 0.0
            return int(waited) / 1000.0
        now = self._clock()
        bucket = self._local.get(tenant_id)
        if bucket is None:
            bucket = self._local[tenant_id] = TokenBucket.full(per_minute, now, cap)
        elif bucket.per_minute != per_minute or bucket.burst != cap:
            bucket.burst = cap
            bucket.resize(per_minute, now)
        waited_s = bucket.wait(1, now)
        if waited_s == 0.0:
            bucket.take(1, now)
        return waited_s
