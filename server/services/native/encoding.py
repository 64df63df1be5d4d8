"""Chat messages -> training tokens in the gateway, the way twinkle-kit 0.5.1's `Template.encode` does it locally for
a text model (twinkle/template/base.py), with the served model's own tokenizer and chat template (no torch).

For one trajectory (`messages`, optional `tools`, `user_data`):
1. twinkle's pre-pipeline: `default_system` put first when the first message is the user's; an assistant's
   `<think>...</think>` moved into `reasoning_content` (always a string for assistants); content blocks reduced to
   the first block's text (text models); tool-call arguments given as JSON strings parsed; keys holding None dropped
   (transformers' apply_chat_template does that).
2. The chat template rendered (`add_generation_prompt`, `enable_thinking`, `tools`, bos/eos) and tokenized without
   special tokens added.
3. Labels as twinkle's TokenizeByRound gives them: -100 everywhere but the tokens of each assistant turn, from the end
   of `render(messages[:i], add_generation_prompt=True)` to the end of `render(messages[:i + 1])` (so the turn's
   end-of-turn marker is trained, its header is not); only the turns listed in `user_data`'s `key_rounds` when
   given; all -100 with `add_generation_prompt`. (Templates with `{% generation %}` marks, where twinkle uses the
   tokenizer's assistant mask instead, are not special-cased.)
4. twinkle's post-pipeline: `max_length` with `truncation_strategy` (`raise` -> EncodeError, `left`, `right`,
   `delete` -> the row is dropped), then the labels rolled left by one: `labels[i]` is the target of position i.

All texts of a batch are tokenized in one `encode_batch` call. `encode_messages` is the one-trajectory entry point
(for Trajectory inputs of the model routes); `encode_rows` serves server-held datasets.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import jinja2

from api_schemas.models import ServedModel
from api_schemas.native.features import IGNORE_INDEX
from server.services.chat_template import ChatTokenizer, chat_tokenizer

__all__ = ["DEFAULT_MAX_LENGTH", "EncodeError", "Encoded", "TemplateOptions", "encode_messages", "encode_rows",
           "tokenizer_for"]

DEFAULT_MAX_LENGTH = 8192  # twinkle Template's default
ROLES = ("system", "user", "assistant", "tool")
_MEDIA = ("images", "videos", "audios")


class EncodeError(ValueError):
    """A trajectory that cannot be encoded; the message says why (and which row, from encode_rows)."""


@dataclass(frozen=True)
class TemplateOptions:
    """twinkle Template's ctor options that change the tokens (use_chat_template is always True here)."""

    max_length: int | None = DEFAULT_MAX_LENGTH
    truncation_strategy: str = "raise"  # raise | left | right | delete
    default_system: str | None = None
    enable_thinking: bool = True


@dataclass(frozen=True)
class Encoded:
    input_ids: list[int]
    labels: list[int]  # already rolled: labels[i] is the token predicted at position i, -100 = no loss

    def feature(self) -> dict[str, Any]:
        """The InputFeature fields twinkle's encode adds to a row."""
        n = len(self.input_ids)
        return {"input_ids": self.input_ids, "labels": self.labels, "attention_mask": [1] * n,
                "position_ids": list(range(n)), "length": n}


def tokenizer_for(served: ServedModel) -> ChatTokenizer:
    return chat_tokenizer(served.tokenizer_id)


def encode_messages(served: ServedModel, messages: Sequence[Mapping[str, Any]], max_length: int | None = None,
                    truncation: str = "raise", *, tools: Sequence[Mapping[str, Any]] | None = None,
                    add_generation_prompt: bool = False, default_system: str | None = None,
                    enable_thinking: bool = True) -> tuple[list[int], list[int]]:
    """(input_ids, labels) of one trajectory's messages, labels rolled as twinkle's InputFeature holds them.
    `max_length` None means twinkle's default (8192); with one trajectory there is no row to drop, so
    `truncation="delete"` raises like "raise" does. EncodeError for anything the template cannot encode."""
    opts = TemplateOptions(max_length=DEFAULT_MAX_LENGTH if max_length is None else max_length,
                           truncation_strategy="raise" if truncation == "delete" else truncation,
                           default_system=default_system, enable_thinking=enable_thinking)
    row: dict[str, Any] = {"messages": list(messages)}
    if tools:
        row["tools"] = list(tools)
    out = encode_rows(tokenizer_for(served), [row], opts, add_generation_prompt)[0]
    assert out is not None  # only "delete" drops a row
    return out.input_ids, out.labels


