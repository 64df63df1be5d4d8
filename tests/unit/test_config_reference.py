"""docs/CONFIG.md is what deploy/config_reference.py generates from the settings class, and every setting says
what it is for (a new setting without a comment, or without regenerating the reference, fails here)."""

from __future__ import annotations

from pathlib import Path

from deploy.config_reference import comments, reference
from server.config import Settings

DOC = Path(__file__).resolve().parents[2] / "docs" / "CONFIG.md"


def test_reference_is_up_to_date() -> None:
    assert DOC.read_text() == reference(), "regenerate: python -m deploy.config_reference > docs/CONFIG.md"


def test_every_setting_is_explained() -> None:
    notes = comments()
    assert [name for name in Settings.model_fields if not notes.get(name)] == []
    assert all(f"`TWINKLE_{name.upper()}`" in DOC.read_text() for name in Settings.model_fields)
