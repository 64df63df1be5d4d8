"""Hard caps on what one tenant holds at once (settings `max_sessions_per_tenant`, `max_models_per_tenant`,
`max_sampling_sessions_per_tenant`): checked when one is created, before any row is written or job queued.

Only live ones count: a session that finished or sent no heartbeat within `session_timeout_seconds`, and the models
and sampling sessions in it, no longer do. Over a cap the create answers 429 (`OverLimit`) naming the setting; the
models *quota* (`quota_max_models`, server/services/quotas.py) is another thing: it holds a create until a run ends.
Creates that race may pass a cap by their number (the count and the insert are not one transaction).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from datetime import datetime, timedelta
from typing import Literal

from sqlalchemy.ext.asyncio import AsyncSession

from server.db import quota_repo
from server.db.models import utcnow
from server.errors import OverLimit
from server.services.context import Context

What = Literal["sessions", "models", "sampling_sessions"]
_COUNT: dict[What, Callable[[AsyncSession, str, datetime], Awaitable[int]]] = {
    "sessions": quota_repo.live_sessions,
    "models": quota_repo.live_models,
    "sampling_sessions": quota_repo.live_sampling_sessions,
}


async def check_room(ctx: Context, tenant_id: str, what: What) -> None:
    """OverLimit when the tenant already holds its cap of live `what`."""
    setting = f"max_{what}_per_tenant"
    cap: int = getattr(ctx.settings, setting)
    after = utcnow() - timedelta(seconds=ctx.settings.session_timeout_seconds)
    async with ctx.db.session() as s:
        held = await _COUNT[what](s, tenant_id, after)
    if held >= cap:
        label = what.replace("_", " ")
        raise OverLimit(f"this tenant holds {held} live {label}; the limit is {cap} ({setting}): finish a session "
                        "(its models and sampling sessions end with it) or let one time out")
