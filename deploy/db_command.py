"""Plumbing shared by the operator commands that only touch SQL (`keys`, `tenants`): open the database, make sure
its schema is current, run one body, report a domain error as a one-line message, close."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Awaitable, Callable

from server.config import Settings
from server.db.database import Database
from server.errors import DomainError


def run_db_command(settings: Settings, body: Callable[[Database], Awaitable[int]]) -> int:
    settings.data_dir.mkdir(parents=True, exist_ok=True)

    async def run() -> int:
        db = Database(settings.sqlalchemy_url)
        await db.create_schema()
        try:
            return await body(db)
        except DomainError as e:
            print(f"error: {e.message}", file=sys.stderr)
            return 1
        finally:
            await db.close()

    return asyncio.run(run())
