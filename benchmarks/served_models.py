"""Several base models and full-parameter leases: the memory each served model takes, and the lease hand-over time.

1. Memory per served model: the compute side of each model (`Runtime.build`: base weights, trainer, sampler) built
   one after the other in this process; for each, the bytes the memory ledger reserved for it (counted from the
   safetensors headers before loading) and the growth of this process's RSS after one adapter's first pass on it;
   then a full-parameter copy of the first (FullRuns.create: weights, gradients and Adam moments reserved up front).
2. Lease hand-over: a server offering one full-parameter run per model (`TWINKLE_FULL_PARAM_MODELS=*`); tenant A
   holds the lease and trains a step; tenant B's create_model without a LoRA config waits (`try_again`,
   `paused_capacity`); A finishes its session; the hand-over time is from A's finish_session answer to B's create
   completing (B's private copy built), over `--rounds` rounds (the roles swap), median and max.
Prints one JSON line.

Usage: python benchmarks/served_models.py [--models smollm2,qwen3-49k,tiny] [--lease-model smollm2] [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx  # noqa: E402

from benchmarks.merged_step import model_folder  # noqa: E402


def rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def memory_per_model(names: list[str], tmp: Path) -> list[dict]:
    import transformers  # noqa: F401 - imported before the first measurement: its RSS is no model's

    from jobqueue.local_queue import LocalQueue
    from tests.unit.engine_jobs import create, fb
    from workers.memory import MemoryLedger
    from workers.runtime import Runtime, StorageSpec, WorkerSpec

    ledger, queue, out, runtimes = MemoryLedger(None), LocalQueue(), [], []
    storage = StorageSpec(data_dir=tmp / "data", location=str(tmp / "ckpt"), cache_dir=tmp / "cache")
    for i, name in enumerate(["tiny", *names]):  # first a tiny one, not reported: it pays for the libraries' RSS
        before, reserved = rss_bytes(), ledger.reserved_bytes
        spec = WorkerSpec(base_model=f"{name}-{i}", source=str(model_folder(name, tmp)), storage=storage)
        rt = Runtime.build(spec, queue, ledger=ledger)
        assert rt.trainer is not None  # one adapter and one pass: the weights are read (mapped files become resident)
        assert rt.trainer.execute(create(f"probe-{i}", rank=8)).ok
        assert rt.trainer.execute(fb(f"probe-{i}", 1, [list(range(3, 36))])).ok
        runtimes.append(rt)
        if i == 0:
            continue
        out.append({"model": name, "reserved_mb": round((ledger.reserved_bytes - reserved) / 2**20, 1),
                    "rss_growth_mb": round((rss_bytes() - before) / 2**20, 1)})
    trainer = runtimes[1].trainer
    assert trainer is not None
    before, reserved = rss_bytes(), ledger.reserved_bytes
    trainer.full.create("full-bench", "tenant")
    out.append({"model": f"{names[0]} full-parameter copy",
                "reserved_mb": round((ledger.reserved_bytes - reserved) / 2**20, 1),
                "rss_growth_mb": round((rss_bytes() - before) / 2**20, 1)})
    return out


class Tenant:
    """Raw Tinker calls (create_model without lora_config is what twinkle-kit's create_full_training_client sends)."""

    def __init__(self, base_url: str, key: str, base_model: str) -> None:
        self.api, self.headers, self.base_model = f"{base_url}/api/v1", {"X-API-Key": key}, base_model
        self.session = self.post("create_session", {"tags": [], "user_metadata": None, "sdk_version": "0.38.0",
                                                    "type": "create_session"})["session_id"]

    def post(self, route: str, body: dict) -> dict:
        r = httpx.post(f"{self.api}/{route}", headers=self.headers, json=body, timeout=60)
        r.raise_for_status()
        return r.json()

    def create_full(self) -> str:
        return self.post("create_model", {"session_id": self.session, "model_seq_id": 0, "base_model": self.base_model,
                                          "lora_config": None, "type": "create_model"})["request_id"]

    def poll(self, request_id: str) -> dict:
        self.post("session_heartbeat", {"session_id": self.session, "type": "session_heartbeat"})
        return self.post("retrieve_future", {"request_id": request_id})

    def wait(self, request_id: str, timeout: float = 300) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            out = self.poll(request_id)
            if out.get("type") != "try_again":
                return out
        raise TimeoutError(request_id)

    def finish(self) -> None:
        self.post(f"sessions/{self.session}/finish", {})


def lease_hand_over(model: str, rounds: int, tmp: Path) -> dict:
    from tests.support.server import ServerProcess

    folder = model_folder(model, tmp)
    srv = ServerProcess(tmp / "lease", str(folder), env={"TWINKLE_FULL_PARAM_MODELS": "*",
                                                         "TWINKLE_FULL_PARAM_RUNS_PER_MODEL": "1"})
    keys = [srv.create_key("tenant-a"), srv.create_key("tenant-b")]
    srv.start(timeout=600)
    times: list[float] = []
    try:
        holder = Tenant(srv.base_url, keys[0], str(folder))
        created = holder.wait(holder.create_full())
        assert "model_id" in created, created
        for r in range(rounds):
            waiter = Tenant(srv.base_url, keys[(r + 1) % 2], str(folder))
            pending = waiter.create_full()
            held = waiter.poll(pending)
            assert held.get("queue_state") == "paused_capacity", held
            holder.finish()
            t = time.perf_counter()
            done = waiter.wait(pending)
            times.append(time.perf_counter() - t)
            assert "model_id" in done, done
            holder = waiter
    finally:
        srv.stop()
    return {"model": model, "rounds": rounds, "hand_over_p50_s": round(statistics.median(times), 3),
            "hand_over_max_s": round(max(times), 3)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="smollm2,qwen3-49k,tiny")
    ap.add_argument("--lease-model", default="smollm2")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        memory = memory_per_model(args.models.split(","), Path(tmp))
        lease = lease_hand_over(args.lease_model, args.rounds, Path(tmp))
    print(json.dumps({"benchmark": "served_models", "memory": memory, "lease": lease}))


if __name__ == "__main__":
    main()
