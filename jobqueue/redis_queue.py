"""The cluster queue: Redis Streams, one stream per queue (base model + lane), read by a consumer group. It is both
faces of the queue (GatewayQueue and WorkerQueue, jobqueue/base.py); a process uses the one it needs.

Gateway: `submit` is one atomic script (dedup key SET NX with a payload fingerprint, job hash, XADD); waiters
are woken by pub/sub pushes (see redis_waiters). Worker: `fetch` reads (or reclaims) entries under the queue's
lease (a read starts a job: `cancel` succeeds only before it); `complete` stores the result (its typed output as
JSON, `JobResult.body`, or its error), records the replay log and acknowledges, all in one script, so a job's effect
is acknowledged exactly when its result is stored. Results live `result_ttl` seconds after completion and again
after their first delivery. Key names: jobqueue/keys.py; scripts: jobqueue/redis_scripts.py.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from api_schemas.jobs import ErrorCategory, Job, JobError, JobResult, JobState, ResultKind
from api_schemas.models import ServedModel
from jobqueue import redis_scripts as lua
from jobqueue.base import (
    Completion,
    DuplicateJobMismatch,
    FeedPage,
    GatewayQueue,
    Health,
    JobInfo,
    LeaseLost,
    RecoveryState,
    as_skip,
    WorkerQueue,
    cancelled_result,
)
from jobqueue.heartbeats import Heartbeats
from jobqueue.keys import GROUP, Keys
from jobqueue.metrics_feed import read_worker_metrics
from jobqueue.redis_consumer import StreamConsumer
from jobqueue.redis_waiters import PushWaiters, Waiter

log = logging.getLogger(__name__)

_STATES = {b"queued": JobState.QUEUED, b"running": JobState.RUNNING, b"done": JobState.DONE}  # running: older hashes


def _result(job_id: str, body: bytes, cat: bytes, msg: bytes) -> JobResult:
    if cat:
        return JobResult(job_id=job_id, error=JobError(category=ErrorCategory(cat.decode()), message=msg.decode()))
    return JobResult.from_body(job_id, body)


def _inline_result(job_id: str, payload: bytes) -> JobResult | None:
    """The result a wake-up push carried ("cat|len(msg)|msg+body", see redis_scripts), None if unreadable."""
    try:
        cat, n, rest = payload.split(b"|", 2)
        return _result(job_id, rest[int(n):], cat, rest[:int(n)])
    except ValueError:  # pydantic's ValidationError and UnicodeDecodeError included
        return None


class RedisQueue(GatewayQueue, WorkerQueue):
    def __init__(
        self,
        url: str,
        *,
        prefix: str = "twinkle",
        result_ttl: float = 900.0,
        job_ttl: float = 86400.0,
        lease_ttl: float = 10.0,
        reclaim_idle: float = 30.0,
        batch: int = 256,
        inline_result_max: int = 65536,
    ) -> None:
        # A Redis restart drops every pooled connection: retry on a fresh one instead of failing the caller.
        # Repeating a write is harmless: submits carry dedup keys, a result is stored once, an ack is idempotent.
        retry = Retry(ExponentialBackoff(cap=1.0, base=0.05), retries=8)
        self.client: aioredis.Redis = aioredis.Redis.from_url(
            url, decode_responses=False, health_check_interval=30, retry=retry,
            retry_on_error=[RedisConnectionError, RedisTimeoutError],
        )
        self.keys = Keys(prefix)
        self.result_ttl = max(1, int(result_ttl))
        self.job_ttl = max(self.result_ttl, int(job_ttl))
        self.lease_ttl, self.reclaim_idle, self.batch = lease_ttl, reclaim_idle, batch
        self.inline_result_max = inline_result_max  # results up to this size ride along with their wake-up push
        self._background: set[asyncio.Task[JobResult | None]] = set()
        self._waiters = PushWaiters(self.client, self.keys.done_channel)
        self._consumers: dict[str, StreamConsumer] = {}
        self._inflight: dict[str, tuple[str, str, str]] = {}  # job_id -> (stream entry, queue name, feed)
        self._queue_of: dict[str, str] = {}  # model_id -> queue name, for the models this worker ran
        self._s = {name: self.client.register_script(src) for name, src in vars(lua).items()
                   if name.isupper() and not name.startswith("_")}

    # --- gateway side ---
    async def submit(self, job: Job, dedup_key: str | None = None, feed: str | None = None) -> str:
        k = self.keys
        keys = [k.dedup(dedup_key) if dedup_key else k.job(job.job_id), k.job(job.job_id), k.stream(job.queue_name)]
        args = [job.job_id, job.fingerprint(), "1" if dedup_key else "0", self.job_ttl, self.job_ttl,
                job.model_dump_json(), job.tenant_id, job.result_kind.value, job.model_id, job.seq_id, job.base_model,
                feed or "", job.queue_name]
        code, job_id = await self._s["SUBMIT"](keys=keys, args=args)
        if int(code) == 0:
            raise DuplicateJobMismatch(f"{dedup_key} was already submitted with a different payload")
        return job_id.decode()

    async def dedup_id(self, dedup_key: str) -> str | None:
        seen = await self.client.get(self.keys.dedup(dedup_key))
        return seen.decode().split("|", 1)[0] if seen else None

    async def info(self, job_id: str) -> JobInfo | None:
        tenant, kind, state = await self.client.hmget(self.keys.job(job_id), "tenant", "kind", "state")
        if tenant is None:
            return None
        return JobInfo(tenant_id=tenant.decode(), result_kind=ResultKind(kind.decode()), state=_STATES[state])

    async def wait_result(self, job_id: str, timeout: float) -> JobResult | None:
        return await self._wait(f"j:{job_id}", timeout, lambda ev: self._take(job_id, ev))

    async def _take(self, job_id: str, ev: Waiter) -> JobResult | None:
        result = _inline_result(job_id, ev.payload) if ev.payload is not None else None
        if result is None:  # no push yet, a push without the result, or one we cannot read: read it from Redis
            return await self._deliver(job_id)
        # The push carried the result: answer now; recording the delivery (its TTL) follows off the waiter's path
        task = asyncio.create_task(self._deliver(job_id, record_only=True))
        self._background.add(task)
        task.add_done_callback(self._background_done)
        return result

    async def _deliver(self, job_id: str, record_only: bool = False) -> JobResult | None:
        keys = [self.keys.result(job_id), self.keys.job(job_id)]
        r = await self._s["DELIVER"](keys=keys, args=[self.result_ttl, "1" if record_only else "0"])
        if not r or record_only:
            return None
        return _result(job_id, r[0] or b"", r[1] or b"", r[2] or b"")

    def _background_done(self, task: asyncio.Task[JobResult | None]) -> None:
        self._background.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.warning("recording a delivery failed (the result keeps its completion TTL)", exc_info=task.exception())

    async def wait_feed(self, feed: str, after: int, timeout: float, retrieved: Sequence[str] = ()) -> FeedPage:
        zkey = self.keys.feed(feed)
        if retrieved:  # only results that belong to this feed may be dropped by its poller
            feeds = await asyncio.gather(*(self.client.hget(self.keys.job(i), "feed") for i in retrieved))
            mine = [i for i, f in zip(retrieved, feeds) if f is not None and f.decode() == feed]
            if mine:
                await self.client.delete(*(self.keys.result(i) for i in mine))
        if after > 0:
            await self.client.zremrangebyscore(zkey, "-inf", after)

        async def events() -> FeedPage | None:
            rows = await self.client.zrangebyscore(zkey, f"({after}", "+inf", withscores=True)
            if not rows:
                return None
            out = []
            for member, _ in rows:
                kind, size, request_id = member.decode().split("|", 2)
                out.append(Completion(request_id, kind != "f", int(size) if size else None))
            return FeedPage(out, int(rows[-1][1]))

        page = await self._wait(f"f:{feed}", timeout, lambda _: events())
        return page if page is not None else FeedPage([], after)

    async def _wait(self, name: str, timeout: float, check):  # type: ignore[no-untyped-def]
        """Check, then sleep until a push for `name` (or the timeout), check again: never a sleep-poll.
        `check` gets the waiter, which holds the result when the push carried it."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        ev = self._waiters.register(name)
        try:
            await self._waiters.ready(max(0.0, min(timeout, 5.0)))
            while True:
                ev.clear()
                found = await check(ev)
                left = deadline - loop.time()
                if found is not None or left <= 0:
                    return found
                try:
                    async with asyncio.timeout(left):  # unlike wait_for, no task per wait
                        await ev.wait()
                except TimeoutError:
                    return await check(ev)
        finally:
            self._waiters.unregister(name, ev)

    async def cancel(self, job_id: str) -> bool:
        """Cancel a job no worker has read yet; it still reaches one, as a Skip, so its seq_id is not missing."""
        entry, queue, feed = await self.client.hmget(self.keys.job(job_id), "entry", "queue", "feed")
        if entry is None or queue is None:  # unknown, expired, or done
            return False
        k, stream = self.keys, self.keys.stream(queue.decode())
        rows = await self.client.xrange(stream, entry, entry)
        if not rows:  # done and acknowledged
            return False
        skip = as_skip(Job.model_validate_json(rows[0][1][b"job"]))
        cancelled, feed_name = cancelled_result(job_id), (feed or b"").decode()
        err = cancelled.error
        assert err is not None
        code = await self._s["CANCEL"](
            keys=[k.result(job_id), k.job(job_id), stream, k.feed(feed_name), k.feed_seq(feed_name)],
            args=[job_id, entry, skip.model_dump_json(), err.category.value, err.message, self.result_ttl,
                  k.done_channel, feed_name, self.job_ttl, GROUP, self.inline_result_max])
        return int(code) == 1

    # --- registry of served base models (workers write, gateways read) ---
    async def register_served(self, model: ServedModel) -> None:
        await self.client.hset(self.keys.served, model.name, model.model_dump_json())
        await self.client.publish(self.keys.done_channel, "s:served")

    async def follow_served(self, into: dict[str, ServedModel]) -> None:
        """Keep `into` updated with the registry: reload on every registration push (and once a minute)."""
        ev = self._waiters.register("s:served")
        try:
            while True:
                ev.clear()
                await self._waiters.ready(5.0)
                into.update(await self.served_models())
                try:
                    await asyncio.wait_for(ev.wait(), 60.0)
                except asyncio.TimeoutError:
                    pass
        finally:
            self._waiters.unregister("s:served", ev)

    async def served_models(self) -> dict[str, ServedModel]:
        rows = await self.client.hgetall(self.keys.served)
        return {k.decode(): ServedModel.model_validate_json(v) for k, v in rows.items()}

    # --- worker side ---
    def consumer(self, queue_name: str) -> StreamConsumer:
        c = self._consumers.get(queue_name)
        if c is None:
            c = StreamConsumer(self.client, self.keys, queue_name, self.lease_ttl, self.reclaim_idle, self.batch)
            self._consumers[queue_name] = c
        return c

    async def fetch(self, queue_name: str, timeout: float) -> list[Job]:
        c = self.consumer(queue_name)
        if not await c.acquire(timeout):
            return []
        entries = await c.read(timeout, frozenset(e for e, q, _ in self._inflight.values() if q == queue_name))
        if not entries:
            return []
        out = []
        for entry, fields in entries:  # read = started: a cancel now finds the entry pending and refuses
            job_id = fields[b"id"].decode()
            self._inflight[job_id] = (entry, queue_name, fields.get(b"feed", b"").decode())
            try:
                job = Job.model_validate_json(fields[b"job"])
            except ValueError:  # a job this worker's code cannot read (version skew): fail it, do not block the line
                log.exception("job %s in %s cannot be decoded; failing it", job_id, queue_name)
                await self.complete(JobResult(job_id=job_id, error=JobError(
                    category=ErrorCategory.SERVER, message="the worker could not decode this job (version mismatch)")))
                continue
            self._queue_of[job.model_id] = queue_name
            out.append(job)  # a job cancelled before it was read arrives here as its Skip
        return out

    async def complete(self, result: JobResult, job: Job | None = None, replay: bool = False) -> None:
        entry, queue_name, feed = self._inflight.pop(result.job_id, ("", "", ""))
        code = await self._store(result, entry=entry, queue_name=queue_name, feed=feed, job=job, replay=replay)
        if code == -1:
            raise LeaseLost(f"lease of {queue_name} was lost before job {result.job_id} was acknowledged")

    async def _store(self, result: JobResult, *, entry: str = "", queue_name: str = "", feed: str = "",
                     job: Job | None = None, replay: bool = False) -> int:
        k = self.keys
        model_id = job.model_id if job else ""
        token = self.consumer(queue_name).token if entry else ""
        err = result.error
        keys = [k.result(result.job_id), k.job(result.job_id), k.stream(queue_name), k.oplog(model_id),
                k.last_seq(model_id), k.lease(queue_name), k.feed(feed), k.feed_seq(feed)]
        args = [token, result.job_id, entry, result.body, err.category.value if err else "",
                err.message if err else "", self.result_ttl, job.seq_id if job else "",
                job.model_dump_json() if (job and replay) else "", k.done_channel, feed, self.job_ttl, GROUP,
                self.inline_result_max]
        return int(await self._s["COMPLETE"](keys=keys, args=args))

    async def recovery_state(self, model_id: str) -> RecoveryState | None:
        k = self.keys
        async with self.client.pipeline(transaction=True) as pipe:
            pipe.get(k.last_seq(model_id))
            pipe.hmget(k.snapshot(model_id), "seq", "key")
            pipe.zrange(k.oplog(model_id), 0, -1, withscores=True)
            last, (snap_seq, snap_key), ops = await pipe.execute()
        if last is None:
            return None
        after = int(snap_seq) if snap_seq is not None else -1
        jobs = [Job.model_validate_json(m) for m, score in ops if int(score) > after]
        return RecoveryState(
            model_id=model_id, last_seq=int(last), snapshot_seq=None if snap_seq is None else int(snap_seq),
            snapshot_key=snap_key.decode() if snap_key else None, ops=sorted(jobs, key=lambda j: j.seq_id),
        )

    async def record_snapshot(self, model_id: str, seq_id: int, storage_key: str) -> str | None:
        base = self._consumers.get(self._queue_of.get(model_id, ""))
        if base is None or not base.held:
            raise LeaseLost("no lease held: a snapshot may only be recorded by the worker running the model")
        k = self.keys
        code, drop = await self._s["SNAPSHOT"](
            keys=[k.snapshot(model_id), k.oplog(model_id), base.lease_key], args=[base.token, seq_id, storage_key]
        )
        if int(code) == -1:
            raise LeaseLost(f"lease of {base.queue_name} was lost")
        return drop.decode() or None

    async def forget_model(self, model_id: str) -> list[str]:
        base = self._consumers.get(self._queue_of.get(model_id, ""))
        if base is None or not base.held:
            raise LeaseLost("no lease held: a model may only be released by the worker running its queue")
        k = self.keys
        key = await self._s["FORGET"](
            keys=[k.snapshot(model_id), k.oplog(model_id), k.last_seq(model_id), base.lease_key], args=[base.token]
        )
        if key == -1:
            raise LeaseLost(f"lease of {base.queue_name} was lost")
        self._queue_of.pop(model_id, None)
        return [key.decode()] if key else []

    async def health(self) -> Health:
        """A PING, and the worker deployments declared and beating in this Redis (jobqueue/heartbeats.py)."""
        try:
            await self.client.ping()
            deployments = await Heartbeats(self.client, self.keys).status()
        except Exception as e:  # noqa: BLE001 - any failure means not ready; the reason goes in the answer
            return Health(ok=False, detail=f"redis: {type(e).__name__}: {e}"[:300])
        return Health(ok=True, detail="redis", deployments=deployments)

    async def depth(self, queue_names: Sequence[str]) -> dict[str, int]:
        """Entries of each stream no worker has read yet: acknowledged entries are deleted, so that is the
        stream's length less the consumer group's pending (read, still running) entries."""
        out: dict[str, int] = {}
        for name in queue_names:
            stream = self.keys.stream(name)
            length = int(await self.client.xlen(stream))
            pending = 0
            if length:
                try:
                    pending = int((await self.client.xpending(stream, GROUP))["pending"])
                except ResponseError:  # no consumer group yet: no worker ever read this stream
                    pending = 0
            out[name] = max(0, length - pending)
        return out

    async def worker_metrics(self) -> dict[str, bytes]:
        return await read_worker_metrics(self.client, self.keys)

    async def release(self) -> None:
        """Give up every lease now (a clean shutdown), so a successor need not wait for it to expire."""
        for c in self._consumers.values():
            await c.release()

    async def close(self) -> None:
        await asyncio.gather(*self._background, return_exceptions=True)
        await self._waiters.close()
        await self.release()
        await self.client.aclose()
