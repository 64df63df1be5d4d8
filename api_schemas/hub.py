"""The gateway <-> checkpoint-pusher contract: one upload of a checkpoint folder to a model hub repository.

The gateway resolves everything (storage key, endpoint from settings, the tenant's decrypted token) and hands a
frozen spec to the pusher that deploy/ wired in (workers/checkpoints/hub.py, run off the event loop). The token is
a SecretStr, so it never shows in a repr or a log line. The pusher reports the bytes uploaded so far through the
`Progress` callback it is given (the gateway keeps the figure on the push's row, which the client polls).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Literal

from pydantic import BaseModel, ConfigDict, SecretStr

Provider = Literal["huggingface", "modelscope"]


class HubPushSpec(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    provider: Provider
    endpoint: str  # the hub's base URL (operator setting, never client-supplied)
    token: SecretStr
    repo_id: str  # "owner/name"
    private: bool = True
    storage_key: str  # the checkpoint folder in the shared storage
    commit_message: str


class HubPushOutcome(BaseModel):
    model_config = ConfigDict(frozen=True)

    url: str  # where the pushed files can be seen (repo or commit URL)


class HubPushFailed(Exception):
    """The hub refused or the upload broke; the message is safe to show the tenant (it never holds the token)."""


Progress = Callable[[int, int], None]
"""`progress(bytes_done, bytes_total)`: how far an upload is; a pusher may call it from any thread, often."""

HubPusher = Callable[[HubPushSpec, Progress], Awaitable[HubPushOutcome]]
