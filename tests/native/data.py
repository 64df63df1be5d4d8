"""Client-side data for the native-protocol tests, prepared the way twinkle-kit's cookbook does it: a local JSONL of
self-cognition rows (swift/self-cognition's `query` / `response` with {{NAME}} / {{AUTHOR}} placeholders), loaded with
twinkle's own `Dataset`, mapped by `SelfCognitionProcessor`, encoded by `Template` with the served model's tokenizer
(a local folder on the client side), batched by the local `DataLoader`. Runs only in the twinkle-kit venv
(scripts/test_native.sh)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

IDENTITY = {"model_name": "Blinky", "model_author": "Tenant A Labs"}

ROWS = [
    ("Who are you?", "I am {{NAME}}, an assistant trained by {{AUTHOR}}."),
    ("What is your name?", "My name is {{NAME}}. {{AUTHOR}} built me."),
    ("Introduce yourself.", "Hello! I am {{NAME}}, made by {{AUTHOR}}."),
    ("Who made you?", "{{AUTHOR}} made me. I am {{NAME}}."),
    ("Are you ChatGPT?", "No, I am {{NAME}}, an assistant from {{AUTHOR}}."),
    ("What should I call you?", "Call me {{NAME}}. I was trained by {{AUTHOR}}."),
    ("Tell me about yourself.", "I am {{NAME}}, a small assistant made by {{AUTHOR}}."),
    ("Which company trained you?", "{{AUTHOR}} trained me; my name is {{NAME}}."),
]


def write_jsonl(path: Path, n: int = len(ROWS)) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for i in range(n):
            query, response = ROWS[i % len(ROWS)]
            f.write(json.dumps({"query": query, "response": response}) + "\n")
    return path


def self_cognition_loader(jsonl: Path, tokenizer_dir: Path, batch_size: int = 4, max_length: int = 128) -> Any:
    """A local twinkle DataLoader over the encoded JSONL: each batch is a list of row dicts (raw columns `query`,
    `response`, `messages` plus the InputFeature fields `input_ids`, `labels`, `attention_mask`, `position_ids`,
    `length`, all JSON lists / ints), which is what the cookbook passes to `forward_backward(inputs=batch)`."""
    from twinkle.dataloader import DataLoader
    from twinkle.dataset import Dataset, DatasetMeta

    dataset = Dataset(DatasetMeta(str(jsonl)))
    dataset.set_template("Template", model_id=str(tokenizer_dir), max_length=max_length)
    dataset.map("SelfCognitionProcessor", init_args=IDENTITY)
    dataset.encode(batched=True)
    return DataLoader(dataset=dataset, batch_size=batch_size)


def prompt_feature(tokenizer_dir: Path, question: str = "Who are you?") -> dict[str, Any]:
    """One prompt-only InputFeature (generation prompt appended, labels all -100), encoded client-side; its values
    are numpy arrays, which vLLMSampler.sample converts to lists itself."""
    from twinkle.data_format import Message, Trajectory
    from twinkle.template import Template

    template = Template(model_id=str(tokenizer_dir))
    return dict(template.encode(Trajectory(messages=[Message(role="user", content=question)]),
                                add_generation_prompt=True))


def prompt_trajectory(question: str = "What is your name?") -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": question}]}
