"""`twinkle-server`: serve, worker (cluster wiring), migrate (SQL schema), manage tenants' API keys and quotas,
report usage, doctor (check what a start needs)."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from collections.abc import Callable
from typing import Any, TypeVar

from deploy import audit_cli, tenants_cli, usage_cli
from deploy.console import key_box, run_gateway
from jobqueue import logs, tracing
from server.config import Settings

T = TypeVar("T")


def _settings(args: argparse.Namespace) -> Settings:
    overrides: dict[str, Any] = {
        k: v for k, v in vars(args).items() if v is not None and k in Settings.model_fields
    }
    return Settings(**overrides)


def _serve(args: argparse.Namespace) -> int:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    settings = _settings(args)
    logs.configure(settings.log_level, settings.log_format)
    if not _tracing_ready(settings):
        return 2
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    if settings.backend == "ray":  # deploy the workers on Ray, then run the gateway here
        return _serve_ray(args, settings)
    asyncio.run(_first_key(settings))
    if settings.redis_url:  # cluster wiring: Redis queue, workers in their own processes unless asked
        from deploy.cluster import build_gateway_app

        app = _built(lambda: build_gateway_app(settings))
    else:
        from deploy.embedded import build_embedded_app

        app = _built(lambda: build_embedded_app(settings))
    if app is None:
        return 2
    run_gateway(app, settings)
    return 0


def _serve_ray(args: argparse.Namespace, settings: Settings) -> int:
    from deploy.ray_config import DEFAULT_CONFIG, ConfigError, load_config

    try:
        config = load_config(args.config or DEFAULT_CONFIG)  # an invalid config fails before anything starts
        from deploy.ray_app import serve_ray
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except ImportError as e:
        print(f"error: the Ray backend needs the ray extra (pip install 'twinkle-server[ray]'): {e}", file=sys.stderr)
        return 2
    if not settings.redis_url:
        print("error: the Ray backend needs TWINKLE_REDIS_URL or --redis-url", file=sys.stderr)
        return 2
    asyncio.run(_first_key(settings))
    return serve_ray(settings, config, args.ray_address, deploy_app=not args.no_deploy)


def _tracing_ready(settings: Settings) -> bool:
    """TWINKLE_OTEL_ENDPOINT needs the `otel` extra: without it, say so before anything starts."""
    if settings.otel_endpoint and not tracing.available():
        print(f"error: TWINKLE_OTEL_ENDPOINT is set but {tracing.MISSING}", file=sys.stderr)
        return False
    return True


async def _first_key(settings: Settings) -> None:
    """On a fresh data dir, make one key so a laptop user can start at once (printed once, stored hashed)."""
    from server.db.database import Database
    from server.services import tenants

    db = Database(settings.sqlalchemy_url)
    try:
        await db.create_schema()
        if not await tenants.list_keys(db):
            key, _ = await tenants.create_key(db, "default")
            print("\n" + key_box("default", key) + "\n", file=sys.stderr, flush=True)
    finally:
        await db.close()


def _worker(args: argparse.Namespace) -> int:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    settings = _settings(args)
    logs.configure(settings.log_level, settings.log_format)
    if not settings.redis_url:
        print("error: the worker needs TWINKLE_REDIS_URL or --redis-url", file=sys.stderr)
        return 2
    if not _tracing_ready(settings):
        return 2
    from deploy.worker import LANES
    from deploy.worker import main as worker_main

    lanes = tuple(x.strip() for x in (args.lanes or ",".join(LANES)).split(",") if x.strip())
    if not lanes or set(lanes) - set(LANES):
        print(f"error: --lanes takes a comma-separated subset of {','.join(LANES)}", file=sys.stderr)
        return 2
    code = _built(lambda: worker_main(settings, lanes))
    return 2 if code is None else code


def _doctor(args: argparse.Namespace) -> int:
    from deploy.doctor import run

    return run(_settings(args))


def _migrate(args: argparse.Namespace) -> int:
    from server.db.database import Database

    settings = _settings(args)
    if settings.database_url is None:
        settings.data_dir.mkdir(parents=True, exist_ok=True)
    action = {"up": "upgrade", "down": "downgrade", "current": "current"}[args.action]
    revision = args.revision or {"up": "head", "down": "-1", "current": ""}[args.action]

    async def run() -> str | None:
        db = Database(settings.sqlalchemy_url)
        try:
            return await db.migrate(action, revision)
        finally:
            await db.close()

    print(f"schema revision: {asyncio.run(run()) or 'base'}")
    return 0


def _keys(args: argparse.Namespace) -> int:
    from deploy.db_command import run_db_command
    from server.services import tenants

    async def body(db) -> int:  # type: ignore[no-untyped-def]
        if args.keys_cmd == "create":
            key, key_id = await tenants.create_key(db, args.tenant, admin=args.admin)
            print(key)
            print(f"key id {key_id} for tenant {args.tenant!r}; store it now, it is not shown again", file=sys.stderr)
        elif args.keys_cmd == "list":
            print(f"{'id':>4}  {'tenant':<24} {'prefix':<12} {'admin':<6} {'created':<26} {'revoked':<26} expires")
            for k in await tenants.list_keys(db):
                print(f"{k.key_id:>4}  {k.tenant:<24} {k.prefix:<12} {'yes' if k.admin else '-':<6} "
                      f"{k.created_at.isoformat():<26} {str(k.revoked_at or '-'):<26} {k.expires_at or '-'}")
        elif args.keys_cmd == "revoke":
            await tenants.revoke(db, args.key_id)
            print(f"revoked key {args.key_id}", file=sys.stderr)
            return await tenants_cli.announced(settings)
        return 0

    settings = _settings(args)
    return run_db_command(settings, body)


def _model_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-model", dest="base_model", action="append",
                        help="HF/ModelScope id or a local HF folder; repeat it to serve several base models")
    parser.add_argument("--served-model-name", dest="served_model_name", action="append",
                        help="the name clients use for the base model of the same position (default: its source)")
    parser.add_argument("--skip-failed-models", dest="skip_failed_models", action="store_const", const=True,
                        help="start without a base model that fails to load (reported by /readyz)")
    parser.add_argument("--memory-budget-bytes", dest="memory_budget_bytes", type=int,
                        help="memory the base models and full-parameter copies may take (default: what is free)")


def _built(build: Callable[[], T]) -> T | None:
    """The app (or runtime) `build` makes, or None after printing why a base model could not be loaded."""
    from workers.runtime import ModelLoadError

    try:
        return build()
    except ModelLoadError as e:
        print(f"error: {e}", file=sys.stderr)
        return None


def main(argv: list[str] | None = None) -> int:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--data-dir", dest="data_dir", help="where the database, models and checkpoints live")
    common.add_argument("--database-url", dest="database_url", help="SQLAlchemy URL (default: SQLite in data dir)")
    common.add_argument("--model-cache-dir", dest="model_cache_dir",
                        help="converted models, shared by data dirs (default: ~/.cache/twinkle-server/models)")
    parser = argparse.ArgumentParser(prog="twinkle-server", description=__doc__)
    sub = parser.add_subparsers(dest="cmd", required=True)

    serve = sub.add_parser("serve", parents=[common], help="run the server (embedded mode by default)")
    serve.add_argument("--host")
    serve.add_argument("--port", type=int)
    _model_arguments(serve)
    serve.add_argument("--dtype", choices=["float32", "bfloat16", "float16", "float64"])
    serve.add_argument("--device")
    serve.add_argument("--sampler", choices=["torch", "vllm"], help="sampler backend (default torch)")
    serve.add_argument("--log-level", dest="log_level", help="INFO by default; debug also shows libraries' logs")
    serve.add_argument("--log-format", dest="log_format", choices=["text", "json"],
                       help="json: one JSON object per line, with the request id (TWINKLE_LOG_FORMAT)")
    serve.add_argument("--access-log", dest="access_log", action="store_const", const=True,
                       help="log one line per HTTP request (TWINKLE_ACCESS_LOG; default off)")
    serve.add_argument("--redis-url", dest="redis_url", help="use the Redis queue (cluster wiring)")
    serve.add_argument("--with-worker", dest="gateway_runs_worker", action="store_const", const=True,
                       help="with Redis: also run the base model's trainer in this process")
    serve.add_argument("--backend", choices=["embedded", "ray"],
                       help="ray: run the workers as Ray Serve deployments (needs --redis-url and the ray extra)")
    serve.add_argument("--ray-address", dest="ray_address", help="join this Ray cluster (default: start one)")
    serve.add_argument("--config", help="Ray application config YAML (default: deploy/ray-app.yaml)")
    serve.add_argument("--no-deploy", dest="no_deploy", action="store_true",
                       help="with --backend ray: the application is deployed elsewhere (KubeRay); run the gateway only")
    serve.set_defaults(func=_serve)

    worker = sub.add_parser("worker", parents=[common], help="run one base model's training worker on Redis")
    _model_arguments(worker)
    worker.add_argument("--dtype", choices=["float32", "bfloat16", "float16", "float64"])
    worker.add_argument("--device")
    worker.add_argument("--redis-url", dest="redis_url")
    worker.add_argument("--lanes", help="which queues to serve: train,sample (default both)")
    worker.add_argument("--sampler", choices=["torch", "vllm"], help="sampler backend (default torch)")
    worker.add_argument("--log-level", dest="log_level")
    worker.add_argument("--log-format", dest="log_format", choices=["text", "json"])
    worker.set_defaults(func=_worker)

    doctor = sub.add_parser("doctor", parents=[common], help="check the database, Redis, Ray, models, disk and port")
    doctor.add_argument("--host")
    doctor.add_argument("--port", type=int)
    _model_arguments(doctor)
    doctor.add_argument("--redis-url", dest="redis_url")
    doctor.add_argument("--backend", choices=["embedded", "ray"])
    doctor.set_defaults(func=_doctor)

    migrate = sub.add_parser("migrate", parents=[common], help="apply (or revert) the SQL schema migrations")
    migrate.add_argument("action", nargs="?", choices=["up", "down", "current"], default="up")
    migrate.add_argument("--revision", help="target revision (default: head for up, -1 for down)")
    migrate.set_defaults(func=_migrate)

    keys = sub.add_parser("keys", help="manage tenants' API keys")
    keys_sub = keys.add_subparsers(dest="keys_cmd", required=True)
    create = keys_sub.add_parser("create", parents=[common], help="create a key (and the tenant if new); prints the key once")
    create.add_argument("--tenant", required=True)
    create.add_argument("--admin", action="store_true",
                        help="an operator's key: the web dashboard (/dashboard) shows it every tenant")
    keys_sub.add_parser("list", parents=[common], help="list keys (prefixes only)")
    revoke = keys_sub.add_parser("revoke", parents=[common], help="revoke a key by id")
    revoke.add_argument("key_id", type=int)
    keys.set_defaults(func=_keys)
    tenants_cli.register(sub, common, _settings)  # `tenants set-quota` / `tenants list`
    usage_cli.register(sub, common, _settings)  # `usage [--tenant T] [--since ...]`
    audit_cli.register(sub, common, _settings)  # `audit [--tenant T] [--since ...] [--action A]`

    args = parser.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    raise SystemExit(main())
