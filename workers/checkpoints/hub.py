"""The checkpoint pusher: uploads one checkpoint folder to a Hugging Face Hub or ModelScope repository.

`push(spec, store)` is blocking (network I/O); `HubPusherPool` runs it on its own small thread pool and is what
deploy/ hands the gateway as its `pusher`, so uploads never block an event loop and at most `concurrency` run at
once. The repository is created if missing, with the requested visibility (private by default); all files of the
checkpoint go up in one commit. Failures become HubPushFailed with a message that never contains the token.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from api_schemas.hub import HubPushFailed, HubPushOutcome, HubPushSpec
from jobqueue.storage import CheckpointStorage


def push(spec: HubPushSpec, store: CheckpointStorage) -> HubPushOutcome:
    folder = store.existing(spec.storage_key)
    if folder is None:
        raise HubPushFailed("the checkpoint's files are gone (deleted or expired)")
    files = sorted(f for f in folder.rglob("*") if f.is_file())
    if not files:
        raise HubPushFailed("the checkpoint folder is empty")
    token = spec.token.get_secret_value()
    try:
        if spec.provider == "huggingface":
            return _push_huggingface(spec, token, folder, files)
        return _push_modelscope(spec, token, folder)
    except HubPushFailed:
        raise
    except Exception as e:  # the libraries raise many types; the message is what the tenant needs
        raise HubPushFailed(_scrub(f"{spec.provider} push failed: {type(e).__name__}: {e}", token)) from None


def _push_huggingface(spec: HubPushSpec, token: str, folder: Path, files: list[Path]) -> HubPushOutcome:
    from huggingface_hub import CommitOperationAdd, HfApi, constants
    from huggingface_hub.utils import disable_progress_bars

    disable_progress_bars()  # a server log is no terminal
    if constants.HF_HUB_OFFLINE:
        raise HubPushFailed("the server runs with HF_HUB_OFFLINE=1, so it cannot reach the Hugging Face Hub")
    api = HfApi(endpoint=spec.endpoint, token=token)
    api.create_repo(spec.repo_id, private=spec.private, exist_ok=True, repo_type="model")
    # One explicit commit (not upload_folder): with hf_xet installed, upload_folder switches to a pipelined
    # multi-commit protocol; create_commit keeps to the documented preupload / LFS / commit endpoints.
    ops = [CommitOperationAdd(path_in_repo=f.relative_to(folder).as_posix(), path_or_fileobj=str(f)) for f in files]
    info = api.create_commit(spec.repo_id, ops, commit_message=spec.commit_message, repo_type="model")
    return HubPushOutcome(url=str(info.commit_url))


def _push_modelscope(spec: HubPushSpec, token: str, folder: Path) -> HubPushOutcome:
    try:
        from modelscope.hub.api import HubApi
    except ImportError:
        raise HubPushFailed("ModelScope push needs the modelscope package on the server: "
                            "pip install 'twinkle-server[modelscope]'") from None

    api = HubApi(endpoint=spec.endpoint, token=token)
    api.create_repo(spec.repo_id, token=token, visibility="private" if spec.private else "public", exist_ok=True,
                    repo_type="model")
    api.upload_folder(repo_id=spec.repo_id, folder_path=str(folder), commit_message=spec.commit_message,
                      token=token, repo_type="model")
    return HubPushOutcome(url=f"{spec.endpoint.rstrip('/')}/models/{spec.repo_id}")


def _scrub(message: str, token: str) -> str:
    return message.replace(token, "***") if token else message


class HubPusherPool:
    """The async pusher the gateway awaits; uploads run on `concurrency` dedicated threads."""

    def __init__(self, store: CheckpointStorage, concurrency: int = 2) -> None:
        self.store = store
        self._executor = ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="twinkle-hub-push")

    async def __call__(self, spec: HubPushSpec) -> HubPushOutcome:
        return await asyncio.get_running_loop().run_in_executor(self._executor, push, spec, self.store)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
