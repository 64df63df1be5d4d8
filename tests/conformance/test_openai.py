"""OpenAI-compatible routes with plain httpx: chat completions (plain and SSE streaming), model list, Bearer auth."""

from __future__ import annotations

import json

import httpx
import tinker
from tinker import types

from tests.support.server import ServerProcess

MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def chat(server: ServerProcess, key: str, **body: object) -> httpx.Response:
    return httpx.post(f"{server.base_url}/v1/chat/completions", json={"messages": MESSAGES, **body},
                      headers=bearer(key), timeout=120)


def stream_text(server: ServerProcess, key: str, **body: object) -> tuple[str, str | None]:
    text, finish = "", None
    with httpx.stream("POST", f"{server.base_url}/v1/chat/completions", json={"messages": MESSAGES, "stream": True,
                      **body}, headers=bearer(key), timeout=120) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    for line in lines[:-1]:
        choice = json.loads(line[len("data: ") :])["choices"][0]
        text += choice["delta"].get("content", "")
        finish = choice["finish_reason"] or finish
    return text, finish


def test_chat_completion_on_the_base_model(server: ServerProcess) -> None:
    r = chat(server, server.api_key_a, model=server.base_model, max_tokens=20, temperature=0)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion" and len(body["choices"]) == 1
    choice = body["choices"][0]
    assert choice["message"]["role"] == "assistant" and isinstance(choice["message"]["content"], str)
    assert choice["finish_reason"] in ("stop", "length")
    assert body["usage"]["completion_tokens"] <= 20 and body["usage"]["prompt_tokens"] > 5
    again = chat(server, server.api_key_a, model=server.base_model, max_tokens=20, temperature=0).json()
    assert again["choices"][0]["message"]["content"] == choice["message"]["content"]

    text, finish = stream_text(server, server.api_key_a, model=server.base_model, max_tokens=20, temperature=0)
    assert text == choice["message"]["content"] and finish == choice["finish_reason"]

    several = chat(server, server.api_key_a, model=server.base_model, max_tokens=5, n=3, seed=1).json()
    assert [c["index"] for c in several["choices"]] == [0, 1, 2]


def test_chat_completion_on_a_trained_adapter(server: ServerProcess) -> None:
    with tinker.ServiceClient(base_url=server.base_url, api_key=server.api_key_a) as sc:
        tc = sc.create_lora_training_client(base_model=server.base_model, rank=4, seed=9).result()
        tok = tc.get_tokenizer()
        target = tok.encode(" answer answer answer answer", add_special_tokens=False)
        prompt = tok.encode(tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False),
                            add_special_tokens=False)
        tokens = prompt + target
        datum = types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs={
            "target_tokens": tokens[1:], "weights": [0.0] * (len(prompt) - 1) + [1.0] * len(target)})
        for _ in range(25):
            tc.forward_backward([datum], "cross_entropy").result()
            tc.optim_step(types.AdamParams(learning_rate=5e-2)).result()
        path = tc.save_weights_for_sampler("chat").result().path
    models = httpx.get(f"{server.base_url}/v1/models", headers=bearer(server.api_key_a)).json()
    ids = [m["id"] for m in models["data"]]
    assert server.base_model in ids and path in ids
    r = chat(server, server.api_key_a, model=path, max_tokens=len(target), temperature=0)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"].startswith(" answer answer")
    text, _ = stream_text(server, server.api_key_a, model=path, max_tokens=len(target), temperature=0)
    assert text.startswith(" answer answer")
    # another tenant neither sees nor uses the adapter
    other = httpx.get(f"{server.base_url}/v1/models", headers=bearer(server.api_key_b)).json()
    assert path not in [m["id"] for m in other["data"]]
    assert chat(server, server.api_key_b, model=path, max_tokens=3).status_code == 404


def test_chat_auth_and_errors(server: ServerProcess) -> None:
    assert chat(server, "tml-not-a-key", model=server.base_model).status_code == 401
    r = httpx.post(f"{server.base_url}/v1/chat/completions", json={"model": server.base_model, "messages": MESSAGES,
                   "max_tokens": 2}, headers={"X-API-Key": server.api_key_a}, timeout=60)
    assert r.status_code == 200
    assert chat(server, server.api_key_a, model="no-such-model").status_code == 404
    assert chat(server, server.api_key_a, model=server.base_model, temperature=-1).status_code == 422
    assert chat(server, server.api_key_a, model=server.base_model, stream=True, n=2).status_code == 400
