"""Hub push: upload a checkpoint to the Hugging Face Hub or ModelScope (private by default) in the background.

Tokens are per tenant, stored encrypted (server/services/secrets.py) and never returned or logged. A push is a row
the client polls (queued -> running -> succeeded | failed, with the error); the upload itself runs in the pusher
deploy/ wired in (workers/checkpoints/hub.py on a thread pool), so the event loop never waits on the network.
While it runs, the row carries its progress (`bytes_done` of `bytes_total`), written at most every
`PROGRESS_WRITE_SECONDS`, so any gateway answering the client's poll shows it.
A run with an auto-push setting is pushed once its session has finished and its saves have settled.
"""

from __future__ import annotations

import asyncio
import logging
import uuid

from api_schemas.hub import HubPushFailed, HubPushOutcome, HubPushSpec, Provider
from api_schemas.native.hub import AutoPushRequest, AutoPushStatus, HubTokenStatus, PushRequest, PushStatus
from server.db import lifecycle_repo as lrepo
from server.db import repositories as repo
from server.db.models import AutoPushRow, HubPushRow, HubTokenRow, utcnow
from server.errors import BadRequest, DomainError, NotFound
from server.services import audit
from server.services import checkpoints as ckpt
from server.services.context import Context
from server.services.downloads import keyring

log = logging.getLogger(__name__)
_running: set[asyncio.Task[None]] = set()  # strong references: a task nobody holds may be collected mid-push
_PREFERENCE = ("sampler_weights", "external_weights", "weights")  # what an auto-push uploads, first found
PROGRESS_WRITE_SECONDS = 2.0


class HubUnavailable(DomainError):
    status, category = 503, "server"


def _token_context(tenant_id: str, provider: str) -> str:
    """What a stored token is bound to: its ciphertext opens only on its own row."""
    return f"hub-token/{tenant_id}/{provider}"


async def set_token(ctx: Context, tenant_id: str, provider: Provider, token: str) -> HubTokenStatus:
    sealed = keyring(ctx).encrypt(token, _token_context(tenant_id, provider))
    async with ctx.db.session() as s:
        row = await lrepo.hub_token(s, tenant_id, provider)
        if row is None:
            row = HubTokenRow(tenant_id=tenant_id, provider=provider, ciphertext=sealed)
            s.add(row)
        row.ciphertext, row.created_at = sealed, utcnow()
        audit.add(s, tenant_id, "hub.token.set", provider)
    return HubTokenStatus(provider=provider, configured=True, updated_at=row.created_at)


async def token_status(ctx: Context, tenant_id: str, provider: Provider) -> HubTokenStatus:
    async with ctx.db.session() as s:
        row = await lrepo.hub_token(s, tenant_id, provider)
    return HubTokenStatus(provider=provider, configured=row is not None,
                          updated_at=ckpt.aware(row.created_at) if row else None)


async def delete_token(ctx: Context, tenant_id: str, provider: Provider) -> HubTokenStatus:
    async with ctx.db.session() as s:
        await lrepo.delete_hub_token(s, tenant_id, provider)
        audit.add(s, tenant_id, "hub.token.delete", provider)
    return HubTokenStatus(provider=provider, configured=False)


def to_wire(row: HubPushRow) -> PushStatus:
    return PushStatus(
        push_id=row.id, status=row.status, tinker_path=row.tinker_path, provider=row.provider,  # type: ignore[arg-type]
        repo_id=row.repo_id, private=row.private, trigger=row.trigger, error=row.error, url=row.url,  # type: ignore[arg-type]
        bytes_done=row.bytes_done, bytes_total=row.bytes_total,
        created_at=ckpt.aware(row.created_at), finished_at=ckpt.aware(row.finished_at),  # type: ignore[arg-type]
    )


async def start_push(ctx: Context, tenant_id: str, req: PushRequest) -> PushStatus:
    """Pushes a checkpoint the tenant can read (its own, or a published one)."""
    if ctx.pusher is None:
        raise HubUnavailable("hub push is not available in this deployment")
    source = await ckpt.readable(ctx, tenant_id, req.tinker_path)
    async with ctx.db.session() as s:
        if await lrepo.hub_token(s, tenant_id, req.provider) is None:
            raise BadRequest(f"no {req.provider} token stored for this tenant; PUT /native/v1/hub/tokens/{req.provider}")
    row = _new_push(tenant_id, source.tinker_path, source.storage_key, req.provider, req.repo_id, req.private,
                    "request")
    async with ctx.db.session() as s:
        await repo.add(s, row)
        audit.add(s, tenant_id, "hub.push", f"{row.id} {source.tinker_path} -> {req.provider}:{req.repo_id}")
    _start(ctx, row)
    return to_wire(row)


