"""Typed domain errors; one handler in app.py turns them into JSON responses with a status and a body."""

from __future__ import annotations


class DomainError(Exception):
    status = 500
    category = "server"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


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
