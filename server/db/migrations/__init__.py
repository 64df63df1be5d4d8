"""Alembic migrations of the gateway's SQL schema, configured in code (no alembic.ini; works from any cwd).

`twinkle-server migrate` and the app's start-up call these on an open SQLAlchemy connection:
upgrade(conn) brings a database to the newest revision, downgrade(conn, rev) steps back, current(conn) tells
where it is. New revisions: `alembic -c <(python -m server.db.migrations ini) revision --autogenerate -m ...`,
or copy the newest file in versions/ and edit it.
"""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy.engine import Connection

HERE = Path(__file__).resolve().parent


def config(connection: Connection | None = None, url: str | None = None) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(HERE))
    if url is not None:
        cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    cfg.attributes["connection"] = connection
    return cfg


def upgrade(connection: Connection, revision: str = "head") -> None:
    command.upgrade(config(connection), revision)


def downgrade(connection: Connection, revision: str = "-1") -> None:
    command.downgrade(config(connection), revision)


def stamp(connection: Connection, revision: str) -> None:
    command.stamp(config(connection), revision)


def current(connection: Connection) -> str | None:
    return MigrationContext.configure(connection).get_current_revision()


def head() -> str:
    rev = ScriptDirectory.from_config(config()).get_current_head()
    assert rev is not None
    return rev