def _new_push(tenant_id: str, tinker_path: str, storage_key: str, provider: str, repo_id: str,  # noqa: PLR0913
              private: bool, trigger: str, error: str | None = None) -> HubPushRow:
    row = HubPushRow(id=str(uuid.uuid4()), tenant_id=tenant_id, tinker_path=tinker_path, storage_key=storage_key,
                     provider=provider, repo_id=repo_id, private=private, trigger=trigger, status="queued")
    if error is not None:  # recorded as failed at once: the reason is what the tenant polls
        row.status, row.error, row.finished_at = "failed", error, utcnow()
    return row


def _start(ctx: Context, row: HubPushRow) -> None:
    if row.status == "queued":
        task = asyncio.create_task(_run(ctx, row.id))
        _running.add(task)
        task.add_done_callback(_running.discard)


async def _run(ctx: Context, push_id: str) -> None:
    async with ctx.db.session() as s:
        row = await lrepo.push_by_id(s, push_id)
        token_row = await lrepo.hub_token(s, row.tenant_id, row.provider) if row else None
        if row is None:
            return
        row.status = "running"
    token = ""
    latest: list[tuple[int, int]] = []  # (bytes_done, bytes_total) as the pusher reports them, from any thread
    try:
        if token_row is None:
            raise HubPushFailed(f"the {row.provider} token was removed before the push started")
        token = await _open_token(ctx, token_row)
        endpoint = ctx.settings.hf_endpoint if row.provider == "huggingface" else ctx.settings.modelscope_endpoint
        spec = HubPushSpec(provider=row.provider, endpoint=endpoint, token=token, repo_id=row.repo_id,  # type: ignore[arg-type]
                           private=row.private, storage_key=row.storage_key,
                           commit_message=f"Upload {row.tinker_path} from Twinkle server")
        outcome = await _with_progress(ctx, push_id, spec, latest)
        status, error, url = "succeeded", None, outcome.url
    except Exception as e:  # every failure is reported on the push, never swallowed
        message = str(e) if isinstance(e, HubPushFailed) else f"{type(e).__name__}: {e}"
        status, error, url = "failed", _scrub(message, token)[:2000], None
        log.info("hub push %s failed: %s", push_id, error)
    async with ctx.db.session() as s:
        fresh = await lrepo.push_by_id(s, push_id)
        if fresh is not None:
            fresh.status, fresh.error, fresh.url, fresh.finished_at = status, error, url, utcnow()
            if latest:
                fresh.bytes_done, fresh.bytes_total = latest[-1]


async def _with_progress(ctx: Context, push_id: str, spec: HubPushSpec,
                         latest: list[tuple[int, int]]) -> HubPushOutcome:
    """The pusher's upload; the progress it reports (appended to `latest`, from any thread) is written onto the row
    meanwhile, when it has changed."""
    assert ctx.pusher is not None
    task = asyncio.ensure_future(ctx.pusher(spec, lambda done, total: latest.append((done, total))))
    written: tuple[int, int] | None = None
    while not task.done():
        await asyncio.wait([task], timeout=PROGRESS_WRITE_SECONDS)
        if task.done() or not latest or latest[-1] == written:
            continue
        written = latest[-1]
        del latest[:-1]  # only the newest figure matters
        async with ctx.db.session() as s:
            if (row := await lrepo.push_by_id(s, push_id)) is not None:
                row.bytes_done, row.bytes_total = written
    return task.result()


async def _open_token(ctx: Context, row: HubTokenRow) -> str:
    """The stored token; one the old scheme sealed is stored sealed anew (unless it was replaced meanwhile)."""
    context = _token_context(row.tenant_id, row.provider)
    token, legacy = keyring(ctx).open_token(row.ciphertext, context)
    if legacy:
        sealed = keyring(ctx).encrypt(token, context)
        async with ctx.db.session() as s:
            if await lrepo.reseal_hub_token(s, row.tenant_id, row.provider, row.ciphertext, sealed):
                log.info("re-sealed the %s token of tenant %s with the current scheme", row.provider, row.tenant_id)
    return token


