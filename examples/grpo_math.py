"""GRPO on toy arithmetic with the stock tinker SDK (tinker==0.38.0).

Each step: save the adapter for sampling (`save_weights_and_get_sampling_client`), sample a group of answers per
question ("What is 7 + 12?", generated here, no data file), score them, normalise the rewards within each group
(advantage = (r - mean) / std), and train with the `importance_sampling` loss on the sampled tokens (the sampler's
logprobs as the behaviour policy), then `optim_step`.

Reward: 1.0 for the right number as the first number of the answer, plus 0.2 for answering with a number at all
(the format part). A real model (SmolLM2 and up) earns both; the tiny random test model essentially never gets the
sum right, so on it only the format part varies, and a few steps cannot be expected to raise the mean reward
reliably. The deterministic signal printed at the end is therefore the GRPO objective itself: after the first
update, the advantage-weighted change of the mean token logprob of the answers it trained on,
`surrogate_gain = mean_i adv_i * (logp_new_i - logp_old_i)`, which a correct trainer makes positive (rewarded answers
more likely, penalised ones less), whatever the model.

    TWINKLE_API_KEY=tml-... python examples/grpo_math.py --steps 20

Last line: {"example": "grpo_math", "first_reward": ..., "last_reward": ..., "surrogate_gain": ..., ...}
"""

from __future__ import annotations

import random
import re

import numpy as np
import tinker
from tinker import types

from _common import first_served_model, parser, require_key, summary


def problems(rng: random.Random, n: int) -> list[tuple[str, int]]:
    out = []
    for _ in range(n):
        a, b = rng.randint(1, 20), rng.randint(1, 20)
        out.append((f"What is {a} + {b}? Answer with the number only.", a + b))
    return out


def reward(text: str, answer: int) -> tuple[float, bool]:
    numbers = re.findall(r"-?\d+", text)
    correct = bool(numbers) and int(numbers[0]) == answer
    return (1.0 if correct else 0.0) + (0.2 if numbers else 0.0), correct


def rl_datum(prompt: list[int], seq: types.SampledSequence, adv: float) -> types.Datum:
    tokens = prompt + list(seq.tokens)
    n = len(prompt) - 1  # prompt positions among the targets: no loss there
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                       loss_fn_inputs={"target_tokens": tokens[1:],
                                       "logprobs": [0.0] * n + list(seq.logprobs or []),
                                       "advantages": [0.0] * n + [adv] * len(seq.tokens)})


def mean_logprob(sampler, prompt: list[int], tokens: list[int]) -> float:  # type: ignore[no-untyped-def]
    lps = sampler.compute_logprobs(types.ModelInput.from_ints(prompt + tokens)).result()
    return float(np.mean(lps[len(prompt):]))


def main() -> None:
    p = parser(__doc__, steps=20, lr=1e-4)
    p.add_argument("--questions", type=int, default=4, help="questions per step")
    p.add_argument("--group", type=int, default=8, help="answers sampled per question")
    p.add_argument("--max-tokens", type=int, default=12)
    args = p.parse_args()
    sc = tinker.ServiceClient(base_url=args.base_url, api_key=require_key(args))
    base = args.base_model or first_served_model(args.base_url, args.api_key)
    tc = sc.create_lora_training_client(base_model=base, rank=args.rank, seed=args.seed).result()
    tok = tc.get_tokenizer()
    rng = random.Random(args.seed)

    def encode(question: str) -> list[int]:
        text = tok.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                       add_generation_prompt=True)
        return tok.encode(text, add_special_tokens=False)

    rewards, accuracies = [], []
    first_group: list[tuple[list[int], list[int], float, float]] = []  # (prompt, tokens, adv, old mean logprob)
    surrogate_gain, probe_step = None, None  # probe_step: the first step that trained
    for step in range(args.steps):
        sampler = tc.save_weights_and_get_sampling_client().result()  # the policy as trained so far
        if probe_step is not None and surrogate_gain is None:  # the first update's effect on its own answers
            surrogate_gain = float(np.mean([adv * (mean_logprob(sampler, pr, toks) - old)
                                            for pr, toks, adv, old in first_group]))
        batch = [(encode(q), answer) for q, answer in problems(rng, args.questions)]
        futures = [sampler.sample(types.ModelInput.from_ints(pr), args.group, types.SamplingParams(
            max_tokens=args.max_tokens, temperature=1.0, seed=args.seed * 100_000 + step * 100 + i))
            for i, (pr, _) in enumerate(batch)]
        data, step_rewards, step_correct = [], [], []
        for (prompt, answer), fut in zip(batch, futures):
            seqs = fut.result().sequences
            scored = [reward(tok.decode(s.tokens, skip_special_tokens=True), answer) for s in seqs]
            r = np.array([s for s, _ in scored])
            step_rewards += r.tolist()
            step_correct += [c for _, c in scored]
            if r.std() < 1e-6:
                continue  # the whole group scored the same: no signal
            for seq, adv in zip(seqs, (r - r.mean()) / (r.std() + 1e-6)):
                data.append(rl_datum(prompt, seq, float(adv)))
                if probe_step is None:
                    first_group.append((prompt, list(seq.tokens), float(adv), float(np.mean(seq.logprobs))))
        if data:
            probe_step = step if probe_step is None else probe_step
            fb = tc.forward_backward(data, "importance_sampling")
            tc.optim_step(types.AdamParams(learning_rate=args.lr)).result()
            fb.result()
        rewards.append(float(np.mean(step_rewards)))
        accuracies.append(float(np.mean(step_correct)))
        print(f"step {step:3d}  reward {rewards[-1]:.3f}  accuracy {accuracies[-1]:.3f}  trained on {len(data)}",
              flush=True)
    if surrogate_gain is None and probe_step is not None:
        sampler = tc.save_weights_and_get_sampling_client().result()
        surrogate_gain = float(np.mean([adv * (mean_logprob(sampler, pr, toks) - old)
                                        for pr, toks, adv, old in first_group]))
    summary("grpo_math", base_model=base, steps=args.steps, first_reward=rewards[0], last_reward=rewards[-1],
            mean_reward_first_half=float(np.mean(rewards[:max(1, len(rewards) // 2)])),
            mean_reward_second_half=float(np.mean(rewards[len(rewards) // 2:])),
            first_accuracy=accuracies[0], last_accuracy=accuracies[-1], surrogate_gain=surrogate_gain)


if __name__ == "__main__":
    main()