def encode_rows(tok: ChatTokenizer, rows: Sequence[Mapping[str, Any]], opts: TemplateOptions,
                add_generation_prompt: bool = False) -> list[Encoded | None]:
    """Each row's encoding (None: dropped by truncation_strategy="delete"); EncodeError names the failing row."""
    if tok.template is None:
        raise EncodeError("this model has no chat template: rows with messages cannot be encoded")
    plans: list[tuple[int, list[tuple[int, int]]]] = []  # (index of the full text, [(start text, end text)])
    texts: list[str] = []
    for i, row in enumerate(rows):
        try:
            messages, tools, rounds = _prepare(row, opts)
            texts.append(_render(tok, messages, tools, add_generation_prompt, opts.enable_thinking))
            full = len(texts) - 1
            spans = []
            if not add_generation_prompt:
                for k, m in enumerate(messages):
                    if m["role"] != "assistant" or (rounds is not None and k not in rounds):
                        continue
                    if k == 0:
                        raise EncodeError("an assistant message cannot come first (nothing to answer)")
                    texts.append(_render(tok, messages[:k], tools, True, opts.enable_thinking))
                    texts.append(_render(tok, messages[: k + 1], tools, False, opts.enable_thinking))
                    spans.append((len(texts) - 2, len(texts) - 1))
            plans.append((full, spans))
        except EncodeError as e:
            raise EncodeError(f"row {i}: {e}") from None
    encodings = tok.tokenizer.encode_batch(texts, add_special_tokens=False) if texts else []
    lengths = [len(enc.ids) for enc in encodings]
    out: list[Encoded | None] = []
    for i, (full, spans) in enumerate(plans):
        ids = list(encodings[full].ids)
        labels = [IGNORE_INDEX] * len(ids)
        for start_text, end_text in spans:
            for p in range(lengths[start_text], min(lengths[end_text], len(ids))):
                labels[p] = ids[p]
        try:
            out.append(_post(ids, labels, opts))
        except EncodeError as e:
            raise EncodeError(f"row {i}: {e}") from None
    return out


def _post(ids: list[int], labels: list[int], opts: TemplateOptions) -> Encoded | None:
    limit = opts.max_length
    if limit and len(ids) > limit:
        strategy = opts.truncation_strategy
        if strategy == "delete":
            return None
        if strategy == "left":
            ids, labels = ids[-limit:], labels[-limit:]
        elif strategy == "right":
            ids, labels = ids[:limit], labels[:limit]
        else:
            raise EncodeError(f"input length {len(ids)} exceeds max_length {limit} (truncation_strategy="
                              f"{strategy!r}; set 'left', 'right' or 'delete' to cut or drop long rows)")
    if not ids:
        return None
    return Encoded(list(ids), labels[1:] + labels[:1])


