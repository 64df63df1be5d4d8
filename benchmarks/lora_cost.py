"""Cost of a LoRA training pass relative to a forward pass: time(forward+backward) / time(forward), same batch.

With LoRA the base weights are frozen, so backward computes activation gradients (about one more forward's
worth of matmuls) plus the tiny adapter gradients, but no weight gradients: the ratio should be close to 2
(full fine-tuning: close to 3). This is the accounting behind LoRA-MFU = 4·N·tokens (benchmarks/gpu_mfu.py).
Two levels are timed, interleaved, median of the repeats:
- `engine`: Trainer.execute of a forward-only job vs a forward_backward job (loss, outputs, accumulation included);
- `base_pass`: the base model's log-probabilities under no_grad vs the same plus autograd.grad to the adapter.
Prints one JSON line. Usage: python benchmarks/lora_cost.py [--model tiny|smollm2] [--batch 8x128] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from benchmarks.merged_step import model_folder  # noqa: E402
from tests.unit.engine_jobs import create, fb  # noqa: E402
from workers.checkpoints.store import CheckpointStore  # noqa: E402
from workers.engine.base_model import BaseModel  # noqa: E402
from workers.engine.multi_lora import Route, routed  # noqa: E402
from workers.engine.trainer import Trainer  # noqa: E402


def timed(fn: Callable[[], None]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", choices=["tiny", "smollm2"], default="tiny")
    ap.add_argument("--batch", default="8x128", help="ROWSxTOKENS")
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    rows, tokens = (int(x) for x in args.batch.split("x"))
    with tempfile.TemporaryDirectory() as tmp:
        trainer = Trainer(BaseModel(args.model, model_folder(args.model, Path(tmp))), CheckpointStore(Path(tmp) / "c"))
        base = trainer.base
        assert trainer.execute(create("m", rank=args.rank)).ok
        data = np.random.default_rng(0).integers(3, base.vocab_size, size=(rows, tokens + 1)).tolist()
        adapter = trainer.pool.get("m")
        ids = torch.tensor([r[:-1] for r in data], device=base.device)
        mask = torch.ones_like(ids)
        targets = torch.tensor([r[1:] for r in data], device=base.device)[..., None]

        def engine(forward_only: bool) -> Callable[[], None]:
            def run() -> None:
                assert trainer.execute(fb("m", 1, data, forward_only=forward_only)).ok

            return run

        def model_forward() -> None:
            with torch.no_grad(), routed(base.layers, [Route("m", 0, rows)]):
                base.logprob_logits(ids, mask).gather(-1, targets).sum()

        def model_forward_backward() -> None:
            with routed(base.layers, [Route("m", 0, rows)]):
                loss = -base.logprob_logits(ids, mask).gather(-1, targets).sum()
            torch.autograd.grad(loss, adapter.params, allow_unused=True)

        pairs = {"engine": (engine(True), engine(False)), "base_pass": (model_forward, model_forward_backward)}
        for f, fbk in pairs.values():  # warm-up
            f(), fbk()
        times: dict[str, tuple[list[float], list[float]]] = {k: ([], []) for k in pairs}
        for _ in range(args.repeats):
            for name, (f, fbk) in pairs.items():
                times[name][0].append(timed(f))
                times[name][1].append(timed(fbk))
    result: dict[str, object] = {"benchmark": "lora_cost", "model": args.model, "batch": args.batch,
                                 "rank": args.rank, "repeats": args.repeats, "torch_threads": torch.get_num_threads()}
    for name, (fwd, fwd_bwd) in times.items():
        f, fbk = statistics.median(fwd), statistics.median(fwd_bwd)
        result[name] = {"forward_s": round(f, 4), "forward_backward_s": round(fbk, 4), "ratio": round(fbk / f, 3)}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
