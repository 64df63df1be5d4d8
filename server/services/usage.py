"""Usage accounting per tenant: tokens trained, forward, sampled and prefilled, stored bytes, adapter-hours.

Tokens are counted by the gateway, where the jobs are made and their results delivered, and kept in memory by
the `UsageMeter` until the maintenance loop (and the app's shutdown) writes them to SQL, one `usage` row per
tenant that used any (server/db/usage_repo.py): a gateway that crashes loses at most one round's counts.
- trained / forward / prefilled: the tokens of each job accepted into the queue (a retried request is one job);
- sampled: the generated tokens of a sample result, the first time this gateway delivers it.
Stored bytes (the ready checkpoints now) and adapter-hours (each training run from its creation until it was
released, or now, within the period) are read from SQL when a report is made, so nothing needs recording.
"""

from __future__ import annotations

import logging
from collections import OrderedDict, defaultdict
from datetime import UTC, datetime, timedelta

from api_schemas.jobs import ForwardBackward, Job, JobResult, Sample, SampleResult
from api_schemas.native.usage import TenantUsage
from server.db import usage_repo
from server.db.database import Database
from server.errors import BadRequest, NotFound

log = logging.getLogger(__name__)

_PENDING_SAMPLES = 100_000  # sample jobs awaiting their first delivery that the meter remembers (oldest go first)


class UsageMeter:
    def __init__(self) -> None:
        self._counts: defaultdict[str, defaultdict[str, int]] = defaultdict(lambda: defaultdict(int))
        self._samples: OrderedDict[str, str] = OrderedDict()  # sample job id -> tenant, until first delivered

    def queued(self, job: Job) -> None:
        """A job was accepted (not a retry of an earlier one)."""
        p = job.payload
        if isinstance(p, ForwardBackward):
            self._counts[job.tenant_id]["tokens_forward" if p.forward_only else "tokens_trained"] += p.tokens
        elif isinstance(p, Sample):
            self._counts[job.tenant_id]["tokens_prefilled"] += len(p.prompt_tokens)
            self._samples[job.job_id] = job.tenant_id
            while len(self._samples) > _PENDING_SAMPLES:
                self._samples.popitem(last=False)

    def delivered(self, job_id: str, result: JobResult) -> None:
        """A result is handed to a client: a sample's generated tokens count, once."""
        tenant = self._samples.pop(job_id, None)
        if tenant is not None and isinstance(result.output, SampleResult):
            self._counts[tenant]["tokens_sampled"] += sum(len(s.tokens) for s in result.output.sequences)

    def take(self) -> dict[str, dict[str, int]]:
        counts, self._counts = self._counts, defaultdict(lambda: defaultdict(int))
        return {t: dict(c) for t, c in counts.items() if any(c.values())}

    async def flush(self, db: Database) -> None:
        """Write what was counted since the last flush (put back if the write fails, for the next round)."""
        counts = self.take()
        if not counts:
            return
        try:
            async with db.session() as s:
                for tenant, tokens in counts.items():
                    usage_repo.add(s, tenant, tokens)
        except Exception:
            for tenant, tokens in counts.items():
                for k, v in tokens.items():
                    self._counts[tenant][k] += v
            raise


async def report(db: Database, tenant: str | None = None, since: datetime | None = None,
                 tenant_id: str | None = None) -> list[TenantUsage]:
    """Usage of every tenant, or of the one named `tenant` (or with id `tenant_id`), since `since` (None: ever)."""
    now = datetime.now(UTC)
    out = []
    async with db.session() as s:
        for row in await usage_repo.tenants(s, tenant, tenant_id):
            tokens = await usage_repo.token_sums(s, row.id, since)
            seconds = 0.0
            for created, released in await usage_repo.adapter_spans(s, row.id, since):
                start = max(created, since) if since is not None else created
                seconds += max(0.0, ((released or now) - start).total_seconds())
            out.append(TenantUsage(tenant=row.name, tenant_id=row.id, since=since, until=now, **tokens,
                                   storage_bytes=await usage_repo.storage_bytes(s, row.id),
                                   adapter_hours=round(seconds / 3600, 6)))
    return out


def parse_since(text: str, now: datetime | None = None) -> datetime:
    """`7d`, `24h`, `30m` (ago) or an ISO 8601 time (UTC unless it says otherwise); ValueError otherwise."""
    now = now or datetime.now(UTC)
    units = {"d": 86400, "h": 3600, "m": 60, "s": 1}
    if text and text[-1] in units and text[:-1].isdigit():
        return now - timedelta(seconds=int(text[:-1]) * units[text[-1]])
    t = datetime.fromisoformat(text)
    return t if t.tzinfo is not None else t.replace(tzinfo=UTC)


async def own_usage(db: Database, tenant_id: str, since: str | None) -> TenantUsage:
    """The calling tenant's own usage (GET /native/v1/usage); a `since` that does not parse is a 400."""
    try:
        start = parse_since(since) if since else None
    except ValueError as e:
        raise BadRequest(f"since: {since!r} is neither an ISO 8601 time nor a duration like 7d, 24h, 30m") from e
    found = await report(db, since=start, tenant_id=tenant_id)
    if not found:
        raise NotFound("tenant not found")
    return found[0]
