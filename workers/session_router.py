"""Ray Serve request router that keeps a sampling session on one sampler replica (rendezvous hashing).

The sample-lane consumer (workers/deployments.SampleRouter) calls the sampler deployment with the sampling session
id as the request's `multiplexed_model_id`. Each replica gets the score hash(session, replica id); replicas are
tried from the highest score down, so a session always lands on the same live replica (its loaded adapters and
caches are reused) and, when replicas come or go, only the sessions of those replicas move. A full replica is
skipped for the next one rather than waited on. Requests without a session go to a random replica.
"""

from __future__ import annotations

import hashlib
import random

from ray.serve.request_router import FIFOMixin, PendingRequest, RequestRouter, RunningReplica


def rank_replicas(key: str, replica_ids: list[str]) -> list[str]:
    """Replica ids from most to least preferred for `key` (highest random weight first)."""
    return sorted(replica_ids, key=lambda r: hashlib.sha256(f"{key}|{r}".encode()).digest(), reverse=True)


class SessionAffinityRouter(FIFOMixin, RequestRouter):
    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        key = pending_request.metadata.multiplexed_model_id if pending_request is not None else ""
        if not key:
            return [random.sample(candidate_replicas, min(2, len(candidate_replicas)))]
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        return [[by_id[i]] for i in rank_replicas(key, list(by_id))]
