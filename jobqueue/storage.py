"""Checkpoint storage behind one interface, shared by the gateway (downloads, deletes, hub push) and the workers
(save, load). A local directory by default; any fsspec URL (`s3://bucket/prefix`, `gs://...`, `memory://...`) as an
option. Imports only the standard library (fsspec lazily, when a URL is used).

Locations are *storage keys* minted by the gateway ("tenant/model/kind/name"), never client-supplied paths: every
key and every file path inside a checkpoint is checked part by part, so nothing can escape the root. A write goes
to a temporary folder first: locally it is renamed into place (atomic); remotely the files are uploaded and a
completion marker is written last, so a half-written checkpoint is never visible.
"""

from __future__ import annotations

import contextlib
import re
import shutil
import tempfile
import uuid
from pathlib import Path
from typing import Any, BinaryIO, Iterator

_PART = re.compile(r"^[A-Za-z0-9._:@-]{1,200}$")
_MARKER = ".twinkle-complete"  # remote backends: written last, holds the version of the upload


class StorageKeyError(ValueError):
    """A storage key or a file path inside a checkpoint is malformed or would leave the store."""


def check_key(storage_key: str) -> list[str]:
    parts = storage_key.split("/")
    if not parts or any(p in (".", "..") or p.startswith(".") or not _PART.match(p) for p in parts):
        raise StorageKeyError(f"invalid storage key {storage_key!r}")
    return parts


def check_relpath(relpath: str) -> list[str]:
    """A file path inside one checkpoint (e.g. `adapter_model.safetensors`); hidden files are never served."""
    return check_key(relpath)


class CheckpointStorage:
    """`location`: a local folder (Path or plain path string) or an fsspec URL. `cache_dir` holds local copies of
    remote checkpoints for loading (default: a temporary folder)."""

    def __init__(self, location: Path | str, cache_dir: Path | None = None) -> None:
        loc = str(location)
        if "://" in loc and not loc.startswith("file://"):
            self._backend: _Backend = _Remote(loc, cache_dir)
        else:
            self._backend = _Local(Path(loc.removeprefix("file://")))
        self.location = loc

    @property
    def is_local(self) -> bool:
        return isinstance(self._backend, _Local)

    @contextlib.contextmanager
    def writing(self, storage_key: str) -> Iterator[Path]:
        """Yields an empty local folder; on a clean exit its files become the checkpoint (replacing any old one)."""
        check_key(storage_key)
        with self._backend.writing(storage_key) as folder:
            yield folder

    def existing(self, storage_key: str) -> Path | None:
        """A local folder holding the checkpoint's files (for remote storage, a cached copy); None if absent."""
        check_key(storage_key)
        return self._backend.existing(storage_key)

    def exists(self, storage_key: str) -> bool:
        check_key(storage_key)
        return self._backend.files(storage_key) is not None

    def files(self, storage_key: str) -> dict[str, int]:
        """Relative file path -> size in bytes, for every file of the checkpoint ({} if it does not exist)."""
        check_key(storage_key)
        return self._backend.files(storage_key) or {}

    def size_bytes(self, storage_key: str) -> int:
        return sum(self.files(storage_key).values())

    def open_file(self, storage_key: str, relpath: str) -> BinaryIO:
        """Open one file of a checkpoint for reading; FileNotFoundError if the checkpoint has no such file."""
        check_key(storage_key)
        check_relpath(relpath)
        if relpath not in self.files(storage_key):
            raise FileNotFoundError(f"{storage_key} has no file {relpath}")
        return self._backend.open_file(storage_key, relpath)

    def delete(self, storage_key: str) -> None:
        check_key(storage_key)
        self._backend.delete(storage_key)


class _Backend:
    def writing(self, key: str) -> contextlib.AbstractContextManager[Path]:
        raise NotImplementedError

    def existing(self, key: str) -> Path | None:
        raise NotImplementedError

    def files(self, key: str) -> dict[str, int] | None:
        raise NotImplementedError

    def open_file(self, key: str, relpath: str) -> BinaryIO:
        raise NotImplementedError

    def delete(self, key: str) -> None:
        raise NotImplementedError


