"""The trainer's thread choice per pass size (workers/engine/threads.py): every candidate is measured on real passes
of a size class, the fastest per token is kept, re-measured later; a fixed count disables it."""

from __future__ import annotations

import threading

import pytest
import torch

from workers.engine import threads as threads_mod
from workers.engine.threads import TRIALS, ThreadChooser


def _measure(chooser: ThreadChooser, tokens: int, seconds_per_token: dict[int, float], work: str = "pass",
             ) -> list[int]:
    tried = []
    for _ in range(TRIALS * len(chooser.candidates)):
        n = chooser.choose(tokens, work)
        tried.append(n)
        chooser.record(tokens, n, seconds_per_token[n] * tokens, work)
    return tried


def test_candidates_double_up_to_the_maximum() -> None:
    assert ThreadChooser(max_threads=2).candidates == [1, 2]
    assert ThreadChooser(max_threads=6).candidates == [1, 2, 4, 6]


def test_each_size_class_keeps_its_fastest_count() -> None:
    chooser = ThreadChooser(max_threads=4)
    tried = _measure(chooser, 256, {1: 1.0, 2: 3.0, 4: 2.0})  # a small pass: one thread is best
    assert sorted(tried) == sorted([1, 2, 4] * TRIALS)
    assert chooser.choose(256) == 1 and chooser.choose(300) == 1  # 256..511 tokens: one class
    _measure(chooser, 4096, {1: 3.0, 2: 2.0, 4: 1.0})  # a large one: all four
    assert chooser.choose(4096) == 4 and chooser.choose(256) == 1


def test_fewer_threads_only_when_clearly_faster() -> None:
    chooser = ThreadChooser(max_threads=4)
    _measure(chooser, 256, {1: 0.95, 2: 0.97, 4: 1.0})  # 5 % apart: noise on a busy machine, keep torch's count
    assert chooser.choose(256) == 4
    _measure(chooser, 4096, {1: 1.0, 2: 0.85, 4: 1.0})  # 15 % faster: two threads
    assert chooser.choose(4096) == 2


def test_a_class_is_measured_again_after_refresh(monkeypatch: pytest.MonkeyPatch) -> None:
    now = [1000.0]
    monkeypatch.setattr(threads_mod.time, "monotonic", lambda: now[0])
    chooser = ThreadChooser(max_threads=2)
    _measure(chooser, 64, {1: 1.0, 2: 2.0})
    for _ in range(5):
        assert chooser.choose(64) == 1
        chooser.record(64, 1, 1.0)
        now[0] += threads_mod.REFRESH_SECONDS / 10
    now[0] += threads_mod.REFRESH_SECONDS / 2
    _measure(chooser, 64, {1: 2.0, 2: 1.0})  # the load changed: two threads win now
    assert chooser.choose(64) == 2


def test_fixed_count_and_single_core() -> None:
    assert ThreadChooser(max_threads=8, fixed=3).choose(10) == 3
    assert ThreadChooser(max_threads=1).choose(10**6) == 1


def test_pass_of_sets_the_calling_threads_count_only() -> None:
    chooser = ThreadChooser(max_threads=2, fixed=1)
    seen: dict[str, int] = {}
    outside = torch.get_num_threads()

    def work() -> None:
        with chooser.pass_of(100) as n:
            seen["inside"], seen["chosen"] = torch.get_num_threads(), n

    t = threading.Thread(target=work)
    t.start()
    t.join()
    assert seen["inside"] == seen["chosen"] == 1
    assert torch.get_num_threads() == outside  # this thread's count untouched


def test_set_threads_leaves_mkl_dynamic_threading_on() -> None:
    """torch.set_num_threads turns MKL's dynamic threading off (every MKL call then wakes every thread);
    set_threads turns it back on. MKL's own getter is not exported by libtorch, its service one is."""
    mkl = threads_mod._MKL
    if mkl is None or not hasattr(mkl, "mkl_serv_get_dynamic"):
        pytest.skip("this torch links no MKL")

    def run() -> tuple[int, int, int]:
        torch.set_num_threads(1)
        after_torch = mkl.mkl_serv_get_dynamic()
        threads_mod.set_threads(1)
        return after_torch, mkl.mkl_serv_get_dynamic(), torch.get_num_threads()

    seen: list[tuple[int, int, int]] = []
    t = threading.Thread(target=lambda: seen.append(run()))  # counts are per thread: leave the test's own alone
    t.start()
    t.join()
    assert seen == [(0, 1, 1)]


def test_a_failed_pass_is_no_measurement() -> None:
    chooser = ThreadChooser(max_threads=2)
    with pytest.raises(RuntimeError):
        with chooser.pass_of(100):
            raise RuntimeError("boom")
    assert all(not s for s in chooser.classes[("pass", (100).bit_length())].samples.values())


def test_optimizer_steps_are_measured_apart_from_passes() -> None:
    chooser = ThreadChooser(max_threads=2)
    _measure(chooser, 1024, {1: 2.0, 2: 1.0})  # passes of 1024 tokens: two threads
    tried = _measure(chooser, 1024, {1: 1.0, 2: 3.0}, "optim")  # optimizer steps of 1024 elements: their own class
    assert sorted(tried) == [1] * TRIALS + [2] * TRIALS
    assert chooser.choose(1024, work="optim") == 1 and chooser.choose(1024) == 2


def test_the_trainer_times_its_optimizer_steps(tmp_path, tiny_model_dir) -> None:
    from tests.unit.engine_jobs import create, fb, optim
    from workers.checkpoints.store import CheckpointStore
    from workers.engine.base_model import BaseModel
    from workers.engine.trainer import Trainer

    chooser = ThreadChooser(max_threads=2)
    trainer = Trainer(BaseModel("tiny", tiny_model_dir), CheckpointStore(tmp_path), threads=chooser)
    assert trainer.execute(create("m", rank=4)).ok
    assert trainer.execute(fb("m", 1, [[5, 6, 7, 8]])).ok
    assert trainer.execute(optim("m", 2)).ok
    elements = sum(t.numel() for t in trainer.pool.get("m").params)
    trials = chooser.classes[("optim", elements.bit_length())].samples
    assert sum(len(s) for s in trials.values()) == 1
