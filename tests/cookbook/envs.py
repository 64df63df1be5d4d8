"""A toy RL task for the cookbook's RL loops on the tiny random model: each prompt (fixed token ids) is answered with
a few sampled tokens; the reward is the share of them inside GOOD (~1/12 at random), a signal the tiny model can
learn in a few steps (as tests/conformance/test_rl.py)."""

from __future__ import annotations

from collections.abc import Sequence

import chz
import tinker
from tinker_cookbook.rl.types import (
    Action,
    Env,
    EnvGroupBuilder,
    Observation,
    RLDataset,
    RLDatasetBuilder,
    StepResult,
    Trajectory,
)
from tinker_cookbook.completers import StopCondition

PROMPTS = [[5, 17, 42, 99], [7, 23, 61, 88, 120], [3, 8, 13], [9, 30, 77, 150]]
GOOD = frozenset(range(100, 132))


class TokenSetEnv(Env):
    def __init__(self, prompt: list[int], reward_scale: float = 1.0) -> None:
        self.prompt, self.reward_scale = prompt, reward_scale

    async def initial_observation(self) -> tuple[Observation, StopCondition]:
        return tinker.ModelInput.from_ints(self.prompt), []

    async def step(self, action: Action, *, extra: object = None) -> StepResult:
        share = sum(t in GOOD for t in action) / max(1, len(action))
        return StepResult(reward=self.reward_scale * share, episode_done=True,
                          next_observation=tinker.ModelInput.empty(), next_stop_condition=[],
                          metrics={"good_share": share})


class TokenSetGroup(EnvGroupBuilder):
    def __init__(self, prompt: list[int], group_size: int, reward_scale: float) -> None:
        self.prompt, self.group_size, self.reward_scale = prompt, group_size, reward_scale

    async def make_envs(self) -> Sequence[Env]:
        return [TokenSetEnv(self.prompt, self.reward_scale) for _ in range(self.group_size)]

    async def compute_group_rewards(self, trajectory_group: list[Trajectory],
                                    env_group: Sequence[Env]) -> list[tuple[float, dict[str, float]]]:
        return [(0.0, {}) for _ in trajectory_group]

    def logging_tags(self) -> list[str]:
        return ["token_set"]


class TokenSetDataset(RLDataset):
    def __init__(self, batches: int, group_size: int, reward_scale: float) -> None:
        self.batches, self.group_size, self.reward_scale = batches, group_size, reward_scale

    def get_batch(self, index: int) -> Sequence[EnvGroupBuilder]:
        return [TokenSetGroup(p, self.group_size, self.reward_scale) for p in PROMPTS]

    def __len__(self) -> int:
        return self.batches


@chz.chz
class TokenSetBuilder(RLDatasetBuilder):
    batches: int = 10
    group_size: int = 8
    reward_scale: float = 1.0  # 0: no reward at all (distillation: the teacher's KL is the only signal)

    async def __call__(self) -> tuple[RLDataset, RLDataset | None]:
        return TokenSetDataset(self.batches, self.group_size, self.reward_scale), None
