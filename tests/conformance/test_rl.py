"""A minimal RL loop through the stock SDK: sample from the current weights, score with a toy reward,
forward_backward with importance_sampling, optim_step; the reward rises on the tiny model."""

from __future__ import annotations

import numpy as np
import tinker
from tinker import types

from tests.support.server import ServerProcess

PROMPTS = [[5, 17, 42, 99], [7, 23, 61, 88, 120], [3, 8, 13]]
GOOD = set(range(100, 132))  # the reward: the share of generated tokens in this set (~1/12 at random)
GROUP, MAX_TOKENS = 8, 6


def reward(tokens: list[int]) -> float:
    return sum(t in GOOD for t in tokens) / len(tokens)


def rl_datum(prompt: list[int], seq: types.SampledSequence, advantage: float) -> types.Datum:
    tokens = prompt + seq.tokens
    n_prompt = len(prompt) - 1
    assert seq.logprobs is not None
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": tokens[1:],
            "logprobs": [0.0] * n_prompt + list(seq.logprobs),
            "advantages": [0.0] * n_prompt + [advantage] * len(seq.tokens),
        },
    )


def test_rl_loop_raises_reward(server: ServerProcess) -> None:
    rewards: list[float] = []
    with tinker.ServiceClient(base_url=server.base_url, api_key=server.api_key_a) as sc:
        tc = sc.create_lora_training_client(base_model=server.base_model, rank=8, seed=11).result()
        params = types.SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, stop=[])
        for _ in range(12):
            sampler = tc.save_weights_and_get_sampling_client().result()
            futures = [sampler.sample(types.ModelInput.from_ints(p), GROUP, params) for p in PROMPTS]
            data, step_rewards = [], []
            for prompt, fut in zip(PROMPTS, futures):
                seqs = fut.result().sequences
                scores = np.array([reward(s.tokens) for s in seqs])
                step_rewards += scores.tolist()
                for seq, adv in zip(seqs, scores - scores.mean()):
                    if adv != 0:
                        data.append(rl_datum(prompt, seq, float(adv)))
            rewards.append(float(np.mean(step_rewards)))
            if data:
                tc.forward_backward(data, "importance_sampling").result()
                tc.optim_step(types.AdamParams(learning_rate=3e-2)).result()
    first, last = np.mean(rewards[:2]), np.mean(rewards[-3:])
    assert last > max(2 * first, first + 0.2), rewards
