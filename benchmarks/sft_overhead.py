"""Gateway overhead: seconds per SFT step through the stock tinker SDK vs an in-process PEFT step, same model+batch.

Prints one JSON line. Usage: python benchmarks/sft_overhead.py [--model tiny|smollm2] [--steps 10] [--batch 4x64]
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


def peft_step_seconds(folder: str, batch: list[list[int]], rank: int, steps: int) -> float:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"]
    model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=32, target_modules=targets, lora_dropout=0.0))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4, betas=(0.9, 0.95),
                            eps=1e-12, weight_decay=0.0)
    ids = torch.tensor([b[:-1] for b in batch])
    labels = torch.tensor([b[1:] for b in batch])

    def step() -> None:
        logp = torch.log_softmax(model(input_ids=ids).logits.float(), dim=-1)
        loss = -logp.gather(-1, labels[..., None]).sum()
        loss.backward()
        opt.step()
        opt.zero_grad()

    step()  # warm-up
    t = time.perf_counter()
    for _ in range(steps):
        step()
    return (time.perf_counter() - t) / steps


def sdk_step_seconds(base_url: str, key: str, base_model: str, batch: list[list[int]], rank: int, steps: int) -> float:
    import tinker
    from tinker import types

    data = [types.Datum(model_input=types.ModelInput.from_ints(b[:-1]),
                        loss_fn_inputs={"target_tokens": b[1:], "weights": [1.0] * (len(b) - 1)}) for b in batch]
    with tinker.ServiceClient(base_url=base_url, api_key=key) as sc:
        tc = sc.create_lora_training_client(base_model=base_model, rank=rank).result()

        def step() -> None:
            fb = tc.forward_backward(data, "cross_entropy")
            opt = tc.optim_step(types.AdamParams(learning_rate=1e-4))
            fb.result()
            opt.result()

        step()
        t = time.perf_counter()
        for _ in range(steps):
            step()
        return (time.perf_counter() - t) / steps


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", choices=["tiny", "smollm2"], default="tiny")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--batch", default="4x64", help="ROWSxTOKENS")
    ap.add_argument("--rank", type=int, default=8)
    args = ap.parse_args()
    rows, tokens = (int(x) for x in args.batch.split("x"))
    from tests.support.server import ServerProcess

    with tempfile.TemporaryDirectory() as tmp:
        data_dir = Path(tmp) / "data"
        if args.model == "tiny":
            from tests.support.tiny_model import build_tiny_model

            folder = str(build_tiny_model(Path(tmp) / "tiny"))
            base_model = folder
        else:
            from workers.engine.model_assets import DEFAULT_BASE_MODEL, resolve_base_model

            cache = Path(os.environ.get("TWINKLE_BENCH_DATA", Path.home() / ".cache" / "twinkle-bench"))
            folder = str(resolve_base_model(DEFAULT_BASE_MODEL, cache))
            base_model = folder
        vocab = json.loads((Path(folder) / "config.json").read_text())["vocab_size"]
        rng = np.random.default_rng(0)
        batch = rng.integers(3, vocab, size=(rows, tokens + 1)).tolist()
        srv = ServerProcess(data_dir, base_model)
        key = srv.create_key("bench")
        srv.start()
        try:
            sdk = sdk_step_seconds(srv.base_url, key, base_model, batch, args.rank, args.steps)
        finally:
            srv.stop()
        peft = peft_step_seconds(folder, batch, args.rank, args.steps)
    print(json.dumps({
        "benchmark": "sft_overhead", "model": args.model, "batch": args.batch, "rank": args.rank, "steps": args.steps,
        "sdk_step_s": round(sdk, 4), "peft_step_s": round(peft, 4), "overhead_ratio": round(sdk / peft, 3),
    }))


if __name__ == "__main__":
    main()
