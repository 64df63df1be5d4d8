"""Integration fixtures: a real Redis (a test-owned redis-server, or TWINKLE_TEST_REDIS_URL) and a real Postgres
(TWINKLE_TEST_POSTGRES_URL, default the local server) with a fresh database per test, dropped afterwards."""

from __future__ import annotations

import asyncio
import contextlib
import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.redis_server import RedisServer
from tests.support.server import ServerProcess, WorkerProcess

DEFAULT_PG = "postgresql://postgres@127.0.0.1:5432/test"


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    url = os.environ.get("TWINKLE_TEST_REDIS_URL")
    if url:
        yield url
        return
    if not RedisServer.available():
        pytest.skip("no redis-server binary and TWINKLE_TEST_REDIS_URL is not set")
    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield server.url
    server.stop()


@pytest.fixture
def prefix() -> str:
    """A key prefix of its own per test, so tests never see each other's keys."""
    return f"t{uuid.uuid4().hex[:10]}"


async def _pg_admin(url: str, sql: str) -> None:
    import asyncpg

    conn = await asyncpg.connect(url.replace("postgresql+asyncpg://", "postgresql://"), timeout=5)
    try:
        await conn.execute(sql)
    finally:
        await conn.close()


@contextlib.contextmanager
def fresh_database(prefix: str) -> Iterator[str]:
    """A new, empty Postgres database (a postgresql:// URL), dropped afterwards; skips when Postgres is down."""
    admin = os.environ.get("TWINKLE_TEST_POSTGRES_URL", DEFAULT_PG)
    name = f"{prefix}_{uuid.uuid4().hex[:10]}"
    try:
        asyncio.run(_pg_admin(admin, f'CREATE DATABASE "{name}"'))
    except (TimeoutError, OSError) as e:
        pytest.skip(f"Postgres at {admin} is not reachable: {e}")
    try:
        yield f"{admin.rpartition('/')[0]}/{name}"
    finally:
        asyncio.run(_pg_admin(admin, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


@contextlib.contextmanager
def running(gateway: ServerProcess, worker: WorkerProcess) -> Iterator[None]:
    """The worker, then the gateway, started; both stopped afterwards; their logs printed if anything failed."""
    try:
        worker.start()
        gateway.start()
        yield
    except BaseException:
        print(f"--- gateway ---\n{gateway.log()}\n--- worker ---\n{worker.log()}")
        raise
    finally:
        gateway.stop()
        worker.stop()


@pytest.fixture
def postgres_url() -> Iterator[str]:
    """URL of a new, empty Postgres database (asyncpg driver), dropped after the test."""
    pytest.importorskip("asyncpg")
    admin = os.environ.get("TWINKLE_TEST_POSTGRES_URL", DEFAULT_PG)
    name = f"twinkle_test_{uuid.uuid4().hex[:12]}"
    try:
        asyncio.run(_pg_admin(admin, f'CREATE DATABASE "{name}"'))
    except (OSError, asyncio.TimeoutError) as e:
        pytest.skip(f"Postgres at {admin} is not reachable: {e}")
    base, _, _ = admin.rpartition("/")
    yield f"{base}/{name}".replace("postgresql://", "postgresql+asyncpg://", 1)
    asyncio.run(_pg_admin(admin, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


@pytest.fixture
def data_dir(tmp_path: Path) -> Path:
    return tmp_path


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]):  # type: ignore[no-untyped-def]
    outcome = yield
    report = outcome.get_result()
    setattr(item, f"rep_{report.when}", report)
