"""The gateway's torch-free chat template rendering gives the same token ids as transformers' apply_chat_template."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from transformers import AutoTokenizer

from server.services.chat_template import ChatTokenizer

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello there!"},
     {"role": "assistant", "content": "Hello, how can I help you today?"}, {"role": "user", "content": "1 2 3"}],
]


def test_matches_transformers(tiny_model_dir: Path) -> None:
    ours = ChatTokenizer(tiny_model_dir)
    theirs = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    for messages in CONVERSATIONS:
        text = theirs.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        assert ours.render(messages) == text
        assert ours.encode_chat(messages) == theirs.encode(text, add_special_tokens=False)


def test_the_chat_template_module_does_not_import_torch() -> None:
    code = "import sys, server.services.chat_template; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0
