"""What the real twinkle-kit 0.5.1 client sends for the native SFT + sampling flow (test_sft_flow's calls), captured
by a tiny recording HTTP server that answers plausible JSON. Not a test: a tool for whoever implements the routes.

    ~/.cache/twinkle-server/venv-twinkle/bin/python -m tests.native.capture TOKENIZER_DIR [OUT.jsonl]

TOKENIZER_DIR: a model folder with tokenizer files (the tiny model of tests/support/tiny_model.py will do). Prints
each request (method, path, headers, JSON body; long token lists shortened) and writes them in full to OUT.jsonl.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("MODELSCOPE_OFFLINE", "1")

MODEL = "twinkle-test/tiny-llama"
RUN = "run-1"
records: list[dict[str, Any]] = []


def _answer(method: str, path: str, body: Any) -> tuple[int, Any]:
    op = path.rsplit("/", 1)[-1]
    if path.endswith("/twinkle/create_session"):
        return 200, {"session_id": "session_0123456789abcdef"}
    if path.endswith("/twinkle/session_heartbeat"):
        return 200, {}
    if path.endswith("/twinkle/get_server_capabilities"):
        return 200, {"supported_models": [{"model_name": MODEL}]}
    if path.endswith("/twinkle/training_runs"):
        run = {"training_run_id": RUN, "base_model": MODEL, "model_owner": "tenant-a", "is_lora": True, "lora_rank": 8}
        return 200, {"training_runs": [run], "cursor": {"limit": 20, "offset": 0, "total_count": 1}}
    if path.endswith("/checkpoints"):
        ck = {"checkpoint_id": "weights/sft-1", "checkpoint_type": "training", "time": "2025-01-01T00:00:00Z",
              "size_bytes": 1000, "twinkle_path": f"twinkle://{RUN}/weights/sft-1"}
        return 200, {"checkpoints": [ck], "cursor": None}
    if "/sampler/" in path:
        if op == "sample":
            seq = {"stop_reason": "length", "tokens": [5, 6], "logprobs": [[[5, -0.1]], [[6, -0.2]]], "decoded": "ab"}
            return 200, {"samples": [{"sequences": [seq]} for _ in body.get("inputs", [])]}
        return 200, {"status": "ok"}
    if op in ("forward_backward", "forward", "forward_only"):
        n = len(body.get("inputs") or [])
        return 200, {"result": {"loss": 1.5, "logps": [[-1.0] * 4] * n}}
    if op == "calculate_metric":
        return 200, {"result": {"loss": "1.5000", "grad_norm": "0.5", "iters": 1}}
    if op == "get_train_configs":
        return 200, {"result": "LoRA r=8, AdamW lr=0.01"}
    if op == "save":
        kind = "sampler_weights" if body.get("is_sampler") else "weights"
        return 200, {"twinkle_path": f"twinkle://{RUN}/{kind}/{body.get('name')}", "checkpoint_dir": None}
    if op == "resume_from_checkpoint":
        return 200, {"result": {"cur_step": 4, "consumed_train_samples": 16, "gradient_accumulation_steps": 2}}
    return 200, {"status": "ok"}


class _Recorder(BaseHTTPRequestHandler):
    def log_message(self, *args: Any) -> None:
        pass

    def _handle(self) -> None:
        raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        body = json.loads(raw) if raw else None
        url = urlsplit(self.path)
        records.append({"method": self.command, "path": url.path, "query": parse_qs(url.query),
                        "headers": dict(self.headers.items()), "body": body})
        status, answer = _answer(self.command, url.path, body if isinstance(body, dict) else {})
        out = json.dumps(answer).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    do_GET = do_POST = do_DELETE = _handle


def run_flow(base_url: str, tokenizer_dir: Path) -> None:
    from peft import LoraConfig
    from twinkle_client import init_twinkle_client
    from twinkle_client.model import MultiLoraTransformersModel
    from twinkle_client.sampler import vLLMSampler

    from tests.native.data import prompt_feature, prompt_trajectory, self_cognition_loader, write_jsonl

    loader = self_cognition_loader(write_jsonl(Path(tempfile.mkdtemp()) / "sc.jsonl"), tokenizer_dir)
    client = init_twinkle_client(base_url=base_url, api_key="tml-tenant-a-key", session_heartbeat_interval=3600)
    client.get_server_capabilities()
    model = MultiLoraTransformersModel(model_id=MODEL)
    model.add_adapter_to_model("default", LoraConfig(r=8, target_modules="all-linear"), gradient_accumulation_steps=2)
    model.set_template("Template")
    model.set_processor("InputProcessor", padding_side="right")
    model.set_loss("CrossEntropyLoss")
    model.set_optimizer("AdamW", lr=1e-2)
    model.set_lr_scheduler("CosineWarmupScheduler", num_warmup_steps=1, num_training_steps=4)
    batch = next(iter(loader))
    model.forward_backward(inputs=batch)
    model.clip_grad_and_step()
    model.calculate_metric(is_training=True)
    model.get_train_configs()
    saved = model.save("sft-1", save_optimizer=True, consumed_train_samples=16)
    client.list_training_runs()
    client.list_checkpoints(RUN)
    again = MultiLoraTransformersModel(model_id=MODEL)
    again.add_adapter_to_model("resumed", LoraConfig(r=8, target_modules="all-linear"), gradient_accumulation_steps=2)
    again.resume_from_checkpoint(saved.twinkle_path)
    again.load(saved.twinkle_path)
    sampler_path = model.save("sft-1-sampler", is_sampler=True).twinkle_path
    sampler = vLLMSampler(model_id=MODEL)
    sampler.set_template("Template", model_id=MODEL)
    params = {"max_tokens": 4, "temperature": 0, "logprobs": 1}
    sampler.sample(inputs=[prompt_feature(tokenizer_dir)], sampling_params=params, adapter_uri=sampler_path)
    sampler.sample(inputs=[prompt_trajectory()], sampling_params=params, adapter_uri=sampler_path)
    model.apply_patch("ms://x/y")
    client.close()


def _short(value: Any) -> Any:
    if isinstance(value, list) and len(value) > 6 and all(isinstance(v, (int, float)) for v in value):
        return value[:4] + [f"... {len(value)} items"]
    if isinstance(value, list):
        return [_short(v) for v in value]
    if isinstance(value, dict):
        return {k: _short(v) for k, v in value.items()}
    return value


def main() -> None:
    tokenizer_dir = Path(sys.argv[1])
    out = Path(sys.argv[2]) if len(sys.argv) > 2 else Path("native-requests.jsonl")
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Recorder)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    run_flow(f"http://127.0.0.1:{server.server_port}", tokenizer_dir)
    server.shutdown()
    with open(out, "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
    for r in records:
        print(f"{r['method']} {r['path']} {r['query'] or ''}")
        print("  headers:", json.dumps({k: v for k, v in r["headers"].items()
                                        if k.lower() not in ("host", "user-agent", "accept-encoding", "accept",
                                                             "connection", "content-length")}))
        print("  body:", json.dumps(_short(r["body"])))


if __name__ == "__main__":
    main()
