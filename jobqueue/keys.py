"""Every Redis key and channel name the queue uses, in one place.

All names start with a configurable prefix, so several deployments (or test runs) can share one Redis.
Keys of one job, model or base model are listed with what they hold and how long they live.
"""

from __future__ import annotations

from dataclasses import dataclass

GROUP = "workers"  # the consumer group of every job stream


@dataclass(frozen=True)
class Keys:
    prefix: str = "twinkle"

    def stream(self, queue_name: str) -> str:
        """Stream of queued jobs of one queue, i.e. one (base model, lane) (fields: id, job, feed). Entries are
        deleted once acknowledged."""
        return f"{self.prefix}:stream:{queue_name}"

    def job(self, job_id: str) -> str:
        """Hash: tenant, kind (its ResultKind), state (queued/done), model, seq, base, feed, entry, queue. Job TTL
        while queued, result TTL once done."""
        return f"{self.prefix}:job:{job_id}"

    def result(self, job_id: str) -> str:
        """Hash: body (the output's JSON, `JobResult.body`; empty for an error), cat, msg, delivered. Expires
        `result_ttl` after completion and again `result_ttl` after its first delivery."""
        return f"{self.prefix}:result:{job_id}"

    def dedup(self, dedup_key: str) -> str:
        """String "job_id|payload fingerprint", set with NX; lives as long as a queued job may."""
        return f"{self.prefix}:dedup:{dedup_key}"

    def feed(self, feed: str) -> str:
        """Sorted set of completion events of one feed (a sampling session), scored by cursor."""
        return f"{self.prefix}:feed:{feed}"

    def feed_seq(self, feed: str) -> str:
        """Counter handing out the feed's cursors."""
        return f"{self.prefix}:feedseq:{feed}"

    def oplog(self, model_id: str) -> str:
        """Sorted set of the acknowledged state-changing jobs of one model after its last snapshot, scored by
        seq_id (member: the job JSON). Replayed on top of the snapshot when a worker rebuilds the model."""
        return f"{self.prefix}:oplog:{model_id}"

    def last_seq(self, model_id: str) -> str:
        """The highest seq_id of the model whose job was executed and acknowledged."""
        return f"{self.prefix}:lastseq:{model_id}"

    def snapshot(self, model_id: str) -> str:
        """Hash: seq, key (checkpoint storage key of the newest durable snapshot of the model's adapter)."""
        return f"{self.prefix}:snapshot:{model_id}"

    def lease(self, queue_name: str) -> str:
        """The token of the one worker process allowed to run (and acknowledge) the jobs of a queue."""
        return f"{self.prefix}:lease:{queue_name}"

    @property
    def served(self) -> str:
        """Hash: base model name -> ServedModel JSON, written by workers, read by gateways."""
        return f"{self.prefix}:served"

    def replicas(self, deployment: str) -> str:
        """Hash: replica id -> heartbeat JSON (pid, node, expiry) of one Ray Serve deployment's live replicas.
        Each replica rewrites its field every few seconds; fields past their expiry are pruned by readers."""
        return f"{self.prefix}:replicas:{deployment}"

    @property
    def deployments(self) -> str:
        """Hash: deployment name -> JSON of what the Ray deployer expects to run (kind, base model, replicas)."""
        return f"{self.prefix}:deployments"

    @property
    def hub_push_stream(self) -> str:
        """Stream of hub push requests (field: id), read by the checkpoint-pusher deployment's consumer group."""
        return f"{self.prefix}:stream:hub-push"

    def hub_push_spec(self, push_id: str) -> str:
        """String: the sealed push spec (it holds the tenant's token); deleted when a pusher takes it."""
        return f"{self.prefix}:hubpush:spec:{push_id}"

    def hub_push_result(self, push_id: str) -> str:
        """List: the push outcome JSON, pushed once by the pusher and popped (BLPOP) by the waiting gateway."""
        return f"{self.prefix}:hubpush:result:{push_id}"

    def hub_push_progress(self, push_id: str) -> str:
        """String: "bytes_done bytes_total" of a running push, set by the pusher about every second (expires)."""
        return f"{self.prefix}:hubpush:progress:{push_id}"

    @property
    def resident_limits(self) -> str:
        """Hash: tenant id -> its adapters-in-memory quota, plus "*" -> the default ("" = unlimited). Rewritten
        whole by the gateways every few seconds, read by the workers (jobqueue/resident_limits.py)."""
        return f"{self.prefix}:quota:resident"

    @property
    def metrics(self) -> str:
        """Hash: worker id -> "<expiry unix time>\n<Prometheus text>" of one worker process's registry, rewritten by
        it every few seconds (jobqueue/metrics_feed.py); the gateways' /metrics read it, expired fields pruned."""
        return f"{self.prefix}:metrics"

    @property
    def done_channel(self) -> str:
        """Pub/sub channel: "j:<job_id>" when a result is stored, "f:<feed>" when a feed gets an event."""
        return f"{self.prefix}:done"

    @property
    def auth_generation(self) -> str:
        """Counter incremented after every API key change (revoke, rotate); a gateway trusts its cached keys only
        while it is unchanged (server/auth/keys.py). Never expires."""
        return f"{self.prefix}:auth:generation"

    def request_bucket(self, tenant_id: str) -> str:
        """Hash: level, at (ms): the tenant's request-rate bucket shared by every gateway (server/auth/rate_limits.py).
        Expires once it would be full again."""
        return f"{self.prefix}:ratelimit:{tenant_id}"
