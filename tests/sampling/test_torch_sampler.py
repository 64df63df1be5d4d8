"""Torch-sampler specifics: continuous batching, adapter slots, and sharing the base model with the trainer."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import torch

from tests.sampling.conftest import PROMPTS, Rig, logprobs, make_sampler, spec, tokens
from workers.engine.multi_lora import Route, routed
from workers.sampling.torch_sampler import TorchSampler


def test_a_new_request_joins_the_running_batch(rig: Rig) -> None:
    sampler = make_sampler("torch", rig)
    assert isinstance(sampler, TorchSampler)
    done: list[str] = []

    async def go() -> None:
        async def one(name: str, delay: float, max_tokens: int) -> None:
            await asyncio.sleep(delay)
            await sampler.sample(spec(PROMPTS[0], max_tokens=max_tokens))
            done.append(name)

        await asyncio.gather(one("long", 0, 300), one("short", 0.05, 3))

    rig.loop.run_until_complete(go())
    rig.loop.run_until_complete(sampler.close())
    assert done == ["short", "long"]
    assert sampler.steps == 299  # the short request's decode steps were shared with the long one's


def test_adapter_slots_are_evicted_and_reloaded(rig: Rig) -> None:
    sampler = make_sampler("torch", rig, max_loaded_adapters=2)
    assert isinstance(sampler, TorchSampler)
    refs = [rig.adapter(f"slot{i}", seed=30 + i) for i in range(3)]
    first = [rig.run(sampler, spec(PROMPTS[1], w, max_tokens=6))[0] for w in refs]
    assert len(sampler.slots.loaded()) == 2
    again = rig.run(sampler, *(spec(PROMPTS[1], w, max_tokens=6) for w in refs))
    for a, b in zip(first, again):
        assert tokens(a.sequences[0]) == tokens(b.sequences[0])
    held = {slot for per_layer, _, _ in sampler.lora.weights.values() for slot in per_layer}
    assert held == {f"sampler:{v}" for v in sampler.slots.loaded()}  # evicted ones left memory
    rig.loop.run_until_complete(sampler.close())


def test_sampling_is_unaffected_by_training_on_another_thread(rig: Rig) -> None:
    sampler = make_sampler("torch", rig)
    rig.adapter("busy", seed=40)  # a training adapter in the shared layers, routed on the trainer's thread only
    request = spec(PROMPTS[2], max_tokens=30)
    alone = rig.run(sampler, request)[0]
    stop = threading.Event()

    def train_forever() -> None:
        ids = torch.tensor([PROMPTS[1]])
        while not stop.is_set():
            with torch.no_grad(), routed(rig.base.layers, [Route("busy", 0, 1)]):
                rig.base.logprob_logits(ids, torch.ones_like(ids))

    thread = threading.Thread(target=train_forever)
    thread.start()
    try:
        busy = rig.run(sampler, request, request)
    finally:
        stop.set()
        thread.join()
    rig.loop.run_until_complete(sampler.close())
    for res in busy:
        assert tokens(res.sequences[0]) == tokens(alone.sequences[0])
        np.testing.assert_allclose(logprobs(res.sequences[0]), logprobs(alone.sequences[0]), atol=1e-5)


def test_adapters_of_different_ranks_and_targets_share_a_batch(rig: Rig) -> None:
    """Uneven row groups, base-model rows, and adapters that skip some layers, decoded together, match solo runs."""
    sampler = make_sampler("torch", rig)
    wide = rig.adapter("wide", seed=50, rank=8)
    attn = rig.adapter("attn", seed=51, rank=2, train_mlp=False, train_unembed=False)
    mlp = rig.adapter("mlp", seed=52, rank=4, train_attn=False)
    specs = [spec(PROMPTS[i % 3], w, n=n, max_tokens=10, temperature=1.0, seed=i)
             for i, (w, n) in enumerate([(wide, 3), (attn, 1), (mlp, 2), (None, 1)])]
    solo = [rig.run(sampler, s)[0] for s in specs]
    together = rig.run(sampler, *specs)
    rig.loop.run_until_complete(sampler.close())
    assert len({tuple(tokens(r.sequences[0])) for r in solo}) == len(specs)
    for got, want in zip(together, solo):
        for g, w in zip(got.sequences, want.sequences, strict=True):
            assert tokens(g) == tokens(w)
            np.testing.assert_allclose(logprobs(g), logprobs(w), atol=1e-5)
