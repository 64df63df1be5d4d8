"""jobqueue/storage.py: the same contract on a local folder and on an fsspec URL (memory://)."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from jobqueue.storage import CheckpointStorage, StorageKeyError


@pytest.fixture(params=["local", "fsspec"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> CheckpointStorage:
    if request.param == "local":
        return CheckpointStorage(tmp_path / "root")
    pytest.importorskip("fsspec")
    return CheckpointStorage(f"memory://twinkle-{uuid.uuid4().hex}", cache_dir=tmp_path / "cache")


def write(store: CheckpointStorage, key: str, files: dict[str, bytes]) -> None:
    with store.writing(key) as folder:
        for rel, data in files.items():
            (folder / rel).parent.mkdir(parents=True, exist_ok=True)
            (folder / rel).write_bytes(data)


KEY = "tenant/s1:train:0/weights/step1"


def test_write_list_read_delete(store: CheckpointStorage) -> None:
    assert not store.exists(KEY) and store.existing(KEY) is None and store.files(KEY) == {}
    write(store, KEY, {"adapter_config.json": b"{}", "sub/w.bin": b"12345"})
    assert store.exists(KEY)
    assert store.files(KEY) == {"adapter_config.json": 2, "sub/w.bin": 5} and store.size_bytes(KEY) == 7
    with store.open_file(KEY, "sub/w.bin") as f:
        assert f.read() == b"12345"
    local = store.existing(KEY)
    assert local is not None and (local / "sub" / "w.bin").read_bytes() == b"12345"
    store.delete(KEY)
    assert not store.exists(KEY) and store.existing(KEY) is None


def test_overwrite_replaces_every_file(store: CheckpointStorage) -> None:
    write(store, KEY, {"a": b"old", "gone": b"x"})
    write(store, KEY, {"a": b"new"})
    assert store.files(KEY) == {"a": 3}
    local = store.existing(KEY)
    assert local is not None and (local / "a").read_bytes() == b"new" and not (local / "gone").exists()


def test_a_failed_write_leaves_the_old_checkpoint(store: CheckpointStorage) -> None:
    write(store, KEY, {"a": b"old"})
    with pytest.raises(RuntimeError):
        with store.writing(KEY) as folder:
            (folder / "a").write_bytes(b"half")
            raise RuntimeError("crash while saving")
    assert store.files(KEY) == {"a": 3}


@pytest.mark.parametrize("key", ["../x", "a/../../b", "/abs", "a//b", "a/.hidden", "a b", ""])
def test_bad_keys_are_refused(store: CheckpointStorage, key: str) -> None:
    with pytest.raises(StorageKeyError):
        store.files(key)


def test_only_listed_files_open(store: CheckpointStorage) -> None:
    write(store, KEY, {"a": b"1"})
    for rel in ("../../../etc/passwd", "b", ".twinkle-complete"):
        with pytest.raises((StorageKeyError, FileNotFoundError)):
            store.open_file(KEY, rel)
