"""Typed domain errors; each renders its own JSON answer (status, body, headers) for app.py's handler and the
gate in front of the routes (server/api/gate.py)."""

from __future__ import annotations

import json
import math


class DomainError(Exception):
    status = 500
    category = "server"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def as_json(self) -> tuple[int, bytes, dict[str, str] | None]:
        body = json.dumps({"detail": self.message, "category": self.category}, ensure_ascii=False,
                          separators=(",", ":")).encode()
        return self.status, body, getattr(self, "headers", None)  # e.g. Retry-After on a 429


class BadRequest(DomainError):
    status, category = 400, "user"


class Unauthorized(DomainError):
    status, category = 401, "user"


class NotFound(DomainError):
    status, category = 404, "user"


class Gone(DomainError):
    status, category = 410, "user"


class PayloadTooLarge(DomainError):
    status, category = 413, "user"


class TooManyRequests(DomainError):
    """429 with Retry-After (whole seconds, at least 1): the SDKs wait that long and send the request again."""

    status, category = 429, "rate_limited"

    def __init__(self, message: str, retry_after: float) -> None:
        super().__init__(message)
        self.headers = {"Retry-After": str(max(1, math.ceil(retry_after)))}


class OverLimit(DomainError):
    """The tenant holds as many of something as it may (sessions, models, server-held data, ...)."""

    status, category = 429, "user"
