"""The audit log (SQL `audit_log`, migration 0012): who did what to which tenant's things, and from where.

Recorded: a key's first use on a gateway in each `audit_key_use_seconds` window (not every request: at most one
row per key per window per gateway), key changes (key.create, key.rotate, key.revoke: operator commands) and
destructive actions (checkpoint.delete, checkpoint.publish / checkpoint.unpublish, checkpoint.ttl, hub.push,
hub.auto_push, hub.token.set / hub.token.delete, tenant.quota). A row holds the time, the tenant, the acting key's
id (None: an operator command; never the key), the action, its target (a path or id), the request id of the
JSON logs and the client's address ("cli" for an operator command).

The gate sets `CALLER` when it authenticates a request, so a service records an action with `record(db, ...)`
without threading the request through. Operators read the log with `twinkle-server audit`; no route shows it to
tenants.
"""

from __future__ import annotations

import contextvars
import time
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy.ext.asyncio import AsyncSession

from jobqueue.logs import REQUEST_ID
from server.db import audit_repo
from server.db.database import Database
from server.db.models import AuditRow
from server.db.usage_repo import aware

# (key id, client address) of the request being served; unset outside a request (operator commands, sweeps)
CALLER: contextvars.ContextVar[tuple[int, str | None] | None] = contextvars.ContextVar("twinkle_caller",
                                                                                        default=None)
CLI = "cli"


@dataclass(frozen=True)
class Entry:
    at: datetime
    tenant: str
    tenant_id: str
    key_id: int | None
    action: str
    target: str | None
    request_id: str | None
    client: str | None


def add(s: AsyncSession, tenant_id: str, action: str, target: str | None = None) -> None:
    """Append one row for the request (or operator command) being served, in the caller's transaction."""
    caller = CALLER.get()
    key_id, client = caller if caller is not None else (None, CLI)
    audit_repo.add(s, AuditRow(tenant_id=tenant_id, key_id=key_id, action=action,
                               target=target[:512] if target else None,
                               request_id=REQUEST_ID.get() if caller is not None else None, client=client))


async def record(db: Database, tenant_id: str, action: str, target: str | None = None) -> None:
    """`add` in a transaction of its own."""
    async with db.session() as s:
        add(s, tenant_id, action, target)


class KeyUse:
    """Records a key's first use in each window on this gateway (bounded: the map holds keys seen in a window)."""

    def __init__(self, window_seconds: float, max_keys: int = 100_000) -> None:
        self.window = window_seconds
        self.max_keys = max_keys
        self._seen: dict[int, float] = {}  # key id -> monotonic time of its last recorded use

    def due(self, key_id: int) -> bool:
        """Whether this use starts a new window for the key (then it is marked as recorded)."""
        now = time.monotonic()
        last = self._seen.get(key_id)
        if last is not None and now - last < self.window:
            return False
        if len(self._seen) >= self.max_keys:
            self._seen.clear()
        self._seen[key_id] = now
        return True


async def entries(db: Database, tenant: str | None = None, since: datetime | None = None,
                  action: str | None = None, limit: int = 1000) -> list[Entry]:
    """The newest `limit` rows (oldest first), filtered by tenant name, time and action (a trailing `*` matches
    a prefix: `checkpoint.*`)."""
    async with db.session() as s:
        rows = await audit_repo.newest(s, tenant, since, action, limit)
    return [Entry(aware(r.at), name or "?", r.tenant_id, r.key_id, r.action, r.target, r.request_id, r.client)
            for r, name in reversed(rows)]
