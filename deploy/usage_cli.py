"""`twinkle-server usage [--tenant NAME] [--since 7d|ISO time] [--json]`: tenants' usage from SQL
(server/services/usage.py): tokens trained, forward, sampled and prefilled, stored bytes, adapter-hours.
A running server writes its token counts every maintenance round (TWINKLE_MAINTENANCE_INTERVAL_SECONDS)."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from datetime import datetime

from server.config import Settings

_COLUMNS = ("tokens_trained", "tokens_forward", "tokens_sampled", "tokens_prefilled", "storage_bytes",
            "adapter_hours")


def since_argument(text: str) -> datetime:
    """--since of `usage` and `audit`: an ISO 8601 time or a duration ago (7d, 24h, 30m)."""
    from server.services.usage import parse_since

    try:
        return parse_since(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give an ISO 8601 time or a duration like 7d, 24h, 30m") from None


def register(sub: argparse._SubParsersAction, common: argparse.ArgumentParser,
             settings_of: Callable[[argparse.Namespace], Settings]) -> None:
    usage = sub.add_parser("usage", parents=[common], help="tenants' usage: tokens, stored bytes, adapter-hours")
    usage.add_argument("--tenant", help="only this tenant (by name)")
    usage.add_argument("--since", type=since_argument, help="from this ISO 8601 time, or this long ago (7d, 24h, 30m)")
    usage.add_argument("--json", action="store_true", help="one JSON object per tenant")
    usage.set_defaults(func=lambda args: _usage(args, settings_of(args)))


def _usage(args: argparse.Namespace, settings: Settings) -> int:
    from deploy.db_command import run_db_command
    from server.services.usage import report

    async def body(db) -> int:  # type: ignore[no-untyped-def]
        rows = await report(db, args.tenant, args.since)
        if args.tenant is not None and not rows:
            print(f"error: no tenant named {args.tenant!r}", file=sys.stderr)
            return 1
        if args.json:
            for r in rows:
                print(json.dumps(r.model_dump(mode="json")))
            return 0
        print(f"{'tenant':<24} {'id (metrics label)':<36} " + " ".join(f"{c:>16}" for c in _COLUMNS))
        for r in rows:
            values = [f"{getattr(r, c):>16.3f}" if c == "adapter_hours" else f"{getattr(r, c):>16}" for c in _COLUMNS]
            print(f"{r.tenant:<24} {r.tenant_id:<36} " + " ".join(values))
        return 0

    return run_db_command(settings, body)