class _Local(_Backend):
    def __init__(self, root: Path) -> None:
        self.root = root.expanduser().resolve()
        self.root.mkdir(parents=True, exist_ok=True)

    def _path(self, key: str) -> Path:
        path = (self.root / Path(*key.split("/"))).resolve()
        if self.root not in path.parents:
            raise StorageKeyError(f"storage key {key!r} escapes the store")
        return path

    @contextlib.contextmanager
    def writing(self, key: str) -> Iterator[Path]:
        final = self._path(key)
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = final.parent / f".tmp-{final.name}-{uuid.uuid4().hex}"
        tmp.mkdir()
        try:
            yield tmp
            old = final.parent / f".old-{final.name}-{uuid.uuid4().hex}"
            if final.exists():
                final.rename(old)  # two renames: readers see the old or the new folder, never a mix
            tmp.rename(final)
            shutil.rmtree(old, ignore_errors=True)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)

    def existing(self, key: str) -> Path | None:
        path = self._path(key)
        return path if path.is_dir() else None

    def files(self, key: str) -> dict[str, int] | None:
        path = self.existing(key)
        if path is None:
            return None
        return {f.relative_to(path).as_posix(): f.stat().st_size for f in sorted(path.rglob("*")) if f.is_file()}

    def open_file(self, key: str, relpath: str) -> BinaryIO:
        return open(self._path(key) / Path(*relpath.split("/")), "rb")

    def delete(self, key: str) -> None:
        path = self.existing(key)
        if path is not None:
            shutil.rmtree(path, ignore_errors=True)


class _Remote(_Backend):
    def __init__(self, url: str, cache_dir: Path | None) -> None:
        import fsspec  # only remote storage needs it

        fs, root = fsspec.core.url_to_fs(url)
        self.fs: Any = fs
        self.root = root.rstrip("/")
        self.cache = (cache_dir or Path(tempfile.mkdtemp(prefix="twinkle-storage-"))).resolve()
        self.cache.mkdir(parents=True, exist_ok=True)

    def _path(self, key: str) -> str:
        return f"{self.root}/{key}"

    @contextlib.contextmanager
    def writing(self, key: str) -> Iterator[Path]:
        with tempfile.TemporaryDirectory(dir=self.cache, prefix=".upload-") as tmp:
            yield Path(tmp)
            remote = self._path(key)
            self.delete(key)
            for f in sorted(Path(tmp).rglob("*")):
                if f.is_file():
                    target = f"{remote}/{f.relative_to(tmp).as_posix()}"
                    self.fs.makedirs(target.rsplit("/", 1)[0], exist_ok=True)
                    self.fs.put_file(str(f), target)
            self.fs.pipe_file(f"{remote}/{_MARKER}", uuid.uuid4().hex.encode())

    def _version(self, key: str) -> str | None:
        try:
            return bytes(self.fs.cat_file(f"{self._path(key)}/{_MARKER}")).decode()
        except (FileNotFoundError, OSError):
            return None

    def existing(self, key: str) -> Path | None:
        version = self._version(key)
        if version is None:
            return None
        local = self.cache / Path(*key.split("/")) / version
        if not local.is_dir():
            tmp = local.parent / f".dl-{uuid.uuid4().hex}"
            for rel in self.files(key) or {}:
                dest = tmp / Path(*rel.split("/"))
                dest.parent.mkdir(parents=True, exist_ok=True)
                self.fs.get_file(f"{self._path(key)}/{rel}", str(dest))
            tmp.mkdir(parents=True, exist_ok=True)
            try:
                tmp.rename(local)
            except OSError:  # another reader finished the same download first
                shutil.rmtree(tmp, ignore_errors=True)
        return local

    def files(self, key: str) -> dict[str, int] | None:
        if self._version(key) is None:
            return None
        remote = self._path(key)
        found = self.fs.find(remote, detail=True)
        out: dict[str, int] = {}
        for path, info in sorted(found.items()):
            rel = path.rstrip("/")[len(remote.rstrip("/")) + 1 :]
            if rel and rel != _MARKER and info.get("type") != "directory":
                out[rel] = int(info.get("size") or 0)
        return out

    def open_file(self, key: str, relpath: str) -> BinaryIO:
        f: BinaryIO = self.fs.open(f"{self._path(key)}/{relpath}", "rb")
        return f

    def delete(self, key: str) -> None:
        remote = self._path(key)
        if self.fs.exists(remote):
            self.fs.rm(remote, recursive=True)
        shutil.rmtree(self.cache / Path(*key.split("/")), ignore_errors=True)
