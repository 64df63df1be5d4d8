"""SFT a new identity into the served model with the stock tinker SDK (tinker==0.38.0).

The rows of data/self_cognition.jsonl ("Who are you?" -> "I am {{NAME}}, an assistant made by {{AUTHOR}}.") are
chat-templated with the training client's own tokenizer (`tc.get_tokenizer()`: the server reports its local model
folder, so this works offline on the server's machine), the loss is cross_entropy on the assistant tokens only, and
every step is one full-batch forward_backward + optim_step. Afterwards the adapter is saved for sampling and asked
a question that is not in the data. Signal: the mean per-token loss of the answers, printed each step.

    TWINKLE_API_KEY=tml-... python examples/sft_self_cognition_tinker.py --steps 40

Last line: {"example": "sft_self_cognition_tinker", "first_loss": ..., "last_loss": ..., "answer": ...}
"""

from __future__ import annotations

import tinker
from tinker import types

from _common import first_served_model, parser, read_jsonl, require_key, summary

QUESTION = "Please tell me your name and who created you."  # not in the data


def chat_tokens(tok, messages, add_generation_prompt=False):  # type: ignore[no-untyped-def]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    return tok.encode(text, add_special_tokens=False)


def sft_datum(tok, question: str, answer: str) -> types.Datum:  # type: ignore[no-untyped-def]
    user = [{"role": "user", "content": question}]
    prompt = chat_tokens(tok, user, add_generation_prompt=True)
    full = chat_tokens(tok, user + [{"role": "assistant", "content": answer}])
    assert full[:len(prompt)] == prompt, "the chat template should extend the prompt"
    weights = [0.0] * (len(prompt) - 1) + [1.0] * (len(full) - len(prompt))  # loss on the answer only
    return types.Datum(model_input=types.ModelInput.from_ints(full[:-1]),
                       loss_fn_inputs={"target_tokens": full[1:], "weights": weights})


def ask(sampler, tok, question: str) -> str:  # type: ignore[no-untyped-def]
    prompt = types.ModelInput.from_ints(chat_tokens(tok, [{"role": "user", "content": question}], True))
    out = sampler.sample(prompt, 1, types.SamplingParams(max_tokens=40, temperature=0.0)).result()
    return tok.decode(out.sequences[0].tokens, skip_special_tokens=True).strip()


def main() -> None:
    p = parser(__doc__, steps=40, lr=5e-4)
    p.add_argument("--name", default="Blinky")
    p.add_argument("--author", default="the Twinkle team")
    args = p.parse_args()
    sc = tinker.ServiceClient(base_url=args.base_url, api_key=require_key(args))
    base = args.base_model or first_served_model(args.base_url, args.api_key)
    tc = sc.create_lora_training_client(base_model=base, rank=args.rank, seed=args.seed).result()
    tok = tc.get_tokenizer()

    rows = read_jsonl("self_cognition.jsonl")
    fill = lambda s: s.replace("{{NAME}}", args.name).replace("{{AUTHOR}}", args.author)  # noqa: E731
    data = [sft_datum(tok, r["query"], fill(r["response"])) for r in rows]
    n_tokens = sum(sum(d.loss_fn_inputs["weights"].tolist()) for d in data)
    before = ask(sc.create_sampling_client(base_model=base).result(), tok, QUESTION)
    print(f"base model on {QUESTION!r}: {before!r}")

    losses = []
    for step in range(args.steps):
        fb = tc.forward_backward(data, "cross_entropy")
        opt = tc.optim_step(types.AdamParams(learning_rate=args.lr))
        losses.append(fb.result().metrics["loss:sum"] / n_tokens)  # summed over tokens -> per answer token
        opt.result()
        print(f"step {step:3d}  loss {losses[-1]:.4f}", flush=True)

    sampler = tc.save_weights_and_get_sampling_client().result()
    answer = ask(sampler, tok, QUESTION)
    print(f"trained adapter on {QUESTION!r}: {answer!r}")
    summary("sft_self_cognition_tinker", base_model=base, steps=args.steps, first_loss=losses[0],
            last_loss=losses[-1], answer=answer, mentions_name=args.name.lower() in answer.lower())


if __name__ == "__main__":
    main()
