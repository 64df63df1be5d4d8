"""Fault campaign (issue 19): random kill -9 of the worker, the gateway or Redis while tenants train, cluster mode.

The cluster is what an operator runs: `twinkle-server serve` as the gateway (SQLite in its data dir), one
`twinkle-server worker`, and a Redis of the campaign's own on a free loopback port with AOF on and
`appendfsync always`. `--tenants` stock-SDK clients (default 3, one tenant each) train a deterministic SFT sequence
(tests/support/sft.py: the batch of step i is fixed, forward_backward + optim_step submitted together, then
awaited), each on a base model of its own: the worker serves the tiny model under one served name per tenant, so
no two tenants' jobs share a merged pass. That keeps every tenant's arithmetic the same in the campaign and in the
replay: a merged pass equals the solo ones only to rounding (on some CPUs the grouped LoRA matmul of a merged pass
rounds differently from the single-adapter one), and Adam at this learning rate grows a rounding difference into
a different run within a few hundred steps, which would hide a job run twice behind noise. Meanwhile a killer,
`--kills` times (default 100), waits a random 0.5-2 s, SIGKILLs one of the three processes at random and starts it
again at once, as a supervisor would; the next kill waits until the restarted one is ready.

Reported (one JSON line):
- `lost_futures`: a future the server acknowledged that never resolved within `--future-timeout` (target 0);
  `errors`: what the SDK raised instead of a result, by class (each also breaks that tenant's determinism);
- `duplicated_effects`: tenants whose final weights and Adam moments differ (beyond fp32 1e-5) from an
  uninterrupted replay of the same number of steps, on the same cluster after the campaign (target 0: a job that
  ran twice, or not at all, shows up here);
- `recovery_s` p50/p99 per target: from the kill until a step of any tenant resolved after the restarted process
  was ready again.
Usage: python benchmarks/fault_campaign.py [--kills 100] [--tenants 3]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import threading
import time
import uuid
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

TARGETS = ("worker", "gateway", "redis")
TOLERANCE = 1e-5


class Cluster:
    """Gateway, worker and Redis as subprocesses sharing one data dir; each can be killed and started again."""

    def __init__(self, root: Path, model: str, names: list[str]) -> None:
        from tests.support.redis_server import RedisServer
        from tests.support.server import ServerProcess, WorkerProcess

        self.root = root
        self.redis = RedisServer(root / "redis", aof=True, fsync="always")
        env = {"TWINKLE_REDIS_URL": self.redis.url, "TWINKLE_REDIS_PREFIX": f"fault{uuid.uuid4().hex[:6]}",
               "TWINKLE_WORKER_LEASE_SECONDS": "2", "TWINKLE_SNAPSHOT_EVERY_STEPS": "3",
               "TWINKLE_LONG_POLL_SECONDS": "10"}
        debug = ("--log-level", "debug") if os.environ.get("TWINKLE_FAULT_KEEP") else ()
        served = ("--served-model-name", names[0], *[a for n in names[1:] for a in
                                                         ("--base-model", model, "--served-model-name", n)])
        # the gateway loads no model (cluster mode): it serves the models the worker registers
        self.gateway = ServerProcess(root, model, env=env, args=debug)
        self.worker = WorkerProcess(root, model, env=env, args=served)

    def start(self) -> None:
        self.redis.start()
        self.gateway.start()
        self.worker.start()

    def stop(self) -> None:
        for p in (self.worker, self.gateway, self.redis):
            p.stop()

    def crash(self, target: str) -> None:
        """SIGKILL `target` and start it again at once; returns when it is ready."""
        proc = {"worker": self.worker, "gateway": self.gateway, "redis": self.redis}[target]
        proc.kill()
        if target == "worker":
            self.worker.start(wait=False)
            self.worker.wait_ready()
        else:
            proc.start()

    def state(self, tc: Any, name: str) -> dict[str, Any]:
        """The adapter's weights and optimizer moments, read from the checkpoint files of a save_state."""
        from safetensors.torch import load_file

        path = tc.save_state(name).result(timeout=300).path
        run_id, kind, ckpt = path.removeprefix("tinker://").split("/")
        (folder,) = list(self.root.glob(f"checkpoints/*/{run_id}/{kind}/{ckpt}"))
        out = dict(load_file(str(folder / "adapter_model.safetensors")))
        out.update({f"optim/{k}": v for k, v in load_file(str(folder / "optimizer.safetensors")).items()})
        return out


class Progress:
    """Steps resolved per tenant and when the last one resolved (for recovery times)."""

    def __init__(self, tenants: int) -> None:
        self.lock = threading.Lock()
        self.steps = [0] * tenants
        self.last_ok = time.monotonic()
        self.errors: dict[str, int] = {}
        self.first_error: dict[str, str] = {}  # class -> the first such error's message
        self.lost = 0

    def ok(self, tenant: int) -> None:
        with self.lock:
            self.steps[tenant] += 1
            self.last_ok = time.monotonic()

    def failed(self, e: BaseException) -> None:
        with self.lock:
            if isinstance(e, (FutureTimeout, TimeoutError)):
                self.lost += 1
            else:
                name = f"{type(e).__name__}:{getattr(e, 'status_code', '')}"
                self.errors[name] = self.errors.get(name, 0) + 1
                self.first_error.setdefault(name, str(e)[:300])


