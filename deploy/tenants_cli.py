"""`twinkle-server tenants`: show and set tenants' quotas (server/services/tenant_limits.py).

    twinkle-server tenants set-quota NAME [--max-models N] [--max-resident-adapters N]
                                          [--tokens-per-minute N] [--max-concurrent-requests N]
    twinkle-server tenants list

A value of `default` clears the tenant's own limit (the server default, TWINKLE_QUOTA_*, applies again).
A running server applies a change within `quota_cache_seconds`.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from server.config import Settings

_FIELDS = ("max_models", "max_resident_adapters", "tokens_per_minute", "max_concurrent_requests")
_UNSET = object()  # the flag was not given: leave that limit as it is


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
    tenants.set_defaults(func=lambda args: _tenants(args, settings_of(args)))


def _tenants(args: argparse.Namespace, settings: Settings) -> int:
    from deploy.db_command import run_db_command
    from server.services import tenant_limits

    async def body(db) -> int:  # type: ignore[no-untyped-def]
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
