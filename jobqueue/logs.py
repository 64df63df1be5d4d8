"""Logging of every process (gateway, worker, Ray replica): a quiet default, opt-in JSON lines, and the request id
that follows a request from the gateway into the worker that runs its job.

`configure` is called once per process by the CLI. Below DEBUG, libraries' INFO chatter (Alembic's migration
context, httpx, uvicorn's start-up lines, Ray, transformers) is off, so a start shows the key box and the URL.
`log_format="json"` writes one JSON object per line (`ts`, `level`, `logger`, `msg`, `request_id` when known,
`exc` for a traceback). The request id is a context variable: the gateway's HTTP middleware sets it for each
request (the client's `X-Request-Id` when it is a plain token, else a new one), the job builder copies it into
the Job (`Job.request_id`), and the worker sets it again while it runs that job. Messages never carry API keys
(nothing here logs headers or bodies, and `KeyRedaction` masks a key-shaped string anywhere in a message).
"""

from __future__ import annotations

import contextvars
import itertools
import json
import logging
import re
import sys
import time
import uuid
from typing import Literal

REQUEST_ID: contextvars.ContextVar[str | None] = contextvars.ContextVar("twinkle_request_id", default=None)

# loggers that talk at INFO about things an operator does not need on every start
NOISY = ("alembic", "httpx", "httpcore", "uvicorn", "uvicorn.error", "asyncio", "filelock", "urllib3",
         "huggingface_hub", "transformers", "ray", "ray.serve", "multipart")
# loggers whose DEBUG lines hold SQL parameters (a key's hash and prefix, hub token ciphertexts): never below WARNING
SECRETIVE = ("aiosqlite", "sqlalchemy", "asyncpg", "psycopg")

_TOKEN = re.compile(r"[A-Za-z0-9._:-]{1,64}")

LogFormat = Literal["text", "json"]


_PROCESS = uuid.uuid4().hex[:12]  # fresh ids: this process's random prefix and a counter (cheaper than a uuid each)
_NEXT = itertools.count(1)


def request_id_from(header: bytes | None) -> str:
    """The client's request id when it is a plain token (bounded, no spaces or quotes), else a fresh one."""
    if header:
        text = header.decode("latin-1")
        if _TOKEN.fullmatch(text):
            return text
    return f"{_PROCESS}{next(_NEXT):08x}"


_KEY = re.compile(r"tml-[A-Za-z0-9_-]{6,}")  # an API key's shape (server/auth/keys.py)


class KeyRedaction(logging.Filter):
    """Masks anything shaped like an API key in a record's message: a key a client put where none belongs (a
    query string in uvicorn's access line, a path, a body echoed in an error) never reaches the log."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.msg, str) and "tml-" in record.msg:
            record.msg = _redact(record.msg)
        if isinstance(record.args, tuple):  # kept a tuple: uvicorn's access formatter reads its fields
            record.args = tuple(_redact(str(a)) if "tml-" in str(a) else a for a in record.args)
        return True


def _redact(text: str) -> str:
    return _KEY.sub("tml-[redacted]", text)


class _RequestIdFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if not hasattr(record, "request_id"):
            record.request_id = REQUEST_ID.get()
        return True


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, object] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(), "logger": record.name, "msg": record.getMessage(),
        }
        rid = getattr(record, "request_id", None)
        if rid:
            out["request_id"] = rid
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False)


def configure(level: str = "INFO", log_format: LogFormat = "text") -> None:
    """The process's root handler (stderr) at `level`; libraries' INFO off unless the level is DEBUG."""
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(_RequestIdFilter())
    handler.addFilter(KeyRedaction())
    if log_format == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
    debug = logging.getLevelName(level.upper()) == logging.DEBUG
    for name in NOISY:
        logging.getLogger(name).setLevel(logging.NOTSET if debug else logging.WARNING)
    for name in SECRETIVE:
        logging.getLogger(name).setLevel(logging.WARNING)
