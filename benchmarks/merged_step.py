"""Merged vs sequential training steps: N tenants' forward_backward in one merged pass vs one pass per tenant.

One training step per tenant = forward_backward (cross_entropy) + optim_step (`speedup`; `fb_only_speedup` times
the forward_backward passes alone). Sequential runs each tenant's
forward_backward alone (how most open servers train); merged lets the worker's scheduler pack them into steps under the engine's token
budget (one step when they fit) and runs each step as one merged pass (Trainer.execute_step). Both run on the same Trainer, interleaved (A B A B ...), and the median of the repeats
is reported, so load from other processes hits both sides alike. Timing starts once the trainer's thread choice has
measured its candidates on both sides' pass sizes (what a running server has done). Prints one JSON line.

Usage: python benchmarks/merged_step.py [--model tiny|smollm2] [--shapes 16x64,16x16,4x512,4x8x512] [--repeats 5]
A shape is TENANTSxTOKENS (one row per tenant) or TENANTSxROWSxTOKENS.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from api_schemas.jobs import Job  # noqa: E402
from tests.unit.engine_jobs import create, fb, optim  # noqa: E402
from workers.checkpoints.store import CheckpointStore  # noqa: E402
from workers.engine.base_model import BaseModel  # noqa: E402
from workers.engine.trainer import Trainer  # noqa: E402
from workers.engine.threads import TRIALS  # noqa: E402
from workers.scheduler import Scheduler  # noqa: E402


MODELS = ["tiny", "qwen3-49k", "smollm2"]


def model_folder(name: str, tmp: Path) -> Path:
    """tiny: the tests' tiny Llama; qwen3-49k: a 6.4 M-parameter Qwen3 (hidden 64, 2 layers) with SmolLM2's
    49,152-token vocabulary (the tiny tokenizer: its ids are a prefix of that vocabulary); smollm2: the embedded
    default. The last two are kept under $TWINKLE_BENCH_DATA (default ~/.cache/twinkle-bench)."""
    if name == "tiny":
        from tests.support.tiny_model import build_tiny_model

        return build_tiny_model(tmp / "tiny")
    cache = Path(os.environ.get("TWINKLE_BENCH_DATA", Path.home() / ".cache" / "twinkle-bench"))
    if name == "qwen3-49k":
        return _qwen3_49k(cache / "qwen3-49k")
    from workers.engine.model_assets import DEFAULT_BASE_MODEL, resolve_base_model

    return resolve_base_model(DEFAULT_BASE_MODEL, cache)


def _qwen3_49k(folder: Path) -> Path:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from tests.support.tiny_model import train_tokenizer

    if (folder / "tokenizer.json").exists():
        return folder
    config = Qwen3Config(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
                         tie_word_embeddings=False)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = Qwen3ForCausalLM(config).to(torch.float32)
    model.save_pretrained(folder, safe_serialization=True)
    train_tokenizer(384).save_pretrained(folder)
    return folder


def parse_shape(shape: str) -> tuple[int, int, int]:
    parts = [int(x) for x in shape.split("x")]
    return (parts[0], 1, parts[1]) if len(parts) == 2 else (parts[0], parts[1], parts[2])


class Bench:
    def __init__(self, trainer: Trainer, tenants: int, rows: int, tokens: int, vocab: int, rank: int,
                 budget: int) -> None:
        self.trainer, self.tenants, self.budget = trainer, tenants, budget
        self.models = [f"bench-{tenants}x{rows}x{tokens}-{i}" for i in range(tenants)]
        rng = np.random.default_rng(0)
        self.rows = {m: rng.integers(3, vocab, size=(rows, tokens + 1)).tolist() for m in self.models}
        for i, m in enumerate(self.models):
            assert trainer.execute(create(m, rank=rank, seed=i)).ok
        self.seq = 1

    def _jobs(self) -> tuple[list[Job], list[Job]]:
        fbs = [fb(m, self.seq, self.rows[m]) for m in self.models]
        opts = [optim(m, self.seq + 1) for m in self.models]
        self.seq += 2
        return fbs, opts

    def sequential(self) -> tuple[float, float]:
        """(seconds of the forward_backward passes, seconds of the whole training step)"""
        fbs, opts = self._jobs()
        t = time.perf_counter()
        fb_s = 0.0
        for f, o in zip(fbs, opts):
            t0 = time.perf_counter()
            assert self.trainer.execute(f).ok
            fb_s += time.perf_counter() - t0
            assert self.trainer.execute(o).ok
        return fb_s, time.perf_counter() - t

    def merged(self) -> tuple[float, float]:
        fbs, opts = self._jobs()
        t = time.perf_counter()
        results: list = []
        # what the worker does: the scheduler packs the waiting jobs into steps under the token budget
        scheduler = Scheduler(gap_timeout=1e9, token_budget=self.budget, measure=self.trainer.measure)
        for job in fbs:
            scheduler.resume(job.model_id, job.seq_id)
            assert scheduler.add(job, now=0) is None
        while (step := scheduler.next_step(now=0)) is not None:
            self.trainer.execute_step(list(step.jobs), results.append)
        assert all(r.ok for r in results) and len(results) == len(fbs)
        fb_s = time.perf_counter() - t
        for o in opts:
            assert self.trainer.execute(o).ok
        return fb_s, time.perf_counter() - t


def warm_up_rounds(trainer: Trainer) -> int:
    """Rounds before timing: one, plus those in which the trainer's thread choice tries each candidate count on a
    new size class (workers/engine/threads.py), as a server does on its first passes of each size."""
    chooser = trainer.threads
    return 1 + (0 if chooser.fixed else TRIALS * len(chooser.candidates))


def run_shape(trainer: Trainer, shape: str, vocab: int, rank: int, repeats: int, budget: int) -> dict:
    tenants, rows, tokens = parse_shape(shape)
    bench = Bench(trainer, tenants, rows, tokens, vocab, rank, budget)
    for _ in range(warm_up_rounds(trainer)):
        bench.sequential(), bench.merged()
    seq, mer = [], []
    for _ in range(repeats):
        seq.append(bench.sequential())
        mer.append(bench.merged())
    s, m = statistics.median(x[1] for x in seq), statistics.median(x[1] for x in mer)
    s_fb, m_fb = statistics.median(x[0] for x in seq), statistics.median(x[0] for x in mer)
    total = tenants * rows * tokens
    return {"shape": shape, "tenants": tenants, "rows_per_tenant": rows, "tokens_per_row": tokens,
            "sequential_s": round(s, 4), "merged_s": round(m, 4), "speedup": round(s / m, 3),
            "sequential_tokens_per_s": round(total / s, 1), "merged_tokens_per_s": round(total / m, 1),
            "fb_only_speedup": round(s_fb / m_fb, 3)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", choices=MODELS, default="tiny")
    ap.add_argument("--shapes", default="16x64,16x16,4x512,4x8x512")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--token-budget", type=int, default=0, help="padded tokens per merged pass (0: the engine's)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        folder = model_folder(args.model, Path(tmp))
        trainer = Trainer(BaseModel(args.model, folder), CheckpointStore(Path(tmp) / "ckpt"))
        budget = args.token_budget or trainer.token_budget
        results = [run_shape(trainer, s, trainer.base.vocab_size, args.rank, args.repeats, budget)
                   for s in args.shapes.split(",")]
    print(json.dumps({"benchmark": "merged_step", "model": args.model, "rank": args.rank, "repeats": args.repeats,
                      "token_budget": budget, "torch_threads": torch.get_num_threads(), "results": results}))


if __name__ == "__main__":
    main()
