"""The settings reference (docs/CONFIG.md), generated from the settings class itself: every field of
server/config.Settings with its environment variable, type, default and the comment the source gives it.

    python -m deploy.config_reference > docs/CONFIG.md

tests/unit/test_config_reference.py fails when docs/CONFIG.md is not what this prints (a setting added without
regenerating it), so the reference cannot drift from the code.
"""

from __future__ import annotations

import ast
import inspect
import sys
from typing import Literal, get_args, get_origin

from pydantic_core import PydanticUndefined

from server import config
from server.config import Settings

HEADER = """# Settings reference

Generated from `server/config.py` by `python -m deploy.config_reference > docs/CONFIG.md`; do not edit by hand.
Every setting is read from the environment variable shown (prefix `TWINKLE_`); `twinkle-server serve` and `worker`
flags of the same name override it. List settings take a comma-separated value. The Ray application's YAML
`limits` override the settings of the same names (docs/OPERATOR.md, "Cluster / Ray").

| setting | environment | type | default | meaning |
|---|---|---|---|---|
"""


def comments() -> dict[str, str]:
    """Field name -> its comment in the source: the comment on its line, else the comment block right above it."""
    source = inspect.getsource(config)
    lines = source.splitlines()
    tree = ast.parse(source)
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Settings")
    out: dict[str, str] = {}
    for node in cls.body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        line = lines[node.lineno - 1]
        text = ""
        if "  # " in line:
            text = line.split("  # ", 1)[1].strip()
        else:
            block: list[str] = []
            i = node.lineno - 2
            while i >= 0 and lines[i].strip().startswith("#"):
                block.insert(0, lines[i].strip().lstrip("#").strip())
                i -= 1
            text = " ".join(block)
        out[node.target.id] = text
    return out


def _default(name: str) -> str:
    field = Settings.model_fields[name]
    factory = field.default_factory
    if inspect.isfunction(factory) and factory.__name__ != "<lambda>" and factory.__doc__:
        return factory.__doc__.strip().splitlines()[0]  # computed where it runs (e.g. from $XDG_CACHE_HOME)
    if factory is not None:
        value = factory()  # type: ignore[call-arg]
    elif field.default is PydanticUndefined:
        return "(required)"
    else:
        value = field.default
    if isinstance(value, list):
        value = ",".join(str(v) for v in value)
    return "(unset)" if value is None else f"`{value}`" if value != "" else "(empty)"


def _type(name: str) -> str:
    annotation = Settings.model_fields[name].annotation
    if get_origin(annotation) is Literal:
        return "one of " + ", ".join(str(a) for a in get_args(annotation))
    text = str(annotation) if get_args(annotation) else getattr(annotation, "__name__", str(annotation))
    return text.replace("typing.", "").replace("pathlib.", "").replace("pydantic.types.", "")


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def reference() -> str:
    notes = comments()
    rows = [f"| `{name}` | `TWINKLE_{name.upper()}` | {_cell(_type(name))} | {_cell(_default(name))} | "
            f"{_cell(notes.get(name, ''))} |" for name in Settings.model_fields]
    return HEADER + "\n".join(rows) + "\n"


if __name__ == "__main__":
    sys.stdout.write(reference())
