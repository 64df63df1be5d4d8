"""Offline distillation with the stock tinker SDK (tinker==0.38.0): the teacher base model writes answers once, the
student LoRA learns them by SFT.

Start a server with both models (they must share a tokenizer; the teacher usually the larger one):

    twinkle-server serve --base-model STUDENT --base-model TEACHER

The teacher's base model answers a few chat prompts (`create_sampling_client(base_model=TEACHER).sample`, a few
samples each); the student then trains with `cross_entropy` on those answers (the prompt tokens weighted 0), one
full-batch forward_backward + optim_step per step. Signal: the student's mean per-token loss on the teacher's
answers, printed each step; it falls. At the end the student's greedy answer to a prompt is shown beside the
teacher's.

    TWINKLE_API_KEY=tml-... python examples/gkd_offline.py --steps 20

Last line: {"example": "gkd_offline", "student": ..., "teacher": ..., "first_loss": ..., "last_loss": ..., ...}
"""

from __future__ import annotations

from tinker import types

from _common import distillation_clients, parser, summary


def sft_datum(prompt: list[int], answer: list[int]) -> types.Datum:
    tokens = prompt + answer
    weights = [0.0] * (len(prompt) - 1) + [1.0] * len(answer)  # loss on the teacher's answer only
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                       loss_fn_inputs={"target_tokens": tokens[1:], "weights": weights})


def greedy(sampler, tok, prompt: list[int]) -> str:  # type: ignore[no-untyped-def]
    out = sampler.sample(types.ModelInput.from_ints(prompt), 1, types.SamplingParams(max_tokens=24, temperature=0.0))
    return str(tok.decode(out.result().sequences[0].tokens, skip_special_tokens=True).strip())


def main() -> None:
    p = parser(__doc__, steps=20, lr=5e-4)
    p.add_argument("--teacher-model", default=None, help="default: the server's served model after the student")
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--samples", type=int, default=2, help="teacher answers per prompt")
    p.add_argument("--max-tokens", type=int, default=24)
    args = p.parse_args()
    tc, tok, teacher, prompts = distillation_clients(args)
    futures = [teacher.sample(types.ModelInput.from_ints(pr), args.samples, types.SamplingParams(
        max_tokens=args.max_tokens, temperature=0.7, seed=args.seed * 1000 + i)) for i, pr in enumerate(prompts)]
    data = [sft_datum(pr, list(seq.tokens)) for pr, fut in zip(prompts, futures)
            for seq in fut.result().sequences if seq.tokens]
    n_tokens = sum(sum(d.loss_fn_inputs["weights"].tolist()) for d in data)
    print(f"teacher {args.teacher_model} wrote {len(data)} answers ({int(n_tokens)} tokens)", flush=True)

    losses: list[float] = []
    for step in range(args.steps):
        fb = tc.forward_backward(data, "cross_entropy")
        tc.optim_step(types.AdamParams(learning_rate=args.lr)).result()
        losses.append(fb.result().metrics["loss:sum"] / n_tokens)
        print(f"step {step:3d}  loss {losses[-1]:.4f}", flush=True)
    student_now = tc.save_weights_and_get_sampling_client().result()
    summary("gkd_offline", student=args.base_model, teacher=args.teacher_model, steps=args.steps, answers=len(data),
            first_loss=losses[0], last_loss=losses[-1], teacher_says=greedy(teacher, tok, prompts[0]),
            student_says=greedy(student_now, tok, prompts[0]))


if __name__ == "__main__":
    main()