def _prepare(row: Mapping[str, Any], opts: TemplateOptions) -> tuple[list[dict[str, Any]], list[Any],
                                                                      set[int] | None]:
    """twinkle's pre-pipeline for a text model: (messages, tools, key rounds or None)."""
    raw = row.get("messages")
    if not isinstance(raw, list) or not raw:
        cols = sorted(row) if isinstance(row, Mapping) else []
        raise EncodeError(f"no `messages` to encode (columns: {cols}); map a preprocessor first, e.g. "
                          "SelfCognitionProcessor or AlpacaProcessor")
    if any(row.get(k) for k in _MEDIA):
        raise EncodeError("the served models take text only (no images, videos or audios)")
    messages: list[dict[str, Any]] = []
    for m in raw:
        if not isinstance(m, Mapping) or m.get("role") not in ROLES:
            raise EncodeError(f"each message needs a role among {', '.join(ROLES)}")
        if any(m.get(k) for k in _MEDIA):
            raise EncodeError("the served models take text only (no images, videos or audios)")
        messages.append(dict(m))
    if opts.default_system and messages[0]["role"] == "user":
        messages.insert(0, {"role": "system", "content": opts.default_system})
    is_list = any(isinstance(m.get("content"), list) for m in messages if m["role"] != "system")
    out = []
    for m in messages:
        if m["role"] == "assistant":
            content = m.get("content", "")
            if "reasoning_content" not in m and isinstance(content, str) and "</think>" in content:
                m["reasoning_content"] = content.split("</think>")[0].rstrip("\n").split("<think>")[-1].lstrip("\n")
                m["content"] = content.split("</think>")[-1].lstrip("\n")
            if not isinstance(m.get("reasoning_content"), str):
                m["reasoning_content"] = ""
        if m["role"] == "user" and not is_list and isinstance(m.get("content"), str):
            # twinkle rebuilds a user message from these four keys only
            m = {"role": m["role"], "content": m["content"], "tool_calls": m.get("tool_calls"),
                 "reasoning_content": m.get("reasoning_content")}
        m["content"] = _text(m.get("content"))
        tool_calls = m.get("tool_calls")
        if isinstance(tool_calls, str):
            tool_calls = _json(tool_calls, "tool_calls") if tool_calls else []
        if tool_calls:
            m["tool_calls"] = [_tool_call(tc) for tc in tool_calls]
        elif "tool_calls" in m:
            m["tool_calls"] = tool_calls
        out.append(_aliased({k: v for k, v in m.items() if v is not None}))
    tools = row.get("tools") or []
    if not isinstance(tools, list):
        raise EncodeError("tools must be a list of tool definitions")
    return out, tools, _key_rounds(row.get("user_data"))


def _text(content: object) -> str:
    """twinkle's text-model content: a string as is; blocks -> the first block's text ('' for none)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        for block in content:
            if isinstance(block, Mapping) and block.get("type") not in (None, "text"):
                raise EncodeError("the served models take text only (no image, video or audio blocks)")
        if not content:
            return ""
        first = content[0]
        if not isinstance(first, Mapping) or not isinstance(first.get("text"), str):
            raise EncodeError("a content block needs a text")
        return str(first["text"])
    raise EncodeError("a message's content must be text or a list of text blocks")


def _tool_call(tc: object) -> dict[str, Any]:
    if not isinstance(tc, Mapping) or not isinstance(tc.get("function"), Mapping):
        raise EncodeError("a tool call needs a function {name, arguments}")
    fn = dict(tc["function"])
    args = fn.get("arguments")
    if isinstance(args, str):
        fn["arguments"] = _json(args, "tool call arguments") if args.strip() else {}
    elif not isinstance(args, Mapping):
        fn["arguments"] = {}
    return {**tc, "function": fn}


def _json(text: str, what: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        raise EncodeError(f"{what} is not valid JSON") from None


def _aliased(m: dict[str, Any]) -> dict[str, Any]:
    """transformers fills `thinking` / `reasoning_content` from whichever reasoning field a message has."""
    reasoning = next((m[k] for k in ("reasoning_content", "thinking", "reasoning") if m.get(k) is not None), None)
    return {"thinking": reasoning, **m, "reasoning_content": reasoning} if reasoning is not None else m


def _key_rounds(user_data: object) -> set[int] | None:
    if not isinstance(user_data, list):
        return None
    for entry in user_data:
        if isinstance(entry, (list, tuple)) and len(entry) == 2 and entry[0] == "key_rounds":
            value = entry[1]
            if isinstance(value, str):
                try:
                    value = json.loads(value)
                except ValueError:
                    return None
            if isinstance(value, list) and value and all(isinstance(v, int) for v in value):
                return set(value)
            return None
    return None


def _render(tok: ChatTokenizer, messages: list[dict[str, Any]], tools: list[Any], add_generation_prompt: bool,
            enable_thinking: bool) -> str:
    if not messages:
        raise EncodeError("cannot apply the chat template to an empty conversation")
    assert tok.template is not None
    try:
        return str(tok.template.render(messages=messages, tools=tools, documents=None,
                                       add_generation_prompt=add_generation_prompt, enable_thinking=enable_thinking,
                                       **tok.special))
    except jinja2.TemplateError as e:
        raise EncodeError(f"the chat template rejected these messages: {e}") from None
