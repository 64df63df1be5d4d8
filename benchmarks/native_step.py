"""A native (twinkle_client) training step vs a Tinker SDK step on one server, same model, batch and LoRA shape.

Native: `forward_backward` + `clip_grad_and_step` (max_grad_norm 0: no clipping), the requests twinkle_client sends
(JSON over HTTP, each call answered when done). Tinker: the stock SDK's `forward_backward` + `optim_step`. Rounds
of `--steps` steps alternate between the two on one server process; the medians of the per-round seconds per step
and their ratio (native / tinker) are printed as one JSON line.
`--model smollm2`: the embedded default (SmolLM2-135M-Instruct, converted once into $TWINKLE_BENCH_DATA, default
~/.cache/twinkle-bench); `tiny` (default): the test model, where a step is mostly the server's own overhead.
Usage: python benchmarks/native_step.py [--model tiny|smollm2] [--batch 4x64] [--steps 10] [--rounds 5] [--rank 8]
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

import httpx  # noqa: E402
import numpy as np  # noqa: E402

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"]  # Tinker's


class NativeTrainer:
    def __init__(self, base_url: str, key: str, model: str, rank: int, batch: list[list[int]]) -> None:
        auth = f"Bearer {key}"
        self.http = httpx.Client(base_url=f"{base_url}/api/v1", timeout=600,
                                 headers={"Authorization": auth, "Twinkle-Authorization": auth})
        session = self.http.post("/twinkle/create_session", json={"metadata": None}).json()["session_id"]
        self.http.headers["X-Twinkle-Session-Id"] = session
        self.url = f"/model/{model}/twinkle"
        config = {"r": rank, "lora_alpha": 32, "target_modules": TARGETS, "_TWINKLE_TYPE_": "LoraConfig"}
        self.call("create")
        self.call("add_adapter_to_model", adapter_name="a", config=json.dumps(config))
        self.call("set_loss", adapter_name="a", loss_cls="CrossEntropyLoss", reduction="sum")
        self.call("set_optimizer", adapter_name="a", optimizer_cls="AdamW", lr=1e-4, betas=[0.9, 0.95], eps=1e-12,
                  weight_decay=0.0)
        self.inputs = [{"input_ids": b[:-1], "labels": b[1:]} for b in batch]

    def call(self, op: str, **body: object) -> dict:
        r = self.http.post(f"{self.url}/{op}", json=body)
        r.raise_for_status()
        return r.json()

    def step(self) -> None:
        self.call("forward_backward", adapter_name="a", inputs=self.inputs)
        self.call("clip_grad_and_step", adapter_name="a", max_grad_norm=0.0)


def tinker_trainer(base_url: str, key: str, model: str, rank: int, batch: list[list[int]]):  # type: ignore[no-untyped-def]
    import tinker
    from tinker import types

    data = [types.Datum(model_input=types.ModelInput.from_ints(b[:-1]),
                        loss_fn_inputs={"target_tokens": b[1:], "weights": [1.0] * (len(b) - 1)}) for b in batch]
    sc = tinker.ServiceClient(base_url=base_url, api_key=key)
    tc = sc.create_lora_training_client(base_model=model, rank=rank).result()

    def step() -> None:
        fb = tc.forward_backward(data, "cross_entropy")
        opt = tc.optim_step(types.AdamParams(learning_rate=1e-4))
        fb.result()
        opt.result()

    return sc, step


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", choices=["tiny", "smollm2"], default="tiny")
    ap.add_argument("--batch", default="4x64", help="ROWSxTOKENS")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--rank", type=int, default=8)
    args = ap.parse_args()
    rows, tokens = (int(x) for x in args.batch.split("x"))
    from tests.support.server import ServerProcess
    from tests.support.tiny_model import build_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        if args.model == "tiny":
            folder = str(build_tiny_model(Path(tmp) / "tiny"))
        else:
            from workers.engine.model_assets import DEFAULT_BASE_MODEL, resolve_base_model

            cache = Path(os.environ.get("TWINKLE_BENCH_DATA", Path.home() / ".cache" / "twinkle-bench"))
            folder = str(resolve_base_model(DEFAULT_BASE_MODEL, cache))
        vocab = json.loads((Path(folder) / "config.json").read_text())["vocab_size"]
        batch = np.random.default_rng(0).integers(3, vocab, size=(rows, tokens + 1)).tolist()
        srv = ServerProcess(Path(tmp) / "data", folder)
        key = srv.create_key("bench")
        srv.start()
        try:
            native = NativeTrainer(srv.base_url, key, folder, args.rank, batch)
            sc, tinker_step = tinker_trainer(srv.base_url, key, folder, args.rank, batch)
            steps = {"native": native.step, "tinker": tinker_step}
            for fn in steps.values():  # warm-up
                fn()
            per_round: dict[str, list[float]] = {name: [] for name in steps}
            for _ in range(args.rounds):
                for name, fn in steps.items():
                    t = time.perf_counter()
                    for _ in range(args.steps):
                        fn()
                    per_round[name].append((time.perf_counter() - t) / args.steps)
        finally:
            srv.stop()
    med = {name: statistics.median(v) for name, v in per_round.items()}
    print(json.dumps({
        "benchmark": "native_step", "model": args.model, "batch": args.batch, "rank": args.rank, "steps": args.steps,
        "rounds": args.rounds, "native_step_s": round(med["native"], 4), "tinker_step_s": round(med["tinker"], 4),
        "ratio_native_over_tinker": round(med["native"] / med["tinker"], 3),
        "rounds_s": {name: [round(x, 4) for x in v] for name, v in per_round.items()},
    }))


if __name__ == "__main__":
    main()
