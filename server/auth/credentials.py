"""A request's API key -> its tenant: the one authentication of every route (FastAPI's and the fast path's).

A route family accepts the key in a fixed list of headers (`KeyHeaders`): the Tinker routes in `X-API-Key`, or
`Authorization` / `Twinkle-Authorization: Bearer tml-...` (what twinkle-kit's `init_tinker_client()` adds to older
SDKs), the OpenAI routes in `Authorization: Bearer tml-...` or `X-API-Key`. Headers are the ASGI scope's raw pairs, so the
per-step fast path (server/api/gate.py) and FastAPI's dependency (server/api/deps.py) read them the same way.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from starlette.types import Scope

from server.auth.keys import KeyCache, SessionFactory, hash_key
from server.db import repositories as repo
from server.db.database import Database
from server.errors import Unauthorized
from server.services import audit

# Headers whose value is `Bearer <key>`; another value in them is no key (a later accepted header may hold one).
_BEARER = frozenset({b"authorization", b"twinkle-authorization"})


@dataclass(frozen=True)
class KeyHeaders:
    """The headers a route accepts the key in, first match wins; `missing` is the 401's detail without one."""

    names: tuple[bytes, ...]  # lower case, as in an ASGI scope
    missing: str


TINKER_KEY = KeyHeaders((b"x-api-key", b"authorization", b"twinkle-authorization"), "missing X-API-Key header")
OPENAI_KEY = KeyHeaders((b"authorization", b"x-api-key"),
                        "missing API key: send Authorization: Bearer tml-... (or X-API-Key)")


def api_key(headers: Sequence[tuple[bytes, bytes]], accepted: KeyHeaders) -> str | None:
    """The key a request carries in the accepted headers ("" when the winning header is empty), else None."""
    for name in accepted.names:
        for k, given in headers:  # the first of repeated headers, as Starlette reads them
            if k == name:
                break
        else:
            continue
        value = given.decode("latin-1")
        if name not in _BEARER:
            return value
        if value.lower().startswith("bearer "):
            return value[len("bearer "):].strip()
    return None


async def authenticate(cache: KeyCache, db: Database, scope: Scope, accepted: KeyHeaders) -> str:
    """The tenant of the request's key, or Unauthorized (401) for a missing, unknown, revoked or expired one.
    Leaves the caller (key id, client address) in audit.CALLER and records the key's first use in a window."""
    key = api_key(scope["headers"], accepted)
    if not key:
        raise Unauthorized(accepted.missing)
    caller = await cache.caller(db.session, key)
    if caller is None:
        raise Unauthorized("invalid or revoked API key")
    client = scope.get("client")
    audit.CALLER.set((caller.key_id, client[0] if client else None))
    if cache.uses is not None and cache.uses.due(caller.key_id):
        await audit.record(db, caller.tenant_id, "key.use", f"key {caller.key_id}")
    return caller.tenant_id


async def is_operator(sessions: SessionFactory, headers: Sequence[tuple[bytes, bytes]], accepted: KeyHeaders) -> bool:
    """Whether the request's key (already authenticated) is an operator's (`keys create --admin`). Read from SQL on
    each call, not cached: only the dashboard asks, and a revoked operator key loses its view at once."""
    key = api_key(headers, accepted)
    if not key:
        return False
    async with sessions() as s:
        row = await repo.active_key_by_hash(s, hash_key(key))
    return row is not None and row.admin
