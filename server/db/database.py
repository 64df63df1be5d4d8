"""Engine and session factory; one per process, built in the app lifespan or the CLI.

URLs: SQLite (embedded default, `sqlite+aiosqlite:///...`) or Postgres; a plain `postgresql://` or
`postgres://` URL gets the asyncpg driver. The schema comes from the Alembic migrations (server/db/migrations),
applied at start (under a Postgres advisory lock, so gateways starting together do not race) or by
`twinkle-server migrate`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from types import ModuleType

from sqlalchemy import event, inspect, text
from sqlalchemy.engine import Connection
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, AsyncSession, async_sessionmaker, create_async_engine

_MIGRATION_LOCK = 7_241_902_513  # pg_advisory_xact_lock key of schema migrations


def normalize_url(url: str) -> str:
    """Give libpq-style and bare SQLite URLs the async drivers this package uses."""
    for plain in ("postgres://", "postgresql://"):
        if url.startswith(plain):
            return "postgresql+asyncpg://" + url[len(plain):]
    if url.startswith("sqlite://"):
        return "sqlite+aiosqlite://" + url[len("sqlite://"):]
    return url


class Database:
    def __init__(self, url: str) -> None:
        url = normalize_url(url)
        self.url = url
        self.engine: AsyncEngine = create_async_engine(url)
        if url.startswith("sqlite"):
            # WAL lets the CLI (keys create/revoke) write while the server reads.
            @event.listens_for(self.engine.sync_engine, "connect")
            def _pragmas(conn, _record):  # type: ignore[no-untyped-def]
                cur = conn.cursor()
                cur.execute("PRAGMA journal_mode=WAL")
                cur.execute("PRAGMA synchronous=NORMAL")  # with WAL: durable across process crashes, fast commits
                cur.execute("PRAGMA busy_timeout=5000")
                cur.execute("PRAGMA foreign_keys=ON")
                cur.close()

        self._sessions = async_sessionmaker(self.engine, expire_on_commit=False)

    async def create_schema(self) -> None:
        """Bring the schema to the newest migration."""
        await self.migrate("upgrade", "head")

    async def migrate(self, action: str, revision: str) -> str | None:
        """`upgrade` or `downgrade` to `revision` (or just read it: `current`); returns the revision after."""
        async with self.engine.begin() as conn:
            return await conn.run_sync(_migrate, action, revision)

    @asynccontextmanager
    async def session(self) -> AsyncIterator[AsyncSession]:
        async with self._sessions() as s:
            async with s.begin():
                yield s

    @asynccontextmanager
    async def connection(self) -> AsyncIterator[AsyncConnection]:
        """A Core connection in a transaction, for hot statements that need no ORM objects (about a third cheaper
        than a session here)."""
        async with self.engine.begin() as conn:
            yield conn

    async def close(self) -> None:
        await self.engine.dispose()


def _migrate(conn: Connection, action: str, revision: str) -> str | None:
    try:
        from server.db import migrations  # alembic: installed with the `cluster` extra (scripts/install.sh does)
    except ImportError:
        if action != "upgrade":
            raise
        from server.db.models import Base

        Base.metadata.create_all(conn)  # the same tables as the migrations; stamped once alembic is installed
        return None
    if conn.dialect.name == "postgresql":
        conn.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": _MIGRATION_LOCK})
    if action == "upgrade":
        if migrations.current(conn) is None and inspect(conn).has_table("tenants"):
            _adopt(conn, migrations)
        migrations.upgrade(conn, revision)
    elif action == "downgrade":
        migrations.downgrade(conn, revision)
    elif action != "current":
        raise ValueError(f"unknown migration action {action!r}")
    return migrations.current(conn)


def _adopt(conn: Connection, migrations: ModuleType) -> None:
    """A database made by create_all (before migrations, or without alembic installed): stamp the revision its
    tables say it is at, so the upgrade only adds what is missing. All of today's tables: head; else 0001."""
    from server.db.models import Base

    existing = set(inspect(conn).get_table_names())
    migrations.stamp(conn, "head" if set(Base.metadata.tables) <= existing else "0001")
