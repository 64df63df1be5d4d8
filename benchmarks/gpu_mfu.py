"""GPU throughput and LoRA-MFU of the training engine on Qwen3-shaped, randomly initialised base models.

For each shape (0.6B, 4B dims; `tiny` for a CPU smoke run) and each tenant count (1, 8), the engine's real path
runs: Trainer.execute_step with one forward_backward job per tenant (merged into one pass, each tenant with its
own rank-`--rank` LoRA on every linear layer incl. lm_head), then one optim_step per tenant. Every step carries
`--tokens-per-step` tokens (rows of `--seq-len` tokens, split evenly over the tenants), so 1 and 8 tenants do
the same work. Reported per case: tokens/s of the forward_backward pass and of the whole training step, and

    LoRA-MFU = 4 · N · tokens/s / peak,   peak = 989e12 (H100/H200 dense bf16)

where N counts the parameters every token passes through as matmuls (all linear layers and lm_head, the tied
embedding counted once as lm_head; the input embedding lookup is not a matmul). 4·N = forward (2N) + activation
gradients (2N): frozen base weights get no weight gradients. Attention score FLOPs are not counted (as in 6·N).
Prints one JSON line.

    python benchmarks/gpu_mfu.py --device cuda                      # 0.6b and 4b, 1 and 8 tenants, bf16
    python benchmarks/gpu_mfu.py --device cpu --shapes tiny --dtype float32 --tokens-per-step 256 --seq-len 32

On a GPU machine without a package index (torch and transformers there, not the tinker SDK, pydantic or
zstandard): run `scripts/gpu_wheels.sh` here first, carry `.whl`, and start the command with
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .whl/*.whl && export PYTHONPATH=/tmp/site || exit;
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from tests.unit.engine_jobs import create, fb, optim  # noqa: E402
from workers.checkpoints.store import CheckpointStore  # noqa: E402
from workers.engine.base_model import BaseModel  # noqa: E402
from workers.engine.multi_lora import wrap_linear_layers  # noqa: E402
from workers.engine.trainer import Trainer  # noqa: E402

PEAK_FLOPS = 989e12
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}
# Qwen3-0.6B / Qwen3-4B config.json dimensions; `tiny` keeps the architecture for a CPU run.
SHAPES = {
    "0.6b": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                 num_key_value_heads=8, head_dim=128, vocab_size=151936),
    "4b": dict(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32,
               num_key_value_heads=8, head_dim=128, vocab_size=151936),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, vocab_size=512),
}


class RandomQwen3(BaseModel):
    """A BaseModel around an in-memory, randomly initialised Qwen3 (no folder, nothing read from disk)."""

    def __init__(self, shape: str, dtype: str, device: str) -> None:
        from transformers import Qwen3Config, Qwen3ForCausalLM

        config = Qwen3Config(**SHAPES[shape], max_position_embeddings=40960, rope_theta=1_000_000.0,
                             tie_word_embeddings=True, rms_norm_eps=1e-6, attn_implementation="sdpa")
        self.name, self.folder = f"random-qwen3-{shape}", Path(".")
        self.dtype, self.device = DTYPES[dtype], torch.device(device)
        with torch.random.fork_rng(devices=[]), torch.device(self.device):
            torch.manual_seed(0)
            model = Qwen3ForCausalLM(config).to(self.dtype)
        model.eval()
        for p in model.parameters():
            p.requires_grad_(False)
        self.model = model
        self.layers = wrap_linear_layers(model)
        self.vocab_size, self.max_context = config.vocab_size, config.max_position_embeddings


def matmul_params(base: BaseModel) -> int:
    """N: weights of every linear layer (q, k, v, o, gate, up, down, lm_head)."""
    return sum(layer.base.weight.numel() for layer in base.layers.values())


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_case(trainer: Trainer, tenants: int, tokens_per_step: int, seq_len: int, rank: int, steps: int,
             warmup: int, case: int) -> dict:
    base, device = trainer.base, trainer.base.device
    rows = max(1, tokens_per_step // seq_len // tenants)
    models = [f"c{case}-t{i}" for i in range(tenants)]
    rng = np.random.default_rng(case)
    data = {m: rng.integers(3, base.vocab_size, size=(rows, seq_len + 1)).tolist() for m in models}
    for i, m in enumerate(models):
        assert trainer.execute(create(m, rank=rank, seed=i)).ok
    fb_s = step_s = 0.0
    for s in range(warmup + steps):
        fbs = [fb(m, 1 + 2 * s, data[m]) for m in models]
        sync(device)
        t0 = time.perf_counter()
        results: list = []
        trainer.execute_step(fbs, results.append)
        sync(device)
        t1 = time.perf_counter()
        bad = [r.error for r in results if not r.ok]
        assert not bad and len(results) == tenants, bad
        for m in models:
            assert trainer.execute(optim(m, 2 + 2 * s)).ok
        sync(device)
        if s >= warmup:
            fb_s += t1 - t0
            step_s += time.perf_counter() - t0
    for m in models:
        trainer.pool.drop(m)
    tokens = tenants * rows * seq_len * steps
    n = matmul_params(base)
    return {
        "tenants": tenants, "rows_per_tenant": rows, "seq_len": seq_len, "tokens_per_step": tenants * rows * seq_len,
        "fb_tokens_per_s": round(tokens / fb_s, 1), "step_tokens_per_s": round(tokens / step_s, 1),
        "lora_mfu_fb": float(f"{4 * n * tokens / fb_s / PEAK_FLOPS:.4g}"),
        "lora_mfu_step": float(f"{4 * n * tokens / step_s / PEAK_FLOPS:.4g}"),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    ap.add_argument("--shapes", default="0.6b,4b")
    ap.add_argument("--tenants", default="1,8")
    ap.add_argument("--tokens-per-step", type=int, default=16384)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--rank", type=int, default=32)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    args = ap.parse_args()
    if args.device.startswith("cuda"):
        torch.backends.cuda.matmul.allow_tf32 = True
    out: dict = {"benchmark": "gpu_mfu", "device": args.device, "dtype": args.dtype, "rank": args.rank,
                 "peak_flops": PEAK_FLOPS, "steps": args.steps, "results": []}
    if args.device.startswith("cuda"):
        out["gpu"] = torch.cuda.get_device_name(torch.device(args.device))
    case = 0
    with tempfile.TemporaryDirectory() as tmp:
        for shape in args.shapes.split(","):
            base = RandomQwen3(shape, args.dtype, args.device)
            trainer = Trainer(base, CheckpointStore(Path(tmp) / "ckpt"))
            for tenants in (int(t) for t in args.tenants.split(",")):
                if base.device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats(base.device)
                r = run_case(trainer, tenants, args.tokens_per_step, args.seq_len, args.rank, args.steps,
                             args.warmup, case)
                case += 1
                r |= {"shape": shape, "matmul_params": matmul_params(base)}
                if base.device.type == "cuda":
                    r["peak_memory_gib"] = round(torch.cuda.max_memory_allocated(base.device) / 2**30, 1)
                out["results"].append(r)
            del trainer, base
            if args.device.startswith("cuda"):
                torch.cuda.empty_cache()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
