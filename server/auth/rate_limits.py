"""Per-tenant rate-limit arithmetic, pure (time is passed in): a tokens-per-minute bucket.

The bucket holds at most one minute of tokens and refills continuously. A request may take its tokens when the
bucket holds them; a request larger than a whole minute may go once the bucket is full and leaves it in debt, so
nothing is ever too big to run, only delayed.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class TokenBucket:
    per_minute: float
    level: float
    updated: float  # the time `level` was computed at

    @classmethod
    def full(cls, per_minute: float, now: float) -> TokenBucket:
        return cls(per_minute, per_minute, now)

    @property
    def rate(self) -> float:
        return self.per_minute / 60.0

    def _refill(self, now: float) -> None:
        if now > self.updated:
            self.level = min(self.per_minute, self.level + (now - self.updated) * self.rate)
            self.updated = now

    def wait(self, tokens: float, now: float) -> float:
        """Seconds until `tokens` may be taken (0: now)."""
        self._refill(now)
        need = min(tokens, self.per_minute)  # more than a minute's worth: wait for a full bucket, go into debt
        return 0.0 if self.level >= need else (need - self.level) / self.rate

    def take(self, tokens: float, now: float) -> None:
        self._refill(now)
        self.level -= tokens

    def resize(self, per_minute: float, now: float) -> None:
        """Apply a changed quota; the tokens already used stay used."""
        self._refill(now)
        self.level = min(self.level, per_minute)
        self.per_minute = per_minute
