"""How many live tenant adapters one base model carries: up to 1,000 LoRA adapters (rank 8, every linear layer of
the decoder, each with Adam state after one step), created through the real API by several tenants (stock tinker
SDK, one `twinkle-server serve`), while a handful of active ones train and the rest sit idle.

Phases grow the live count (1, 10, 100, 1000 by default); at each the benchmark reports:
- accepted / refused adapters (refused: any create or first step that failed);
- the server's RSS and the bytes of its adapter spill folder (idle adapters page to host memory, then disk);
- the step time (forward_backward + optim_step, one client, back to back) of the active adapters, median, and the
  server's CPU seconds per such step (steadier than wall time on a shared machine);
- the page-in latency of cold adapters: the least recently used ones (on disk once there are enough), one step each,
  p50 / p99 of (cold step - the median warm step);
and the ratios of each to the first phase. Prints one JSON line.

Usage: python benchmarks/adapter_scale.py [--model smollm2|tiny] [--counts 1,10,100,1000] [--tenants 10]
       [--active 4] [--cold 20] [--tokens 32]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.merged_step import model_folder  # noqa: E402


class Fleet:
    """The tenants' SDK clients and every adapter created so far (in creation order)."""

    def __init__(self, base_url: str, keys: list[str], base_model: str, vocab: int, tokens: int) -> None:
        import tinker
        from tinker import types

        self.types = types
        self.clients = [tinker.ServiceClient(base_url=base_url, api_key=k) for k in keys]
        self.base_model, self.vocab, self.tokens = base_model, vocab, tokens
        self.adapters: list[Any] = []  # training clients
        self.refused: list[str] = []
        self.lock = threading.Lock()

    def datum(self, seed: int) -> list:
        import numpy as np

        row = np.random.default_rng(seed).integers(3, self.vocab, size=self.tokens + 1).tolist()
        return [self.types.Datum(model_input=self.types.ModelInput.from_ints(row[:-1]),
                                 loss_fn_inputs={"target_tokens": row[1:], "weights": [1.0] * self.tokens})]

    def step(self, tc: Any, seed: int) -> float:
        t = time.perf_counter()
        fb = tc.forward_backward(self.datum(seed), "cross_entropy")
        opt = tc.optim_step(self.types.AdamParams(learning_rate=1e-4))
        fb.result()
        opt.result()
        return time.perf_counter() - t

    def grow(self, count: int, workers: int) -> None:
        """Create adapters (each with one training step) until `count` live ones exist."""
        def one(i: int) -> None:
            sc = self.clients[i % len(self.clients)]
            try:
                tc = sc.create_lora_training_client(base_model=self.base_model, rank=8, seed=i, train_attn=True,
                                                    train_mlp=True, train_unembed=False).result()
                self.step(tc, i)
            except Exception as e:  # noqa: BLE001 - a refusal is a result of the benchmark
                with self.lock:
                    self.refused.append(f"{type(e).__name__}: {e}"[:300])
                return
            with self.lock:
                self.adapters.append(tc)

        start = len(self.adapters) + len(self.refused)
        with ThreadPoolExecutor(workers) as pool:
            list(pool.map(one, range(start, count)))


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()) if folder.exists() else 0


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def measure(fleet: Fleet, active: int, cold: int, steps: int, server_pid: int) -> dict:
    """Active adapters: the newest `active`, stepped in turn; cold ones: the oldest `cold`, one step each."""
    hot = fleet.adapters[-active:]
    for tc in hot:  # bring them in (they may have paged out while the fleet grew)
        fleet.step(tc, 0)
    cpu = cpu_seconds(server_pid)
    warm = [fleet.step(tc, s) for s in range(steps) for tc in hot]
    warm_cpu = (cpu_seconds(server_pid) - cpu) / len(warm)
    warm_s = statistics.median(warm)
    cold_s: list[float] = []
    olds = [tc for tc in fleet.adapters[: max(0, len(fleet.adapters) - active)]][:cold]
    for i, tc in enumerate(olds):
        cold_s.append(fleet.step(tc, 10_000 + i))
        for h in hot:  # the active ones stay the most recently used
            fleet.step(h, 20_000 + i)
    page_in = sorted(max(0.0, c - warm_s) for c in cold_s)
    return {"warm_step_s": round(warm_s, 4), "warm_step_server_cpu_s": round(warm_cpu, 4),
            "cold_step_p50_s": round(statistics.median(cold_s), 4) if cold_s else None,
            "page_in_p50_s": round(_quantile(page_in, 0.5), 4) if page_in else None,
            "page_in_p99_s": round(_quantile(page_in, 0.99), 4) if page_in else None}


def _quantile(xs: list[float], q: float) -> float:
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", choices=["tiny", "smollm2"], default="smollm2")
    ap.add_argument("--counts", default="1,10,100,1000")
    ap.add_argument("--tenants", type=int, default=10)
    ap.add_argument("--active", type=int, default=4)
    ap.add_argument("--cold", type=int, default=20)
    ap.add_argument("--steps", type=int, default=3, help="timed steps per active adapter and phase")
    ap.add_argument("--tokens", type=int, default=32, help="tokens per step (one datum)")
    ap.add_argument("--workers", type=int, default=8, help="concurrent creations")
    args = ap.parse_args()
    from tests.support.server import ServerProcess

    with tempfile.TemporaryDirectory() as tmp:
        folder = model_folder(args.model, Path(tmp))
        vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
        data = Path(tmp) / "data"
        srv = ServerProcess(data, str(folder))
        keys = [srv.create_key(f"tenant-{i}") for i in range(args.tenants)]
        srv.start(timeout=600)
        assert srv.proc is not None
        phases = []
        try:
            fleet = Fleet(srv.base_url, keys, str(folder), vocab, args.tokens)
            for count in [int(c) for c in args.counts.split(",")]:
                t = time.perf_counter()
                fleet.grow(count, args.workers)
                grow_s = time.perf_counter() - t
                row = {"live": len(fleet.adapters), "refused": len(fleet.refused), "grow_s": round(grow_s, 1)}
                row |= measure(fleet, min(args.active, len(fleet.adapters)), args.cold, args.steps, srv.proc.pid)
                row |= {"server_rss_mb": round(rss_bytes(srv.proc.pid) / 2**20, 1),
                        "spill_mb": round(folder_bytes(data / "adapter-spill") / 2**20, 1)}
                phases.append(row)
                print(json.dumps(row), file=sys.stderr, flush=True)
        finally:
            srv.stop()
    first = phases[0]
    for p in phases:
        p["warm_step_vs_first"] = round(p["warm_step_s"] / first["warm_step_s"], 3)
        p["warm_cpu_vs_first"] = round(p["warm_step_server_cpu_s"] / first["warm_step_server_cpu_s"], 3)
    print(json.dumps({"benchmark": "adapter_scale", "model": args.model, "tenants": args.tenants,
                      "active": args.active, "tokens_per_step": args.tokens, "rank": 8,
                      "refusals": fleet.refused[:5], "phases": phases}))


if __name__ == "__main__":
    main()
