"""Target-token log-probs from the last hidden states, a chunk of positions at a time.

The merged pass needs, per real (unpadded) position, the log-prob of a few target tokens: log_softmax(logits)[t].
Materialising log_softmax over the whole vocabulary costs (tokens x vocab) floats several times over (the logits,
the log-probs, a dense gradient of the gather, the log-softmax backward), and on a small model with a large
vocabulary that traffic is nearly the whole step. Here the head is applied to a chunk of positions at a time inside
one autograd Function:
- forward: logits of the chunk (the model dtype, as the model would compute them, then float32, or float64 for a
  float64 model), their logsumexp and the targets' logits; only the (positions,) logsumexp is kept;
- backward: the chunk's softmax = exp(logits - lse) is read back (kept by forward while the pass's kept softmax
  stays within KEEP_FLOATS: held once, never beside the logits) or recomputed (one more head matmul, costly for a
  wide hidden size), and the gradient of the targets' log-probs with respect to the logits is
  `onehot(t) * g - softmax * sum(g)`, built chunk by chunk; it flows to the hidden states,
  to the head's weight when it is trained (a full-parameter run) and to the head's LoRA term (train_unembed).
  Positions the loss gives no weight (prompt tokens of SFT and RL) have no gradient and are skipped.
So at most one chunk of (positions x vocab) floats is alive, never the whole pass, and padding positions cost
nothing. The gradients are the same as autograd's through log_softmax + gather (tests/unit/test_head_logprobs.py,
float64 to 1e-9).

Only architectures whose causal-LM head is exactly `lm_head(final hidden state)` take this path (`plain_head`); any
other (logit soft-capping, logit scales, biases) computes full logits as before. So does a pass whose logits are
small (at most FULL_FLOATS: a small vocabulary or a few positions): there the traffic saved is nothing, and the
chunked path's Python per segment and recomputed head matmul made the tests' tiny model's 4x512-token step ~10%
slower.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from workers.engine.multi_lora import LoraLinear, head_terms

# model types whose CausalLM forward is `logits = lm_head(model(...).last_hidden_state)`, nothing else
PLAIN_HEAD_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3", "smollm3"})
CHUNK_FLOATS = 1 << 21  # logits floats per chunk (8 MiB in float32) per 128 of hidden size (wider: bigger matmuls)
KEEP_FLOATS = 1 << 26  # softmax floats a pass may keep for backward (256 MiB in float32), instead of recomputing
FULL_FLOATS = 1 << 20  # a pass with at most this many logits floats (4 MiB in float32) computes them whole
KEEP_MIN_HIDDEN = 256  # below this hidden size recomputing a chunk's logits is cheaper than keeping its softmax


def plain_head(model: nn.Module) -> bool:
    """Whether `model`'s logits are its lm_head applied to its backbone's last hidden state and nothing more."""
    cfg = getattr(model, "config", None)
    head = getattr(model, "lm_head", None)
    linear = head.base if isinstance(head, LoraLinear) else head
    return (getattr(cfg, "model_type", None) in PLAIN_HEAD_TYPES and isinstance(linear, nn.Linear)
            and linear.bias is None and isinstance(getattr(model, "model", None), nn.Module)
            and getattr(cfg, "final_logit_softcapping", None) is None)


def wide_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype log-probs are computed in: float64 for a float64 model, float32 otherwise."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def target_logprobs(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                    targets: torch.Tensor) -> torch.Tensor:
    """log p(targets) at every real position: (real positions, targets per position), positions in row-major
    order of `attention_mask` (right-padded rows). `targets` is (rows, width, k). Chunked when `plain_head(model)`."""
    keep = attention_mask.bool()
    if not plain_head(model) or input_ids.numel() * model.lm_head.weight.shape[0] <= FULL_FLOATS:
        logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits
        logp = torch.log_softmax(logits.to(wide_dtype(logits.dtype)), dim=-1)
        return logp.gather(-1, targets)[keep]
    hidden = model.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
    head = model.lm_head
    weight = head.base.weight if isinstance(head, LoraLinear) else head.weight
    rows = hidden.shape[0]
    vocab, hidden_size = weight.shape
    chunk = max(1, CHUNK_FLOATS // vocab) * max(1, hidden_size // 128)
    pieces: list[torch.Tensor] = []
    room = [KEEP_FLOATS if torch.is_grad_enabled() and hidden_size >= KEEP_MIN_HIDDEN else 0]

    def segment(start: int, stop: int, low: torch.Tensor | None, up: torch.Tensor | None) -> None:
        if start >= stop:
            return
        k = keep[start:stop]
        lo = None if low is None else low[k]
        floats = int(k.sum()) * vocab
        kept = floats <= room[0]
        room[0] -= floats if kept else 0
        pieces.append(_TargetLogprobs.apply(hidden[start:stop][k], weight, lo, up, targets[start:stop][k], chunk, kept))

    row = 0
    terms = head_terms(head, hidden) if isinstance(head, LoraLinear) else []
    for route, low, up in terms:  # rows whose adapter trains the head: its low-rank term rides along
        segment(row, route.start, None, None)
        segment(route.start, min(route.stop, rows), low, up)
        row = min(route.stop, rows)
    segment(row, rows, None, None)
    return torch.cat(pieces)


def _logits(hidden: torch.Tensor, weight: torch.Tensor, low: torch.Tensor | None, up: torch.Tensor | None,
            wide: torch.dtype) -> torch.Tensor:
    """The head's logits for a chunk, computed as the model's layers compute them (base term, then the LoRA term)."""
    logits = hidden @ weight.t()
    if low is not None and up is not None:
        logits = logits.addmm_(low, up.t())
    return logits.to(wide)


class _TargetLogprobs(torch.autograd.Function):
    """(positions, H) hidden, (V, H) head weight, optional (positions, r) LoRA low-rank input with its (V, r) B,
    (positions, k) targets -> (positions, k) log-probs; see the module docstring."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, low: torch.Tensor | None,
                up: torch.Tensor | None, targets: torch.Tensor, chunk: int, keep: bool) -> torch.Tensor:
        wide = wide_dtype(hidden.dtype)
        n = hidden.shape[0]
        out = torch.empty(n, targets.shape[1], dtype=wide, device=hidden.device)
        lse = torch.empty(n, dtype=wide, device=hidden.device)
        probs = torch.empty(n, weight.shape[0], dtype=wide, device=hidden.device) if keep else None
        for s in range(0, n, chunk):
            e = min(n, s + chunk)
            logits = _logits(hidden[s:e], weight, None if low is None else low[s:e], up, wide)
            picked = logits.gather(1, targets[s:e])
            top = logits.amax(dim=1, keepdim=True)
            p = logits.sub_(top).exp_()  # in place: one pass over the chunk's (positions x vocab)
            total = p.sum(dim=1, keepdim=True)
            lse[s:e] = (total.log() + top).squeeze(1)
            out[s:e] = picked - lse[s:e, None]
            if probs is not None:
                torch.div(p, total, out=probs[s:e])
        ctx.save_for_backward(hidden, weight, low, up, targets, lse, probs)
        ctx.chunk = chunk
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        hidden, weight, low, up, targets, lse, probs = ctx.saved_tensors
        need_h, need_w, need_low, need_up = ctx.needs_input_grad[:4]
        g_h = torch.zeros_like(hidden) if need_h else None
        g_w = torch.zeros_like(weight) if need_w else None
        g_low = torch.zeros_like(low) if need_low else None
        g_up = torch.zeros_like(up) if need_up else None
        # positions whose log-probs the loss does not weigh (prompt tokens, padding of k) add nothing: skip them
        live = grad.ne(0).any(dim=1).nonzero().squeeze(1)
        if live.numel() < hidden.shape[0]:
            hidden, targets, lse, grad = hidden[live], targets[live], lse[live], grad[live]
            low = None if low is None else low[live]
        grad = grad.to(lse.dtype)
        d_h = None if g_h is None else torch.empty_like(hidden)
        d_low = None if g_low is None or low is None else torch.empty_like(low)
        for s in range(0, hidden.shape[0], ctx.chunk):
            e = min(hidden.shape[0], s + ctx.chunk)
            lo = None if low is None else low[s:e]
            scale = -grad[s:e].sum(1, keepdim=True)
            if probs is None:  # recomputed: one more head matmul
                d = _logits(hidden[s:e], weight, lo, up, lse.dtype).sub_(lse[s:e, None]).exp_().mul_(scale)
            else:  # the kept rows of this chunk (a chunk's copy, never the whole softmax again)
                d = probs[live[s:e]] * scale
            d.scatter_add_(1, targets[s:e], grad[s:e])  # -softmax * sum(g) + g at the targets: d log p(t) / d logits
            d = d.to(hidden.dtype)
            if d_h is not None:
                torch.mm(d, weight, out=d_h[s:e])
            if g_w is not None:
                g_w.addmm_(d.t(), hidden[s:e])
            if d_low is not None:
                torch.mm(d, up, out=d_low[s:e])
            if g_up is not None:
                g_up.addmm_(d.t(), lo)
        if g_h is not None and d_h is not None:
            g_h.index_copy_(0, live, d_h)
        if g_low is not None and d_low is not None:
            g_low.index_copy_(0, live, d_low)
        return g_h, g_w, g_low, g_up, None, None, None
