"""Shared by the example scripts: the command-line options every example takes and its final JSON summary line.
Imports no client library, so both the tinker SDK examples and the twinkle_client ones use it."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

DATA = Path(__file__).resolve().parent / "data"


def parser(description: str | None, steps: int, lr: float) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=(description or "").split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--base-url", default=os.environ.get("TWINKLE_BASE_URL", "http://127.0.0.1:8000"))
    p.add_argument("--api-key", default=os.environ.get("TWINKLE_API_KEY"),
                   help="a tml-... key (default: $TWINKLE_API_KEY)")
    p.add_argument("--base-model", default=None, help="default: the first model the server serves")
    p.add_argument("--steps", type=int, default=steps, help="optimizer steps")
    p.add_argument("--lr", type=float, default=lr, help="learning rate")
    p.add_argument("--rank", type=int, default=16, help="LoRA rank")
    p.add_argument("--seed", type=int, default=0)
    return p


def require_key(args: argparse.Namespace) -> str:
    if not args.api_key:
        raise SystemExit("no API key: pass --api-key or set TWINKLE_API_KEY (twinkle-server keys create --tenant NAME)")
    return str(args.api_key)


def read_jsonl(name: str) -> list[dict[str, Any]]:
    with open(DATA / name, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def summary(example: str, **fields: Any) -> None:
    """The last line every example prints: one JSON object (the smoke tests parse it)."""
    print(json.dumps({"example": example, **fields}, sort_keys=False), flush=True)


def served_models(base_url: str, api_key: str) -> list[str]:
    """The models of the server's capabilities, in its order (tinker SDK's RestClient)."""
    import tinker

    caps = tinker.RestClient(base_url=base_url, api_key=api_key).get_server_capabilities().result()
    return [str(m.model_name) for m in caps.supported_models]


def first_served_model(base_url: str, api_key: str) -> str:
    return served_models(base_url, api_key)[0]


def student_and_teacher(args: argparse.Namespace) -> tuple[str, str]:
    """The distillation examples' two models: --base-model / --teacher-model, by default the server's first and
    second served models (`twinkle-server serve --base-model STUDENT --base-model TEACHER`)."""
    served = served_models(args.base_url, args.api_key)
    student = args.base_model or served[0]
    teacher = args.teacher_model or next((m for m in served if m != student), None)
    if teacher is None:
        raise SystemExit(f"the server serves only {served}: start it with a second --base-model for the teacher "
                         "or pass --teacher-model")
    return student, teacher


def chat_prompt(tok: Any, question: str) -> list[int]:
    """A user question, chat-templated for the assistant's answer, as token ids."""
    text = tok.apply_chat_template([{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True)
    return list(tok.encode(text, add_special_tokens=False))


def distillation_clients(args: argparse.Namespace) -> tuple[Any, Any, Any, list[list[int]]]:
    """The distillation examples' set-up: (the student's training client, its tokenizer, a sampling client of the
    teacher base model, the first --prompts PROMPTS chat-templated); sets args.base_model / args.teacher_model to
    the two models' names."""
    import tinker

    sc = tinker.ServiceClient(base_url=args.base_url, api_key=require_key(args))
    args.base_model, args.teacher_model = student_and_teacher(args)
    tc = sc.create_lora_training_client(base_model=args.base_model, rank=args.rank, seed=args.seed).result()
    tok = tc.get_tokenizer()
    teacher = sc.create_sampling_client(base_model=args.teacher_model).result()
    return tc, tok, teacher, [chat_prompt(tok, q) for q in PROMPTS[:args.prompts]]


PROMPTS = ("Describe the sea.", "Write a line about the moon.", "What is a good breakfast?", "Name a color.",
           "Tell me about trees.", "Say something kind.", "How do birds fly?", "What is rain?")
