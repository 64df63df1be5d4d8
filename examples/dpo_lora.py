"""DPO on a LoRA adapter with the stock tinker SDK (tinker==0.38.0).

Pairs from data/dpo_pairs.jsonl (a prompt, a helpful `chosen` answer, a curt `rejected` one), chat-templated with
`tc.get_tokenizer()`. The reference is the base model: its per-token logprobs come once from a base-model
SamplingClient's `compute_logprobs`. The DPO loss is what a Tinker user writes: a plain Python callable given to
`forward_backward_custom` (the SDK runs a forward, computes the loss and its gradient client-side with torch, then
sends a weighted cross_entropy backward; works on any Tinker service):

    loss = -logsigmoid(beta * ((logp_c - ref_c) - (logp_r - ref_r)))      averaged over pairs

(The server also runs such a loss server-side in one pass: `ServiceClient.create_custom_loss`, docs/USER_GUIDE.md "Losses".)
Signal: the DPO loss (ln 2 = 0.693 at step 0, where the policy is the reference), the mean reward margin and the
share of pairs ranked right, each step.

    TWINKLE_API_KEY=tml-... python examples/dpo_lora.py --steps 20

Last line: {"example": "dpo_lora", "first_loss": ..., "last_loss": ..., "last_margin": ..., "last_accuracy": ...}
"""

from __future__ import annotations

import tinker
import torch
from tinker import types

from _common import first_served_model, parser, read_jsonl, require_key, summary


def chat_tokens(tok, messages, add_generation_prompt=False):  # type: ignore[no-untyped-def]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    return tok.encode(text, add_special_tokens=False)


def completion_datum(tok, prompt: str, answer: str) -> tuple[types.Datum, torch.Tensor]:  # type: ignore[no-untyped-def]
    """The datum of prompt + answer and the mask of the answer's target positions."""
    user = [{"role": "user", "content": prompt}]
    head = chat_tokens(tok, user, add_generation_prompt=True)
    full = chat_tokens(tok, user + [{"role": "assistant", "content": answer}])
    mask = torch.tensor([0.0] * (len(head) - 1) + [1.0] * (len(full) - len(head)))
    datum = types.Datum(model_input=types.ModelInput.from_ints(full[:-1]),
                        loss_fn_inputs={"target_tokens": full[1:], "weights": mask.tolist()})
    return datum, mask


def build_pairs(tok, rows, swap: bool = False):  # type: ignore[no-untyped-def]
    """[chosen, rejected, chosen, rejected, ...] datums and masks; swap=True prefers the `rejected` answers."""
    data, masks = [], []
    for r in rows:
        good, bad = (r["rejected"], r["chosen"]) if swap else (r["chosen"], r["rejected"])
        for answer in (good, bad):
            d, m = completion_datum(tok, r["prompt"], answer)
            data.append(d)
            masks.append(m)
    return data, masks


def reference_logprobs(sampler, data):  # type: ignore[no-untyped-def]
    """Per-target-token logprobs of the base model (compute_logprobs answers [None, lp1, lp2, ...])."""
    futures = []
    for d in data:
        tokens = d.model_input.to_ints() + [d.loss_fn_inputs["target_tokens"].tolist()[-1]]
        futures.append(sampler.compute_logprobs(types.ModelInput.from_ints(tokens)))
    return [torch.tensor(f.result()[1:], dtype=torch.float32) for f in futures]


def dpo_loss_fn(ref, masks, beta: float, stats: dict):  # type: ignore[no-untyped-def]
    """The callable for forward_backward_custom; `stats` receives the step's margin and accuracy."""

    def loss_fn(data, logprobs):  # type: ignore[no-untyped-def]
        rewards = [((lp - r) * m).sum() for lp, r, m in zip(logprobs, ref, masks)]
        margins = torch.stack([rewards[i] - rewards[i + 1] for i in range(0, len(rewards), 2)])
        loss = -torch.nn.functional.logsigmoid(beta * margins).mean()
        stats.update(margin=float(margins.detach().mean()), accuracy=float((margins.detach() > 0).float().mean()))
        return loss, {"dpo_loss": float(loss.detach())}

    return loss_fn


def train_dpo(sc, base: str, args, swap: bool = False, label: str = "") -> dict:  # type: ignore[no-untyped-def]
    tc = sc.create_lora_training_client(base_model=base, rank=args.rank, seed=args.seed).result()
    tok = tc.get_tokenizer()
    data, masks = build_pairs(tok, read_jsonl("dpo_pairs.jsonl"), swap=swap)
    ref = reference_logprobs(sc.create_sampling_client(base_model=base).result(), data)
    stats: dict = {}
    loss_fn = dpo_loss_fn(ref, masks, args.beta, stats)
    losses, margins, accuracies = [], [], []
    for step in range(args.steps):
        out = tc.forward_backward_custom(data, loss_fn).result()
        tc.optim_step(types.AdamParams(learning_rate=args.lr)).result()
        losses.append(out.metrics["dpo_loss"])
        margins.append(stats["margin"])
        accuracies.append(stats["accuracy"])
        print(f"{label}step {step:3d}  dpo_loss {losses[-1]:.4f}  margin {margins[-1]:+.4f}  "
              f"accuracy {accuracies[-1]:.2f}", flush=True)
    return {"first_loss": losses[0], "last_loss": losses[-1], "first_margin": margins[0],
            "last_margin": margins[-1], "last_accuracy": accuracies[-1]}


def add_dpo_args(p):  # type: ignore[no-untyped-def]
    p.add_argument("--beta", type=float, default=0.1)
    return p


def main() -> None:
    args = add_dpo_args(parser(__doc__, steps=20, lr=5e-4)).parse_args()
    sc = tinker.ServiceClient(base_url=args.base_url, api_key=require_key(args))
    base = args.base_model or first_served_model(args.base_url, args.api_key)
    result = train_dpo(sc, base, args)
    summary("dpo_lora", base_model=base, steps=args.steps, beta=args.beta, **result)


if __name__ == "__main__":
    main()
