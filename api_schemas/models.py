"""What the gateway knows about a served base model, without loading it (vocabulary, context, names)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class ServedModel(BaseModel):
    model_config = ConfigDict(frozen=True, protected_namespaces=())

    name: str  # the HF-style name clients use as base_model
    vocab_size: int
    max_context: int
    tokenizer_id: str  # what a client passes to AutoTokenizer.from_pretrained
    arch: str | None = None
