"""`twinkle-server tenants`: show and set tenants' quotas (server/services/tenant_limits.py).

    twinkle-server tenants set-quota NAME [--max-models N] [--max-resident-adapters N]
                                          [--tokens-per-minute N] [--max-concurrent-requests N]
    twinkle-server tenants list
    twinkle-server tenants rotate-key NAME [--grace 1h]

A value of `default` clears the tenant's own limit (the server default, TWINKLE_QUOTA_*, applies again).
A running server applies a change within `quota_cache_seconds`.
`rotate-key` prints a new key once; the tenant's keys in use until now keep working for the grace period (default
1h; 0 ends them now), then answer 401 on every gateway.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from datetime import timedelta

from server.config import Settings

_FIELDS = ("max_models", "max_resident_adapters", "tokens_per_minute", "max_concurrent_requests",
           "requests_per_minute", "request_burst")
_UNSET = object()  # the flag was not given: leave that limit as it is


def _duration(text: str) -> timedelta:
    units = {"d": 86400, "h": 3600, "m": 60, "s": 1}
    if text == "0":
        return timedelta(0)
    if len(text) > 1 and text[-1] in units and text[:-1].isdigit():
        return timedelta(seconds=int(text[:-1]) * units[text[-1]])
    raise argparse.ArgumentTypeError(f"{text!r}: give a duration like 1h, 30m, 90s or 0")


def _limit(value: str) -> int | None:
    if value == "default":
        return None
    n = int(value)
    if n < 0:
        raise argparse.ArgumentTypeError("a limit is a number >= 0 or 'default'")
    return n


def register(sub: argparse._SubParsersAction, common: argparse.ArgumentParser,
             settings_of: Callable[[argparse.Namespace], Settings]) -> None:
    tenants = sub.add_parser("tenants", help="show and set tenants' quotas")
    tsub = tenants.add_subparsers(dest="tenants_cmd", required=True)
    setq = tsub.add_parser("set-quota", parents=[common], help="set (or reset with 'default') a tenant's limits")
    setq.add_argument("tenant")
    for name in _FIELDS:
        setq.add_argument(f"--{name.replace('_', '-')}", dest=f"q_{name}", type=_limit, metavar="N|default",
                          default=_UNSET)
    tsub.add_parser("list", parents=[common], help="every tenant's own limits ('-': the server default)")
    rotate = tsub.add_parser("rotate-key", parents=[common],
                             help="a new key (printed once); the old keys work for the grace period, then 401")
    rotate.add_argument("tenant")
    rotate.add_argument("--grace", type=_duration, default=timedelta(hours=1),
                        help="how long the old keys keep working: 1h (default), 30m, 90s, 0")
    tenants.set_defaults(func=lambda args: _tenants(args, settings_of(args)))


def _tenants(args: argparse.Namespace, settings: Settings) -> int:
    from deploy.db_command import run_db_command
    from server.services import tenant_limits

    async def body(db) -> int:  # type: ignore[no-untyped-def]
        if args.tenants_cmd == "rotate-key":
            return await rotate_key(db, settings, args.tenant, args.grace)
        if args.tenants_cmd == "set-quota":
            given = {n: getattr(args, f"q_{n}") for n in _FIELDS if getattr(args, f"q_{n}") is not _UNSET}
            if not given:
                print("error: give at least one limit, e.g. --tokens-per-minute 100000", file=sys.stderr)
                return 2
            limits = await tenant_limits.set_quota(db, args.tenant, **given)
            print(_row(args.tenant, limits))
        else:
            print(f"{'tenant':<24} " + " ".join(f"{n:>24}" for n in _FIELDS))
            for name, limits in await tenant_limits.list_quotas(db):
                print(_row(name, limits))
        return 0

    return run_db_command(settings, body)


def _row(name: str, limits: object) -> str:
    values = [getattr(limits, n) for n in _FIELDS]
    return f"{name:<24} " + " ".join(f"{'-' if v is None else v:>24}" for v in values)


async def rotate_key(db, settings: Settings, tenant: str, grace: timedelta) -> int:  # type: ignore[no-untyped-def]
    from server.services import tenants

    key, key_id, old = await tenants.rotate_key(db, tenant, grace)
    print(key)
    print(f"key id {key_id} for tenant {tenant!r}; store it now, it is not shown again. Keys "
          f"{', '.join(map(str, old)) or '(none)'} stop working in {grace}", file=sys.stderr)
    return await announced(settings)


async def announced(settings: Settings) -> int:
    """Tell every gateway of the cluster that keys changed (cluster mode); 1 when Redis could not be reached."""
    from server.auth.keys import announce_key_change

    if await announce_key_change(settings.redis_url, settings.redis_prefix, settings.auth_check_seconds):
        return 0
    print(f"warning: Redis unreachable: gateways apply the change within auth_cache_seconds "
          f"({settings.auth_cache_seconds} s)", file=sys.stderr)
    return 1
