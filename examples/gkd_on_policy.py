"""On-policy distillation (GKD, reverse KL) with the stock tinker SDK (tinker==0.38.0): a student LoRA learns to
match a teacher base model served by the same server.

Start a server with both models (the teacher usually a larger model of the student's family: the two must share
a tokenizer):

    twinkle-server serve --base-model STUDENT --base-model TEACHER

Each step: save the student for sampling (`save_weights_and_get_sampling_client`), let it answer a few chat prompts
(a group of samples each, with their logprobs), score the sampled tokens with the teacher's base model
(`create_sampling_client(base_model=TEACHER).compute_logprobs`), and train the student with the
`importance_sampling` loss on its own samples with the per-token advantage `teacher_lp - student_lp`: the gradient of
the reverse KL(student || teacher) on on-policy samples, as in tinker-cookbook's `distillation.train_on_policy`.
Signal: the reverse KL estimate `mean(student_lp - teacher_lp)` over the sampled tokens, printed each step; it falls.

    TWINKLE_API_KEY=tml-... python examples/gkd_on_policy.py --steps 20

Last line: {"example": "gkd_on_policy", "student": ..., "teacher": ..., "first_kl": ..., "last_kl": ..., ...}
"""

from __future__ import annotations

import numpy as np
from tinker import types

from _common import distillation_clients, parser, summary


def distill_datum(prompt: list[int], seq: types.SampledSequence, teacher_lps: list[float]) -> types.Datum:
    tokens = prompt + list(seq.tokens)
    n = len(prompt) - 1  # prompt positions among the targets: no loss there
    student_lps = list(seq.logprobs or [])
    advantages = [t - s for t, s in zip(teacher_lps, student_lps)]  # -(student_lp - teacher_lp): reverse KL's gradient
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                       loss_fn_inputs={"target_tokens": tokens[1:], "logprobs": [0.0] * n + student_lps,
                                       "advantages": [0.0] * n + advantages})


def main() -> None:
    p = parser(__doc__, steps=20, lr=1e-4)
    p.add_argument("--teacher-model", default=None, help="default: the server's served model after the student")
    p.add_argument("--prompts", type=int, default=8, help="prompts per step (at most 8)")
    p.add_argument("--group", type=int, default=8, help="samples per prompt")
    p.add_argument("--max-tokens", type=int, default=16)
    args = p.parse_args()
    tc, tok, teacher, prompts = distillation_clients(args)

    kls: list[float] = []
    for step in range(args.steps):
        sampler = tc.save_weights_and_get_sampling_client().result()  # the student as trained so far
        futures = [sampler.sample(types.ModelInput.from_ints(pr), args.group, types.SamplingParams(
            max_tokens=args.max_tokens, temperature=1.0, seed=args.seed * 100 + i))
            for i, pr in enumerate(prompts)]
        samples = [(pr, seq) for pr, fut in zip(prompts, futures) for seq in fut.result().sequences if seq.tokens]
        scored = [teacher.compute_logprobs(types.ModelInput.from_ints(pr + list(seq.tokens))) for pr, seq in samples]
        data, diffs = [], []
        for (pr, seq), fut in zip(samples, scored):
            teacher_lps = [float(x) for x in fut.result()[len(pr):]]  # the teacher's logprob of each sampled token
            diffs += [s - t for s, t in zip(seq.logprobs or [], teacher_lps)]
            data.append(distill_datum(pr, seq, teacher_lps))
        kls.append(float(np.mean(diffs)))
        fb = tc.forward_backward(data, "importance_sampling")
        tc.optim_step(types.AdamParams(learning_rate=args.lr)).result()
        fb.result()
        print(f"step {step:3d}  reverse KL {kls[-1]:.4f}  ({len(diffs)} sampled tokens)", flush=True)
    half = max(1, len(kls) // 2)
    summary("gkd_on_policy", student=args.base_model, teacher=args.teacher_model, steps=args.steps, first_kl=kls[0],
            last_kl=kls[-1], mean_kl_first_half=float(np.mean(kls[:half])),
            mean_kl_second_half=float(np.mean(kls[half:])))


if __name__ == "__main__":
    main()
