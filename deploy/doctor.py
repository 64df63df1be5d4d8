"""`twinkle-server doctor`: check what a start needs, without starting anything, and say what to fix.

Checks, each `ok`, `warn`, `skip` or `FAIL` with one line: the database (reachable, its schema revision), Redis
(when configured), the tracing collector (when TWINKLE_OTEL_ENDPOINT is set: the `otel` extra, an empty export
answered), Ray (the `--backend ray` extra), every base model's files (workers/engine/model_assets
.inspect_model: nothing is downloaded or converted), free disk for the data dir and the model cache, and whether
the listening port is free. The exit status is 1 when anything failed, else 0.
"""

from __future__ import annotations

import asyncio
import importlib.util
import shutil
import socket
from collections.abc import Callable
from pathlib import Path

from server.config import Settings

Check = tuple[str, str, str]  # (status, what, detail)
GIB = 1024**3


async def _database(settings: Settings) -> Check:
    from server.db import migrations
    from server.db.database import Database

    url = settings.sqlalchemy_url
    shown = url.split("@")[-1] if "@" in url else url  # never print a password
    if settings.database_url is None:
        db_file = settings.data_dir / "twinkle.db"
        if not db_file.exists():
            where = _existing(settings.data_dir)
            if not _writable(where):
                return "fail", "database", f"{where} is not writable: choose --data-dir where this user may write"
            return "ok", "database", f"SQLite {db_file} is created at the first start"
    db = Database(url)
    try:
        revision = await asyncio.wait_for(db.migrate("current", ""), 5)
    except Exception as e:  # noqa: BLE001 - every failure is reported with its reason
        return "fail", "database", f"{shown}: {type(e).__name__}: {str(e)[:200]} -> start the database or fix " \
                                   "TWINKLE_DATABASE_URL"
    finally:
        await db.close()
    head = migrations.head()
    if revision != head:
        return "warn", "database", f"{shown}: schema {revision or 'empty'}, code expects {head} -> the next start " \
                                   "migrates it (or run twinkle-server migrate)"
    return "ok", "database", f"{shown}: schema {revision} (current)"


async def _redis(settings: Settings) -> Check:
    if not settings.redis_url:
        return "skip", "redis", "embedded mode: the in-process queue (set TWINKLE_REDIS_URL for the cluster wiring)"
    if importlib.util.find_spec("redis") is None:
        return "fail", "redis", "the redis package is missing -> pip install 'twinkle-server[cluster]'"
    import redis.asyncio as aioredis

    client = aioredis.Redis.from_url(settings.redis_url, socket_connect_timeout=3, socket_timeout=3)
    shown = settings.redis_url.split("@")[-1]
    try:
        await client.ping()
        version = (await client.info("server")).get("redis_version", "?")
    except Exception as e:  # noqa: BLE001
        return "fail", "redis", f"{shown}: {type(e).__name__}: {str(e)[:200]} -> start Redis or fix TWINKLE_REDIS_URL"
    finally:
        await client.aclose()
    return "ok", "redis", f"{shown}: Redis {version} answers"


async def _tracing(settings: Settings) -> Check:
    """With TWINKLE_OTEL_ENDPOINT: the `otel` extra is installed and the collector answers an empty export."""
    from jobqueue import tracing

    if not settings.otel_endpoint:
        return "skip", "tracing", "off (set TWINKLE_OTEL_ENDPOINT to export traces over OTLP/HTTP)"
    if not tracing.available():
        return "fail", "tracing", tracing.MISSING
    import httpx

    url = tracing.traces_url(settings.otel_endpoint)
    shown = url.split("@")[-1]
    try:
        async with httpx.AsyncClient(timeout=3) as client:
            answer = await client.post(url, content=b"", headers={"Content-Type": "application/x-protobuf"})
    except httpx.HTTPError as e:
        return "fail", "tracing", f"{shown}: {type(e).__name__}: {str(e)[:200]} -> start the collector or fix " \
                                  "TWINKLE_OTEL_ENDPOINT"
    if answer.status_code >= 300:
        return "warn", "tracing", f"{shown} answers {answer.status_code} to an empty export -> is it an OTLP/HTTP " \
                                  "traces endpoint?"
    return "ok", "tracing", f"spans go to {shown}"


def _ray(settings: Settings) -> Check:
    if settings.backend != "ray":
        return "skip", "ray", "not used (--backend embedded)"
    missing = [m for m in ("ray", "ray.serve", "yaml") if importlib.util.find_spec(m.split(".")[0]) is None]
    if missing:
        return "fail", "ray", f"missing {', '.join(missing)} -> pip install 'twinkle-server[cluster,ray]'"
    if not settings.redis_url:
        return "fail", "ray", "the Ray backend needs Redis -> set TWINKLE_REDIS_URL"
    import ray

    return "ok", "ray", f"Ray {ray.__version__} installed"


def _models(settings: Settings) -> list[Check]:
    from workers.engine.model_assets import inspect_model

    out = []
    for name, source in settings.served_models:
        status, detail = inspect_model(source, settings.data_dir, settings.model_cache_dir)
        out.append((status, f"model {name}", detail))
    return out


def _disk(settings: Settings) -> list[Check]:
    out = []
    for what, path, need in (("disk (data dir)", settings.data_dir, 1), ("disk (model cache)",
                                                                          settings.model_cache_dir, 2)):
        where = _existing(path)
        free = shutil.disk_usage(where).free
        detail = f"{free / GIB:.1f} GiB free at {where}"
        if free < need * GIB / 4:
            out.append(("fail", what, f"{detail} -> free some space or choose another place"))
        elif free < need * GIB:
            out.append(("warn", what, f"{detail}; checkpoints and models need more"))
        else:
            out.append(("ok", what, detail))
    return out


def _port(settings: Settings) -> Check:
    family = socket.AF_INET6 if ":" in settings.host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        try:
            s.bind((settings.host, settings.port))
        except OSError as e:
            return "fail", "port", f"{settings.host}:{settings.port} cannot be bound ({e.strerror}) -> another server " \
                                   "is running there, or choose --port"
    return "ok", "port", f"{settings.host}:{settings.port} is free"


def _existing(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _writable(path: Path) -> bool:
    import os

    return os.access(path, os.W_OK)


def run(settings: Settings, echo: Callable[[str], None] = print) -> int:
    async def network() -> list[Check]:
        return [await _database(settings), await _redis(settings), await _tracing(settings)]

    checks = [*asyncio.run(network()), _ray(settings), *_models(settings), *_disk(settings), _port(settings)]
    width = max(len(what) for _, what, _ in checks)
    for status, what, detail in checks:
        echo(f"  {status.upper() if status == 'fail' else status:<5} {what:<{width}}  {detail}")
    failed = sum(status == "fail" for status, _, _ in checks)
    echo(f"{failed} problem(s) to fix" if failed else "everything a start needs is in place")
    return 1 if failed else 0
