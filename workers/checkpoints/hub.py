"""The checkpoint pusher: uploads one checkpoint folder to a Hugging Face Hub or ModelScope repository.

`push(spec, store)` is blocking (network I/O); `HubPusherPool` runs it on its own small thread pool and is what
deploy/ hands the gateway as its `pusher`, so uploads never block an event loop and at most `concurrency` run at
once. The repository is created if missing, with the requested visibility (private by default); all files of the
checkpoint go up in one commit. Failures become HubPushFailed with a message that never contains the token.
Progress is the bytes of the checkpoint's files read for the upload (Hugging Face: each file is handed to the library
as a counting reader, after the library has hashed it; ModelScope uploads a folder in one call, so it reports 0 and
then the total).
"""

from __future__ import annotations

import asyncio
import io
import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import BinaryIO

from api_schemas.hub import HubPushFailed, HubPushOutcome, HubPushSpec, Progress
from jobqueue.storage import CheckpointStorage


def push(spec: HubPushSpec, store: CheckpointStorage, progress: Progress) -> HubPushOutcome:
    folder = store.existing(spec.storage_key)
    if folder is None:
        raise HubPushFailed("the checkpoint's files are gone (deleted or expired)")
    files = sorted(f for f in folder.rglob("*") if f.is_file())
    if not files:
        raise HubPushFailed("the checkpoint folder is empty")
    token = spec.token.get_secret_value()
    meter = _Meter(sum(f.stat().st_size for f in files), progress)
    try:
        if spec.provider == "huggingface":
            return _push_huggingface(spec, token, folder, files, meter)
        outcome = _push_modelscope(spec, token, folder)
        meter.add(meter.total)
        return outcome
    except HubPushFailed:
        raise
    except Exception as e:  # the libraries raise many types; the message is what the tenant needs
        raise HubPushFailed(_scrub(f"{spec.provider} push failed: {type(e).__name__}: {e}", token)) from None


def _push_huggingface(spec: HubPushSpec, token: str, folder: Path, files: list[Path], meter: _Meter) -> HubPushOutcome:
    from huggingface_hub import CommitOperationAdd, HfApi, constants
    from huggingface_hub.utils import disable_progress_bars

    disable_progress_bars()  # a server log is no terminal
    _quiet_xet_fallback()
    if constants.HF_HUB_OFFLINE:
        raise HubPushFailed("the server runs with HF_HUB_OFFLINE=1, so it cannot reach the Hugging Face Hub")
    api = HfApi(endpoint=spec.endpoint, token=token)
    api.create_repo(spec.repo_id, private=spec.private, exist_ok=True, repo_type="model")
    # One explicit commit (not upload_folder): with hf_xet installed, upload_folder switches to a pipelined
    # multi-commit protocol; create_commit keeps to the documented preupload / LFS / commit endpoints.
    readers = [_CountingReader(f.open("rb"), meter) for f in files]
    try:
        ops = [CommitOperationAdd(path_in_repo=f.relative_to(folder).as_posix(), path_or_fileobj=r)  # type: ignore[arg-type]
               for f, r in zip(files, readers)]
        for r in readers:  # the library read each file once to hash it: the upload's reads count from here
            r.counting = True
        info = api.create_commit(spec.repo_id, ops, commit_message=spec.commit_message, repo_type="model")
    finally:
        for r in readers:
            r.raw.close()
    meter.finish()
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


def _quiet_xet_fallback() -> None:
    """huggingface_hub warns on every push with file objects that it uploads over HTTP rather than Xet: expected."""
    logger = logging.getLogger("huggingface_hub._commit_api")
    if not any(isinstance(f, _NoXetNote) for f in logger.filters):
        logger.addFilter(_NoXetNote())


class _NoXetNote(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "not supported by Xet Storage" not in record.getMessage()


class _Meter:
    """The bytes read for the upload so far, reported through `progress` (never past the total)."""

    def __init__(self, total: int, progress: Progress) -> None:
        self.total, self.done, self._progress = total, 0, progress
        self._lock = threading.Lock()  # the library may read several files on its own threads
        progress(0, total)

    def add(self, n: int) -> None:
        with self._lock:
            self.done = min(self.total, self.done + n)
            done = self.done
        self._progress(done, self.total)

    def finish(self) -> None:
        self.add(self.total)


class _CountingReader(io.BufferedIOBase):
    """A checkpoint file as the hub library reads it; bytes read count once `counting` is on. A file read again (a
    retried upload) counts again, capped at the total by the meter. (A file object rather than a path also keeps
    huggingface_hub on the documented LFS upload when hf_xet is installed.)"""

    def __init__(self, raw: BinaryIO, meter: _Meter) -> None:
        super().__init__()
        self.raw, self.meter, self.counting = raw, meter, False

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        return self.raw.seek(offset, whence)

    def tell(self) -> int:
        return self.raw.tell()

    def read(self, size: int | None = -1) -> bytes:
        data = self.raw.read(-1 if size is None else size)
        if self.counting and data:
            self.meter.add(len(data))
        return data

    def read1(self, size: int = -1) -> bytes:
        return self.read(size)


def _scrub(message: str, token: str) -> str:
    return message.replace(token, "***") if token else message


class HubPusherPool:
    """The async pusher the gateway awaits; uploads run on `concurrency` dedicated threads."""

    def __init__(self, store: CheckpointStorage, concurrency: int = 2) -> None:
        self.store = store
        self._executor = ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="twinkle-hub-push")

    async def __call__(self, spec: HubPushSpec, progress: Progress) -> HubPushOutcome:
        return await asyncio.get_running_loop().run_in_executor(self._executor, push, spec, self.store, progress)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
