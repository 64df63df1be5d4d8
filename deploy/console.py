"""What `twinkle-server serve` prints for a person: the first API key and the listening URL, each in a box that is
easy to spot among log lines, and the uvicorn server that prints the URL once it listens."""

from __future__ import annotations

import logging
import socket
import sys
from collections.abc import Sequence
from typing import Any

from jobqueue.logs import KeyRedaction
from server.config import Settings


def box(lines: Sequence[str]) -> str:
    width = max(len(line) for line in lines)
    top, bottom = "╭" + "─" * (width + 4) + "╮", "╰" + "─" * (width + 4) + "╯"
    return "\n".join([top, *(f"│  {line.ljust(width)}  │" for line in lines), bottom])


def key_box(tenant: str, key: str) -> str:
    return box([f"First start: tenant '{tenant}' was created with this API key:", "", f"    {key}", "",
                "It is shown only now (only its SHA-256 is stored).",
                "More keys: twinkle-server keys create --tenant NAME"])


def ready_box(url: str, models: Sequence[str]) -> str:
    return box([f"Twinkle server listening on {url}", f"base models: {', '.join(models)}",
                f"Tinker SDK: tinker.ServiceClient(base_url=\"{url}\", api_key=\"tml-...\")",
                f"metrics: {url}/metrics   probes: {url}/healthz, {url}/readyz"])


def _url(settings: Settings, sockets: Sequence[socket.socket] | None) -> str:
    host, port = settings.host, settings.port
    if sockets:
        port = sockets[0].getsockname()[1]  # port 0 asks for any free one
    shown = "127.0.0.1" if host in ("0.0.0.0", "") else f"[{host}]" if ":" in host else host
    return f"http://{shown}:{port}"


def run_gateway(app: Any, settings: Settings) -> None:
    """uvicorn on the settings' host and port, logging through this process's handlers (jobqueue/logs.py), and
    the ready box printed once the socket listens."""
    import uvicorn

    class Server(uvicorn.Server):
        async def startup(self, sockets: list[socket.socket] | None = None) -> None:
            await super().startup(sockets)
            if not self.should_exit:
                bound = [s for server in getattr(self, "servers", []) for s in server.sockets] or sockets
                print("\n" + ready_box(_url(settings, bound), [n for n, _ in settings.served_models]) + "\n",
                      file=sys.stderr, flush=True)

    access = logging.getLogger("uvicorn.access")
    access.setLevel(logging.INFO)  # shown only with --access-log
    if settings.log_format == "text":  # uvicorn's own access line (with the status phrase: "429 Too Many Requests")
        from uvicorn.logging import AccessFormatter

        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(AccessFormatter("%(asctime)s %(levelname)s %(name)s: %(client_addr)s - "
                                             '"%(request_line)s" %(status_code)s', use_colors=False))
        handler.addFilter(KeyRedaction())  # a key in a query string is masked (jobqueue/logs.py)
        access.addHandler(handler)
        access.propagate = False
    config = uvicorn.Config(app, host=settings.host, port=settings.port, log_config=None, log_level=None,
                            access_log=settings.access_log)
    Server(config).run()
