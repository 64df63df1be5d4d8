"""The independent check the conformance tests make of served log-probs: transformers + PEFT on the same folders."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def assert_logprobs_match_peft(base_folder: str | Path, adapter_folder: str | Path, data: list[Any],
                               outputs: list[Any], atol: float = 1e-4) -> None:
    """Each datum's served `logprobs` (a forward's loss_fn_outputs) equal PEFT's on the saved adapter."""
    import peft
    import torch
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(base_folder), dtype=torch.float32)
    model = peft.PeftModel.from_pretrained(base, str(adapter_folder)).eval()
    for datum, out in zip(data, outputs, strict=True):
        ids = torch.tensor([datum.model_input.to_ints()])
        targets = torch.tensor(datum.loss_fn_inputs["target_tokens"].tolist())
        with torch.no_grad():
            logp = torch.log_softmax(model(input_ids=ids).logits[0].float(), dim=-1)
        expected = logp.gather(-1, targets[:, None])[:, 0]
        got = torch.tensor(out["logprobs"].tolist())
        assert torch.allclose(got, expected, atol=atol), (got - expected).abs().max()
