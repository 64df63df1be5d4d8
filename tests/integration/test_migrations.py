"""Alembic migrations on an empty Postgres database and on SQLite: up, down, up again; the schema they build is
exactly server/db/models.py's (no autogenerate difference), and the app's repositories work on it."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import pytest
from sqlalchemy import inspect
from sqlalchemy.engine import Connection

from server.db.database import Database, normalize_url
from server.db.models import Base

pytest.importorskip("alembic")


def _tables(conn: Connection) -> set[str]:
    return set(inspect(conn).get_table_names()) - {"alembic_version"}


def _diff(conn: Connection) -> list[object]:
    from alembic.autogenerate import compare_metadata
    from alembic.runtime.migration import MigrationContext

    return list(compare_metadata(MigrationContext.configure(conn, opts={"compare_type": True}), Base.metadata))


async def _up_down_up(url: str) -> None:
    from server.db import migrations
    from server.services import tenants

    db = Database(url)
    try:
        async with db.engine.connect() as conn:
            assert await conn.run_sync(_tables) == set()
        assert await db.migrate("upgrade", "head") == migrations.head()
        async with db.engine.connect() as conn:
            assert await conn.run_sync(_tables) == set(Base.metadata.tables)
            assert await conn.run_sync(_diff) == []
        key, _ = await tenants.create_key(db, "acme")  # the repositories work on the migrated schema
        assert key.startswith("tml-") and len(await tenants.list_keys(db)) == 1
        assert await db.migrate("downgrade", "base") is None
        async with db.engine.connect() as conn:
            assert await conn.run_sync(_tables) == set()
        await db.create_schema()  # what the app does at start
        assert await db.migrate("current", "") == migrations.head()
        await db.create_schema()  # idempotent
        assert await tenants.list_keys(db) == []
    finally:
        await db.close()


def test_postgres_up_down_up_matches_models(postgres_url: str) -> None:
    asyncio.run(_up_down_up(postgres_url))


def test_sqlite_up_down_up_matches_models(tmp_path: Path) -> None:
    asyncio.run(_up_down_up(f"sqlite+aiosqlite:///{tmp_path / 'twinkle.db'}"))


def test_database_made_by_create_all_is_adopted(tmp_path: Path) -> None:
    """Pre-migration databases: one with the initial tables only (upgraded from 0001), one with today's tables."""

    async def go() -> None:
        from server.db import migrations

        initial = ("tenants", "api_keys", "sessions", "models", "checkpoints")
        for name, tables in (("old.db", [Base.metadata.tables[t] for t in initial]), ("new.db", None)):
            db = Database(f"sqlite:///{tmp_path / name}")
            async with db.engine.begin() as conn:
                await conn.run_sync(lambda c: Base.metadata.create_all(c, tables=tables))
            await db.create_schema()
            assert await db.migrate("current", "") == migrations.head()
            async with db.engine.connect() as conn:
                assert await conn.run_sync(_tables) == set(Base.metadata.tables)
            await db.close()

    asyncio.run(go())


def test_normalize_url() -> None:
    assert normalize_url("postgresql://u@h:5/d") == "postgresql+asyncpg://u@h:5/d"
    assert normalize_url("postgres://u@h/d") == "postgresql+asyncpg://u@h/d"
    assert normalize_url("postgresql+psycopg://u@h/d") == "postgresql+psycopg://u@h/d"
    assert normalize_url("sqlite:////x/y.db") == "sqlite+aiosqlite:////x/y.db"


def test_cli_migrate_on_postgres(postgres_url: str, tmp_path: Path) -> None:
    plain = postgres_url.replace("postgresql+asyncpg://", "postgresql://")
    base = [sys.executable, "-m", "deploy.cli", "migrate", "--database-url", plain, "--data-dir", str(tmp_path)]
    from server.db import migrations

    newest = migrations.head()
    for args, expect in ((["up"], newest), (["current"], newest), (["down", "--revision", "base"], "base")):
        out = subprocess.run(base + args, capture_output=True, text=True, timeout=120, cwd="/")
        assert out.returncode == 0, out.stderr
        assert expect in out.stdout, out.stdout
