"""Two-turn tool use, trained with GRPO, through twinkle-kit's own client (twinkle_client, twinkle-kit==0.5.1).

A toy environment: the user asks "What is 7 * 12? Call the calculator first, then answer." Turn 1 is the model's
tool call; the environment runs its calculator on the question's expression (this toy does not parse the call) and
answers as a `tool` message; turn 2 is the model's answer. The rollout goes through the native sampler's
`new_input_feature`: each sampled turn comes back as the input plus the generated tokens (labels = those tokens),
twinkle's `extend_with_bridge` appends the tool message and the next generation prompt as -100 "bridge" tokens, and
that feature is sampled again. The final feature holds both turns' tokens as labels, and the sampler's logprobs of
both turns are the `old_logps` of `MultiLoraTransformersModel`'s GRPOLoss, with group-normalised advantages; the
sampler follows the adapter as trained (`save(is_sampler=True)` -> `adapter_uri`).

Reward: 1.0 when the answer contains the calculator's result, else half the share of the answer's characters that
occur in the tool's message (partial credit for drawing on it). The tiny random test model never copies the result and a few steps cannot reliably raise its
reward, so the deterministic signal printed is the GRPO objective itself: after the first update, the
advantage-weighted change of the first group's mean token logprob over both turns (`surrogate_gain`, positive
when rewarded trajectories became more likely and penalised ones less).

    TWINKLE_API_KEY=tml-... python examples/rl_multi_turn.py --tokenizer /path/to/model --steps 20

Last line: {"example": "rl_multi_turn", "first_reward": ..., "last_reward": ..., "surrogate_gain": ..., ...}
"""

from __future__ import annotations

import random

import numpy as np
from peft import LoraConfig
from twinkle.data_format import Message, Trajectory
from twinkle.template import Template
from twinkle_agentic.rollout.bridge import extend_with_bridge
from twinkle_client import init_twinkle_client
from twinkle_client.model import MultiLoraTransformersModel
from twinkle_client.sampler import vLLMSampler

from _common import parser, require_key, summary
from sft_self_cognition_native import plain


def reward(answer: str, tool_text: str, result: int) -> float:
    """1.0 for the calculator's result in the answer, else half the share of the answer's characters that occur
    in the tool's message (partial credit for drawing on the tool's answer)."""
    if str(result) in answer:
        return 1.0
    chars = [c for c in answer if not c.isspace()]
    return 0.5 * sum(c in tool_text for c in chars) / max(len(chars), 1)


def label_logps(logps: list[list[float]], features: list[dict]) -> list[list[float]]:
    return [[float(lp) for lp, label in zip(row, f["labels"]) if label != -100] for row, f in zip(logps, features)]


def main() -> None:
    p = parser(__doc__, steps=20, lr=1e-4)
    p.add_argument("--tokenizer", default=None, help="the model's tokenizer folder for twinkle's Template")
    p.add_argument("--questions", type=int, default=2, help="questions per step")
    p.add_argument("--group", type=int, default=4, help="rollouts per question")
    p.add_argument("--max-tokens", type=int, default=8, help="per turn")
    args = p.parse_args()
    client = init_twinkle_client(base_url=args.base_url, api_key=require_key(args))
    try:
        base = args.base_model or client.get_server_capabilities().supported_models[0].model_name
        template = Template(model_id=args.tokenizer or base)
        sampler = vLLMSampler(model_id=base)
        model = MultiLoraTransformersModel(model_id=base)
        model.add_adapter_to_model("tool-rl", LoraConfig(r=args.rank, target_modules="all-linear"),
                                   gradient_accumulation_steps=1)
        model.set_template("Template")
        model.set_processor("InputProcessor", padding_side="right")
        model.set_loss("GRPOLoss", epsilon=0.2)
        model.add_metric("GRPOMetric")
        model.set_optimizer("AdamW", lr=args.lr)
        rng = random.Random(args.seed)
        params = {"max_tokens": args.max_tokens, "temperature": 1.0, "logprobs": 1}

        rewards, first, surrogate_gain = [], None, None
        for step in range(args.steps):
            uri = model.save(f"tool-rl-{step}", is_sampler=True).twinkle_path if step else None
            tasks = [(rng.randint(2, 12), rng.randint(2, 12)) for _ in range(args.questions)]
            prompts = []
            for a, b in tasks:
                messages = [Message(role="user", content=f"What is {a} * {b}? Call the calculator first, then answer.")]
                pif = dict(template.encode(Trajectory(messages=messages), add_generation_prompt=True))
                pif.setdefault("messages", [dict(m) for m in messages])
                prompts.append(plain(pif))
            # turn 1: a group of tool calls per question
            turn1 = sampler.sample(inputs=prompts, sampling_params={**params, "num_samples": args.group,
                                                                    "seed": 1000 * args.seed + 2 * step},
                                   adapter_uri=uri)
            bridged, old, results = [], [], []
            for (a, b), sample in zip(tasks, turn1):
                for seq in sample.sequences:
                    tool = [{"role": "tool", "content": f"calculator: {a} * {b} = {a * b}"}]
                    bridged.append(plain(extend_with_bridge(plain(seq.new_input_feature), tool, template)))
                    old.append([lp[0][1] for lp in seq.logprobs])
                    results.append((tool[0]["content"], a * b))
            # turn 2: every rollout answers once, after the tool's answer
            # (no seed here: one seed for the whole request would give every row the same random draws)
            turn2 = sampler.sample(inputs=bridged, sampling_params=params, adapter_uri=uri)
            features, r = [], []
            for i, sample in enumerate(turn2):
                seq = sample.sequences[0]
                features.append(plain(seq.new_input_feature))
                old[i] = old[i] + [lp[0][1] for lp in seq.logprobs]
                r.append(reward(seq.decoded or "", *results[i]))
            groups = np.asarray(r).reshape(-1, args.group)
            adv = ((groups - groups.mean(1, keepdims=True)) / (groups.std(1, keepdims=True) + 1e-6)).reshape(-1)
            model.forward_backward(inputs=features, advantages=adv.tolist(), old_logps=old)
            model.clip_grad_and_step()
            if step == 0:
                first = (features, old, adv)
                now = label_logps(model.forward_only(inputs=features).result["logps"], features)
                surrogate_gain = float(np.mean([a_ * (np.mean(n) - np.mean(o)) for a_, n, o in zip(adv, now, old)]))
            rewards.append(float(np.mean(r)))
            metric = model.calculate_metric(is_training=True).result
            print(f"step {step:3d}  reward {rewards[-1]:.3f}  approx_kl {metric.get('train/approx_kl')}  "
                  f"tokens/rollout {np.mean([len(o) for o in old]):.1f}", flush=True)
        summary("rl_multi_turn", base_model=base, steps=args.steps, first_reward=rewards[0], last_reward=rewards[-1],
                mean_reward=float(np.mean(rewards)), surrogate_gain=surrogate_gain,
                turns_per_rollout=2, labels_per_rollout=float(np.mean([len(o) for o in first[1]])) if first else 0)
    finally:
        client.close()


if __name__ == "__main__":
    main()
