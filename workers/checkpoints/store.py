"""Checkpoint files behind one small interface: a local directory (fsspec URLs are a later backend).

Locations are *storage keys* minted by the gateway ("tenant/model/kind/name"), never client-supplied paths; every
key is checked to stay inside the root. Writes go to a temporary folder and are renamed into place, so a crash
never leaves a half-written checkpoint.
"""

from __future__ import annotations

import contextlib
import re
import shutil
import uuid
from pathlib import Path
from typing import Iterator

_PART = re.compile(r"^[A-Za-z0-9._:-]{1,200}$")


class CheckpointStore:
    def __init__(self, root: Path) -> None:
        self.root = root.resolve()
        self.root.mkdir(parents=True, exist_ok=True)

    def _path(self, storage_key: str) -> Path:
        parts = storage_key.split("/")
        if not parts or any(p in (".", "..") or not _PART.match(p) for p in parts):
            raise ValueError(f"invalid storage key {storage_key!r}")
        path = (self.root / Path(*parts)).resolve()
        if self.root not in path.parents:
            raise ValueError(f"storage key {storage_key!r} escapes the store")
        return path

    @contextlib.contextmanager
    def writing(self, storage_key: str) -> Iterator[Path]:
        final = self._path(storage_key)
        tmp = final.parent / f".tmp-{final.name}-{uuid.uuid4().hex}"
        tmp.mkdir(parents=True)
        try:
            yield tmp
            if final.exists():
                shutil.rmtree(final)
            tmp.rename(final)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)

    def existing(self, storage_key: str) -> Path | None:
        path = self._path(storage_key)
        return path if path.is_dir() else None

    def size_bytes(self, storage_key: str) -> int:
        path = self.existing(storage_key)
        return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path else 0

    def delete(self, storage_key: str) -> None:
        path = self.existing(storage_key)
        if path is not None:
            shutil.rmtree(path, ignore_errors=True)