def _scrub(message: str, token: str) -> str:
    return message.replace(token, "***") if token else message


async def get_push(ctx: Context, tenant_id: str, push_id: str) -> PushStatus:
    async with ctx.db.session() as s:
        row = await lrepo.push_of(s, tenant_id, push_id)
    if row is None:
        raise NotFound(f"push {push_id} not found")
    return to_wire(row)


async def fail_interrupted(ctx: Context) -> None:
    """At start of a single-gateway deployment (no Redis): pushes a previous process left unfinished are reported
    failed (the client may push again). With several gateways the unfinished ones may be another gateway's."""
    if ctx.settings.redis_url is not None:
        return
    async with ctx.db.session() as s:
        for row in await lrepo.unfinished_pushes(s):
            row.status, row.error, row.finished_at = "failed", "interrupted by a server restart; push again", utcnow()


async def set_auto_push(ctx: Context, tenant_id: str, model_id: str, req: AutoPushRequest) -> AutoPushStatus:
    async with ctx.db.session() as s:
        if await repo.model_of(s, tenant_id, model_id) is None:
            raise NotFound(f"training run {model_id} not found")
        row = await lrepo.auto_push_of(s, tenant_id, model_id)
        if row is None:
            row = AutoPushRow(model_id=model_id, tenant_id=tenant_id, provider=req.provider, repo_id=req.repo_id)
            s.add(row)
        row.provider, row.repo_id, row.private, row.push_id = req.provider, req.repo_id, req.private, None
        audit.add(s, tenant_id, "hub.auto_push", f"{model_id} -> {req.provider}:{req.repo_id}")
    return _auto_wire(row)


async def get_auto_push(ctx: Context, tenant_id: str, model_id: str) -> AutoPushStatus:
    async with ctx.db.session() as s:
        row = await lrepo.auto_push_of(s, tenant_id, model_id)
    if row is None:
        raise NotFound(f"training run {model_id} has no auto-push setting")
    return _auto_wire(row)


async def delete_auto_push(ctx: Context, tenant_id: str, model_id: str) -> None:
    async with ctx.db.session() as s:
        row = await lrepo.auto_push_of(s, tenant_id, model_id)
        if row is None:
            raise NotFound(f"training run {model_id} has no auto-push setting")
        await s.delete(row)
        audit.add(s, tenant_id, "hub.auto_push.delete", model_id)


def _auto_wire(row: AutoPushRow) -> AutoPushStatus:
    return AutoPushStatus(training_run_id=row.model_id, provider=row.provider, repo_id=row.repo_id,  # type: ignore[arg-type]
                          private=row.private, push_id=row.push_id)


async def trigger_auto_pushes(ctx: Context) -> None:
    """Runs whose session finished: push their newest checkpoint (a failed push row when there is nothing).
    A rule is claimed with one conditional UPDATE first, so gateways running this side by side push it once."""
    async with ctx.db.session() as s:
        due = await lrepo.due_auto_pushes(s)
    for rule, run in due:
        async with ctx.db.session() as s:
            if await lrepo.pending_saves_of_run(s, run.id):
                continue  # a save is still settling; the next round pushes it
            source = None
            for kind in _PREFERENCE:
                source = await lrepo.latest_checkpoint(s, run.id, kind)
                if source is not None:
                    break
            has_token = await lrepo.hub_token(s, rule.tenant_id, rule.provider) is not None
        error = None
        if ctx.pusher is None:
            error = "hub push is not available in this deployment"
        elif source is None:
            error = "the run finished without a saved checkpoint"
        elif not has_token:
            error = f"no {rule.provider} token stored for this tenant"
        path = source.tinker_path if source is not None else f"tinker://{run.id}"
        row = _new_push(rule.tenant_id, path, source.storage_key if source else "", rule.provider, rule.repo_id,
                        rule.private, "auto", error)
        async with ctx.db.session() as s:
            if not await lrepo.claim_auto_push(s, run.id, row.id):
                continue  # another gateway took it
            await repo.add(s, row)
        _start(ctx, row)
