"""server/services/native/encoding.py against twinkle-kit 0.5.1's own `Template.encode`, token for token, in the
twinkle venv: the tiny model's template, and a chat template that reads reasoning_content, enable_thinking, tools and
tool calls; key_rounds, default_system, truncation, the generation prompt. Run by scripts/test_native.sh."""

from __future__ import annotations

import copy
import shutil
from pathlib import Path
from typing import Any

import pytest
from twinkle.data_format import Trajectory
from twinkle.template import Template

from server.services.chat_template import ChatTokenizer
from server.services.native.encoding import TemplateOptions, encode_rows
from tests.native.conftest import NativeServer

THINKING_TEMPLATE = (
    "{%- if tools %}{{ '<|im_start|>system\\nTools: ' + (tools | tojson) + '<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}{%- if message.role == 'assistant' %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if message.reasoning_content %}{{ '<think>\\n' + message.reasoning_content + '\\n</think>\\n\\n' }}"
    "{%- elif loop.last and not enable_thinking %}{{ '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{{ message.content }}{%- if message.tool_calls %}{%- for tc in message.tool_calls %}"
    "{{ '<tool_call>' + tc.function.name + (tc.function.arguments | tojson) + '</tool_call>' }}{%- endfor %}"
    "{%- endif %}{{ '<|im_end|>\\n' }}{%- else %}{{- '<|im_start|>' + message.role + '\\n' + message.content + "
    "'<|im_end|>\\n' }}{%- endif %}{%- endfor %}{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{%- if not enable_thinking %}{{ '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{%- endif %}"
)
TOOLS = [{"type": "function", "function": {"name": "calc", "description": "adds", "parameters": {"a": "int"}}}]
ROWS: list[dict[str, Any]] = [
    {"messages": [{"role": "system", "content": "You are a helpful assistant."},
                  {"role": "user", "content": "Who are you?"}, {"role": "assistant", "content": "I am Blinky."}]},
    {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "<think>hmm</think>\nhello"},
                  {"role": "user", "content": "and?"}, {"role": "assistant", "content": "bye"}]},
    {"messages": [{"role": "user", "content": [{"type": "text", "text": "block text"}]},
                  {"role": "assistant", "content": "ok"}]},
    {"messages": [{"role": "user", "content": "add 1 2"},
                  {"role": "assistant", "content": "", "tool_calls": [
                      {"id": "c1", "type": "function", "function": {"name": "calc", "arguments": "{\"a\": 1}"}}]},
                  {"role": "tool", "content": "3", "tool_call_id": "c1"}, {"role": "assistant", "content": "3"}],
     "tools": TOOLS},
    {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a1"},
                  {"role": "user", "content": "q2"}, {"role": "assistant", "content": "a2"}],
     "user_data": [["key_rounds", "[3]"]]},
]
OPTIONS: list[dict[str, Any]] = [{}, {"max_length": 12, "truncation_strategy": "left"},
                                 {"max_length": 12, "truncation_strategy": "right"}, {"default_system": "SYS"},
                                 {"enable_thinking": False}]


@pytest.mark.parametrize("thinking", [False, True], ids=["tiny-template", "thinking-template"])
def test_encoding_matches_twinkle_template(native_server: NativeServer, tmp_path: Path, thinking: bool) -> None:
    folder = tmp_path / "tok"
    shutil.copytree(native_server.model_dir, folder)
    if thinking:
        (folder / "chat_template.jinja").write_text(THINKING_TEMPLATE)
    tok = ChatTokenizer(folder)
    for opts in OPTIONS:
        template = Template(model_id=str(folder), **opts)
        mine_opts = TemplateOptions(**{"max_length": 8192, **opts})
        for gen in (False, True):
            for row in ROWS:
                theirs = template.encode(Trajectory(**copy.deepcopy(row)), add_generation_prompt=gen)
                mine = encode_rows(tok, [row], mine_opts, gen)[0]
                assert mine is not None
                feature = mine.feature()
                for key in ("input_ids", "labels", "attention_mask", "position_ids"):
                    assert feature[key] == [int(x) for x in theirs[key]], (opts, gen, row, key)
                assert feature["length"] == int(theirs["length"])
