"""The native upload_to_hub / upload_status: the server's background hub pusher (server/services/hub_push.py) on a
checkpoint the caller owns.

`checkpoint_dir` is a twinkle:// (or tinker://) path, or the SaveResponse object itself; a server directory is never
uploaded. `hub_model_id` names the repository, `ms://` or no scheme for ModelScope (the seed project's hub), `hf://`
for Hugging Face. The hub token is the tenant's stored one; a `hub_token` in the request is stored (encrypted) for
the tenant first, as PUT /native/v1/hub/tokens/{provider} does. Our API key is never sent to a hub. The client
polls upload_status until `completed` or `failed`; every push reaches one of them.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from api_schemas.hub import Provider
from api_schemas.native.hub import REPO_ID_PATTERN, PushRequest
from server.errors import BadRequest
from server.services import checkpoints as ckpt
from server.services import hub_push
from server.services.context import Context

STATUS = {"queued": "queued", "running": "running", "succeeded": "completed", "failed": "failed"}
SCHEMES: dict[str, Provider] = {"ms://": "modelscope", "modelscope://": "modelscope", "hf://": "huggingface"}


def _repo(hub_model_id: object) -> tuple[Provider, str]:
    if not isinstance(hub_model_id, str):
        raise BadRequest("hub_model_id must be a repository id such as 'me/my-adapter' (ms:// or hf:// prefix)")
    provider: Provider = "modelscope"
    for scheme, name in SCHEMES.items():
        if hub_model_id.startswith(scheme):
            provider, hub_model_id = name, hub_model_id[len(scheme):]
    if not re.match(REPO_ID_PATTERN, hub_model_id):
        raise BadRequest(f"hub_model_id {hub_model_id!r} must be <owner>/<name> (letters, digits, . _ -)")
    return provider, hub_model_id


async def upload(ctx: Context, tenant_id: str, body: Mapping[str, Any]) -> dict[str, Any]:
    source = body.get("checkpoint_dir")
    if isinstance(source, Mapping):  # the SaveResponse the client got from save()
        source = source.get("twinkle_path")
    if not isinstance(source, str) or not source.startswith(ckpt.SCHEMES):
        raise BadRequest("checkpoint_dir must be the twinkle:// path of one of your checkpoints "
                         "(server directories are never uploaded)")
    provider, repo_id = _repo(body.get("hub_model_id"))
    await ckpt.readable(ctx, tenant_id, source)  # 404 before anything is stored for a checkpoint not the caller's
    token = body.get("hub_token")
    if token is not None:
        if not isinstance(token, str) or not 0 < len(token) <= 1024:
            raise BadRequest("hub_token must be a non-empty string")
        await hub_push.set_token(ctx, tenant_id, provider, token)
    status = await hub_push.start_push(ctx, tenant_id, PushRequest(tinker_path=source, provider=provider,
                                                                   repo_id=repo_id, private=True))
    return {"request_id": status.push_id}


async def status(ctx: Context, tenant_id: str, request_id: str) -> dict[str, Any]:
    push = await hub_push.get_push(ctx, tenant_id, request_id)
    return {"request_id": push.push_id, "status": STATUS[push.status], "error": push.error}
