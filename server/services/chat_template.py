"""Chat templates and tokenization in the gateway, without torch: `tokenizers` for the vocabulary and jinja2 for
the model's chat template, rendered the way transformers' apply_chat_template renders it."""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from server.errors import BadRequest


def _raise(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _token_text(value: Any) -> str:
    if isinstance(value, dict):
        return str(value.get("content", ""))
    return str(value or "")


class ChatTokenizer:
    """One served model's tokenizer and chat template, loaded from its (local) tokenizer folder."""

    def __init__(self, folder: Path) -> None:
        self.tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
        cfg_path = folder / "tokenizer_config.json"
        cfg: dict[str, Any] = json.loads(cfg_path.read_text()) if cfg_path.exists() else {}
        source = cfg.get("chat_template")
        if isinstance(source, list):  # named templates: use the default one
            source = next((t["template"] for t in source if t.get("name") == "default"), None)
        if (folder / "chat_template.jinja").exists():
            source = (folder / "chat_template.jinja").read_text()
        self.special = {"bos_token": _token_text(cfg.get("bos_token")), "eos_token": _token_text(cfg.get("eos_token"))}
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals.update(raise_exception=_raise, strftime_now=lambda fmt: datetime.now().strftime(fmt))
        self.template = env.from_string(source) if source else None

    def render(self, messages: list[dict[str, str]]) -> str:
        if self.template is None:
            raise BadRequest("this model has no chat template; use the Tinker sampling API with token ids")
        try:
            return self.template.render(messages=messages, add_generation_prompt=True, tools=None, **self.special)
        except jinja2.TemplateError as e:
            raise BadRequest(f"the chat template rejected these messages: {e}") from e

    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        return list(self.tokenizer.encode(self.render(messages), add_special_tokens=False).ids)

    def decode(self, ids: list[int], skip_special: bool = True) -> str:
        return str(self.tokenizer.decode(ids, skip_special_tokens=skip_special))


@lru_cache(maxsize=8)
def chat_tokenizer(tokenizer_id: str) -> ChatTokenizer:
    folder = Path(tokenizer_id)
    if not (folder / "tokenizer.json").exists():  # a hub id: tokenizer files only, from the local cache if offline
        from huggingface_hub import snapshot_download

        folder = Path(snapshot_download(tokenizer_id, allow_patterns=["tokenizer*", "chat_template*", "special_*"]))
    return ChatTokenizer(folder)
