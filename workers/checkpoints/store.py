"""The workers' view of checkpoint storage: the shared `jobqueue.storage` interface under its worker-side name.

Workers write checkpoints (save_state, save_weights_for_sampler, external exports, recovery snapshots) and read them
back (load_weights, samplers). `CheckpointStore(location)` takes a local folder or an fsspec URL; see
jobqueue/storage.py for the key rules and the atomic-write protocol.
"""

from __future__ import annotations

from jobqueue.storage import CheckpointStorage, StorageKeyError

CheckpointStore = CheckpointStorage

__all__ = ["CheckpointStore", "StorageKeyError"]
