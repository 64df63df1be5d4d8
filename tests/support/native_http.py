"""The native (twinkle_client) protocol's requests as that client sends them, over plain HTTP, for the conformance
tests (tests/native drives the same routes with the real client in its own venv)."""

from __future__ import annotations

import json

import httpx
import numpy as np

from tests.support.server import ServerProcess

LORA = json.dumps({"peft_type": "LORA", "r": 8, "lora_alpha": 32, "target_modules": "all-linear",
                   "lora_dropout": 0.0, "use_rslora": False, "peft_version": "0.17.1", "some_future_key": 1,
                   "_TWINKLE_TYPE_": "LoraConfig"})


class Native:
    """The requests twinkle_client makes (its headers, its bodies)."""

    def __init__(self, server: ServerProcess, key: str) -> None:
        self.http = httpx.Client(base_url=f"{server.base_url}/api/v1", timeout=120,
                                 headers={"Authorization": f"Bearer {key}", "Twinkle-Authorization": f"Bearer {key}",
                                          "x-request-id": "20261202_000000-abcdef12",
                                          "serve_multiplexed_model_id": "20261202_000000-abcdef12"})
        self.model = server.base_model
        r = self.http.post("/twinkle/create_session", json={"metadata": None})
        assert r.status_code == 200, r.text
        self.session = r.json()["session_id"]
        self.http.headers["X-Twinkle-Session-Id"] = self.session

    def op(self, op: str, **body: object) -> httpx.Response:
        return self.http.post(f"/model/{self.model}/twinkle/{op}", json=body)

    def ok(self, op: str, **body: object) -> dict:
        r = self.op(op, **body)
        assert r.status_code == 200, (op, r.status_code, r.text)
        return r.json()


def rows(seed: int = 0, n: int = 4) -> list[dict]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        ids = rng.integers(5, 200, size=12).tolist()
        labels = [-100] * 4 + ids[5:] + [-100]  # shifted: position i predicts ids[i + 1]
        out.append({"input_ids": ids, "labels": labels, "attention_mask": [1] * 12, "position_ids": list(range(12)),
                    "length": 12, "messages": [{"role": "user", "content": "x"}]})
    return out


def setup_adapter(c: Native, name: str = "default", gas: int = 2) -> None:
    assert c.ok("create") == {"status": "ok"}
    assert c.ok("add_adapter_to_model", adapter_name=name, config=LORA, gradient_accumulation_steps=gas)[
        "adapter_name"] == name
    c.ok("set_template", template_cls="Template", adapter_name=name, model_id=c.model, max_length=512)
    c.ok("set_processor", processor_cls="InputProcessor", adapter_name=name, padding_side="right")
    c.ok("set_loss", loss_cls="CrossEntropyLoss", adapter_name=name)
    c.ok("set_optimizer", optimizer_cls="AdamW", adapter_name=name, lr=1e-2)
    c.ok("set_lr_scheduler", scheduler_cls="CosineWarmupScheduler", adapter_name=name, num_warmup_steps=1,
         num_training_steps=40)
