"""`twinkle-server audit [--tenant NAME] [--since 7d|ISO time] [--action A] [--limit N] [--json]`: the audit log
(server/services/audit.py): key use, key changes and destructive actions, oldest first. `--action` takes an
action (`checkpoint.delete`) or a prefix ending in `*` (`key.*`)."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from dataclasses import asdict

from deploy.usage_cli import since_argument
from server.config import Settings


def register(sub: argparse._SubParsersAction, common: argparse.ArgumentParser,
             settings_of: Callable[[argparse.Namespace], Settings]) -> None:
    audit = sub.add_parser("audit", parents=[common], help="the audit log: key use, key changes, deletes, publishes")
    audit.add_argument("--tenant", help="only this tenant (by name)")
    audit.add_argument("--since", type=since_argument, help="from this ISO 8601 time, or this long ago (7d, 24h, 30m)")
    audit.add_argument("--action", help="only this action, or a prefix ending in * (key.*)")
    audit.add_argument("--limit", type=int, default=1000, help="the newest N rows (default 1000)")
    audit.add_argument("--json", action="store_true", help="one JSON object per row")
    audit.set_defaults(func=lambda args: _audit(args, settings_of(args)))


def _audit(args: argparse.Namespace, settings: Settings) -> int:
    from deploy.db_command import run_db_command
    from server.services.audit import entries

    async def body(db) -> int:  # type: ignore[no-untyped-def]
        rows = await entries(db, args.tenant, args.since, args.action, max(1, args.limit))
        if args.json:
            for r in rows:
                print(json.dumps({**asdict(r), "at": r.at.isoformat()}))
            return 0
        print(f"{'time':<32} {'tenant':<20} {'key':>5} {'action':<20} {'request id':<24} {'client':<16} target")
        for r in rows:
            key = "-" if r.key_id is None else str(r.key_id)
            print(f"{r.at.isoformat():<32} {r.tenant:<20} {key:>5} {r.action:<20} {r.request_id or '-':<24} "
                  f"{r.client or '-':<16} {r.target or ''}")
        return 0

    return run_db_command(settings, body)
