"""Vocabulary-sized step cost: a training step (cross_entropy forward_backward + Adam optim_step, rank 8) on a model
whose vocabulary dwarfs the rest, and on SmolLM2, in this tree and (given --before REV) in an older one.

Workloads (TENANTSxTOKENS, one row of TOKENS per tenant's datum; ROWS datums per tenant):
- `qwen3-49k`: a 6.4 M-parameter Qwen3 (hidden 64, 2 layers) with SmolLM2's 49,152-token vocabulary (built by
  benchmarks/merged_step.model_folder); 1x4x64 (one client, 4 rows of 64 tokens) and 4x4x64 (four clients merged in one pass).
- `smollm2`: the embedded default, SmolLM2-135M-Instruct, at 4x512 and 16x64 (one row per tenant, merged).
Each measurement runs in a child process of its own (its peak RSS is the workload's), trees alternate (new, old,
new, old, ...), each child reports the median of its repeats (wall and CPU seconds) after a warm-up. Prints one
JSON line: per workload and tree the step seconds, tokens/s and peak RSS, and the old/new ratios.

Usage: python benchmarks/vocab_step.py [--before REV] [--rounds 2] [--repeats 5] [--workloads qwen3-49k:1x4x64,...]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve()
ROOT = HERE.parents[1]
DEFAULT_WORKLOADS = "qwen3-49k:1x4x64,qwen3-49k:4x4x64,smollm2:4x1x512,smollm2:16x1x64"


def child(args: argparse.Namespace) -> None:
    """One workload in the tree on sys.path: prints {"step_s": median, "peak_rss_mb": ..., ...}."""
    import numpy as np
    import torch

    from tests.unit.engine_jobs import create, fb, optim
    from workers.checkpoints.store import CheckpointStore
    from workers.engine.base_model import BaseModel
    from workers.engine.trainer import Trainer
    from workers.scheduler import Scheduler

    tenants, rows, tokens = (int(x) for x in args.shape.split("x"))
    with tempfile.TemporaryDirectory() as tmp:
        trainer = Trainer(BaseModel(args.model, Path(args.folder)), CheckpointStore(Path(tmp) / "ckpt"))
        load_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        models = [f"m{i}" for i in range(tenants)]
        rng = np.random.default_rng(0)
        data = {m: rng.integers(3, trainer.base.vocab_size, size=(rows, tokens + 1)).tolist() for m in models}
        for i, m in enumerate(models):
            assert trainer.execute(create(m, rank=8, seed=i)).ok
        times, cpu = [], []
        warm = args.warmup  # enough passes for the trainer's thread choice (workers/engine/threads.py) to settle
        for step in range(warm + args.repeats):
            seq = 1 + 2 * step
            jobs = [fb(m, seq, data[m]) for m in models]
            t, c = time.perf_counter(), _cpu()
            results: list = []
            scheduler = Scheduler(gap_timeout=1e9, token_budget=trainer.token_budget, measure=trainer.measure)
            for job in jobs:
                scheduler.resume(job.model_id, job.seq_id)
                assert scheduler.add(job, now=0) is None
            while (merged := scheduler.next_step(now=0)) is not None:
                trainer.execute_step(list(merged.jobs), results.append)
            assert len(results) == tenants and all(r.ok for r in results), results
            for m in models:
                assert trainer.execute(optim(m, seq + 1)).ok
            if step >= warm:
                times.append(time.perf_counter() - t)
                cpu.append(_cpu() - c)
    chooser = getattr(trainer, "threads", None)
    chosen = ({f"{work}:{1 << (k - 1)}": c.chosen for (work, k), c in chooser.classes.items()} if chooser
              else None)
    print(json.dumps({"step_s": statistics.median(times), "cpu_s": statistics.median(cpu), "threads_chosen": chosen,
                      "load_rss_mb": round(load_rss, 1),
                      "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
                      "torch_threads": torch.get_num_threads()}))


def _cpu() -> float:
    """CPU seconds of this process, all threads (a step's CPU cost, less sensitive than wall time to other load)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def run_child(tree: Path, model: str, folder: Path, shape: str, repeats: int, warmup: int) -> dict:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_WAIT_POLICY": "PASSIVE", "PYTHONPATH": str(tree)}
    out = subprocess.run([sys.executable, str(HERE), "--child", "--model", model, "--folder", str(folder),
                          "--shape", shape, "--repeats", str(repeats), "--warmup", str(warmup)],
                         cwd=tree, env=env, capture_output=True,
                         text=True, check=False)
    if out.returncode != 0:
        raise SystemExit(f"{tree} {model} {shape} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def folder_of(model: str) -> Path:
    sys.path.insert(0, str(ROOT))
    from benchmarks.merged_step import model_folder

    return model_folder(model, Path(tempfile.gettempdir()))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--before", help="a git revision to compare with (checked out in a temporary worktree)")
    ap.add_argument("--workloads", default=DEFAULT_WORKLOADS, help="MODEL:TENANTSxROWSxTOKENS,...")
    ap.add_argument("--rounds", type=int, default=2, help="children per tree and workload (alternating)")
    ap.add_argument("--repeats", type=int, default=5, help="timed steps per child, after the warm-up steps")
    ap.add_argument("--warmup", type=int, default=8, help="untimed steps first (the thread choice settles)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--folder", help=argparse.SUPPRESS)
    ap.add_argument("--shape", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        sys.path.insert(0, os.getcwd())
        return child(args)
    with tempfile.TemporaryDirectory() as tmp:
        trees = {"new": ROOT}
        if args.before:
            old = Path(tmp) / "old"
            subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(old), args.before],
                           check=True, capture_output=True)
            trees["old"] = old
        try:
            results = []
            for workload in args.workloads.split(","):
                model, shape = workload.split(":")
                folder = folder_of(model)
                runs: dict[str, list[dict]] = {name: [] for name in trees}
                for _ in range(args.rounds):
                    for name, tree in trees.items():
                        runs[name].append(run_child(tree, model, folder, shape, args.repeats, args.warmup))
                tenants, rows, tokens = (int(x) for x in shape.split("x"))
                row: dict = {"model": model, "shape": shape, "tokens": tenants * rows * tokens}
                for name, rs in runs.items():
                    step = statistics.median(r["step_s"] for r in rs)
                    row[name] = {"step_s": round(step, 4), "tokens_per_s": round(row["tokens"] / step, 1),
                                 "cpu_s": round(statistics.median(r["cpu_s"] for r in rs), 4),
                                 "threads_chosen": rs[-1]["threads_chosen"],
                                 "peak_rss_mb": max(r["peak_rss_mb"] for r in rs),
                                 "load_rss_mb": max(r["load_rss_mb"] for r in rs)}
                if "old" in row:
                    row["speedup"] = round(row["old"]["step_s"] / row["new"]["step_s"], 3)
                results.append(row)
        finally:
            if args.before:
                subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(Path(tmp) / "old")],
                               check=False, capture_output=True)
    print(json.dumps({"benchmark": "vocab_step", "before": args.before, "rounds": args.rounds,
                      "repeats": args.repeats, "results": results}))


if __name__ == "__main__":
    main()