def _train(tc: Any, tenant: int, stop: threading.Event, progress: Progress, bound: float) -> None:
    """The campaign's SFT loop (tests/support/sft.py's steps), until `stop`; an error ends this tenant's run."""
    from tinker import types

    from tests.support.sft import batch

    step = 0
    while not stop.is_set():
        try:
            fb = tc.forward_backward(batch(step), "cross_entropy")
            opt = tc.optim_step(types.AdamParams(learning_rate=2e-2))
            fb.result(timeout=bound)
            opt.result(timeout=bound)
        except BaseException as e:  # noqa: BLE001 - counted and reported
            progress.failed(e)
            return
        progress.ok(tenant)
        step += 1


def _killer(cluster: Cluster, kills: int, rng: random.Random, progress: Progress,
            recoveries: dict[str, list[float]], done: threading.Event) -> None:
    for _ in range(kills):
        time.sleep(rng.uniform(0.5, 2.0))
        target = rng.choice(TARGETS)
        t0 = time.monotonic()
        cluster.crash(target)
        back = time.monotonic()  # restarted and ready: the next step to resolve from now on marks the recovery
        while progress.last_ok < back and time.monotonic() - back < 300:
            time.sleep(0.05)
        recoveries.setdefault(target, []).append(progress.last_ok - t0 if progress.last_ok >= back else float("inf"))
    done.set()


def _pcts(values: list[float]) -> dict[str, float]:
    return {"n": len(values), "p50": round(float(np.percentile(values, 50)), 2),
            "p99": round(float(np.percentile(values, 99)), 2)}


def run(kills: int, tenants: int = 3, seed: int = 0, future_timeout: float = 180.0,
        work_dir: Path | None = None) -> dict[str, Any]:
    import tinker

    from tests.support.sft import sft
    from tests.support.tiny_model import build_tiny_model

    with tempfile.TemporaryDirectory(dir=work_dir) as tmp:
        if os.environ.get("TWINKLE_FAULT_KEEP"):  # keep the processes' logs and data (a campaign to look into)
            tmp = tempfile.mkdtemp(prefix="fault-", dir=work_dir)
        folder = build_tiny_model(Path(tmp) / "tiny")
        names = [f"tiny-{t}" for t in range(tenants)]  # a served model per tenant (see the docstring)
        cluster = Cluster(Path(tmp) / "cluster", str(folder), names)
        keys = [cluster.gateway.create_key(f"fault-{t}") for t in range(tenants)]
        cluster.start()
        try:
            services = [tinker.ServiceClient(base_url=cluster.gateway.base_url, api_key=k) for k in keys]
            clients = [sc.create_lora_training_client(base_model=names[t], rank=4, seed=10 + t).result()
                       for t, sc in enumerate(services)]
            progress, recoveries, stop = Progress(tenants), {}, threading.Event()
            trainers = [threading.Thread(target=_train, args=(tc, t, stop, progress, future_timeout), daemon=True)
                        for t, tc in enumerate(clients)]
            t0 = time.monotonic()
            for t in trainers:
                t.start()
            _killer(cluster, kills, random.Random(seed), progress, recoveries, stop)
            for t in trainers:
                t.join(timeout=2 * future_timeout)
            campaign_s = time.monotonic() - t0
            stuck = sum(t.is_alive() for t in trainers)
            # the same steps again, uninterrupted, for each tenant: equal weights mean every job ran exactly once
            differ, worst = 0, 0.0
            for t, (sc, tc) in enumerate(zip(services, clients)):
                replay = sc.create_lora_training_client(base_model=names[t], rank=4, seed=10 + t).result()
                sft(replay, progress.steps[t])
                got, want = cluster.state(tc, f"campaign{t}"), cluster.state(replay, f"replay{t}")
                gap = max(float((got[k] - want[k]).abs().max()) for k in want) if got.keys() == want.keys() else 1e9
                worst = max(worst, gap)
                differ += gap > TOLERANCE
        finally:
            cluster.stop()
    done = sum(len(v) for v in recoveries.values())
    out = {
        "benchmark": "fault_campaign", "model": "tiny", "tenants": tenants, "kills": done,
        "kills_by_target": {k: len(v) for k, v in sorted(recoveries.items())}, "campaign_s": round(campaign_s, 1),
        "steps": progress.steps, "lost_futures": progress.lost + stuck, "errors": progress.errors,
        "first_errors": progress.first_error,
        "duplicated_effects": differ, "worst_weight_gap": worst,
        "recovery_s": {k: _pcts(v) for k, v in sorted(recoveries.items())},
        "recovery_s_all": _pcts([x for v in recoveries.values() for x in v]) if done else {},
    }
    out["targets_met"] = out["lost_futures"] == 0 and not out["errors"] and differ == 0
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kills", type=int, default=100)
    ap.add_argument("--tenants", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--future-timeout", type=float, default=180.0)
    args = ap.parse_args()
    print(json.dumps(run(args.kills, args.tenants, args.seed, args.future_timeout)))


if __name__ == "__main__":
    main()
