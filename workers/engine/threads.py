"""The trainer's intra-op thread count, chosen per merged pass (and per optimizer step) from its size.

A small pass is bound by per-op overhead, and a second intra-op thread costs more in synchronisation than it saves
(tiny model, one client: 1 thread ~4,800 tokens/s, 2 threads ~3,400); a large pass wants every core. Where the
crossover lies depends on the model and the machine, so it is measured on the real passes instead of guessed:
passes fall into size classes (powers of two of their padded tokens); while a class is new, its passes take each
candidate thread count in turn (1, then doubling up to the maximum) until each has run `TRIALS` passes; from then
on the class runs with the count whose passes took the least time per token (the median of its trials), unless that
is fewer threads than the maximum and not at least `MARGIN` faster than the maximum: the maximum is what torch uses
left alone, and on a busy machine trials a few percent apart say nothing about which is faster. A class measures
its candidates again `REFRESH_SECONDS` after its choice, so a change of load (another process taking a
core, or leaving it) is followed within minutes whatever the size of the passes.

Optimizer steps are measured the same way, in size classes of their own (`work="optim"`, sized by the adapter's
parameter elements): under OMP_WAIT_POLICY=PASSIVE every parallel region wakes sleeping threads (~40 us each on this
machine's 2 cores), so a small adapter's step may be quicker on one thread, while a large one's gains from every
core.

Counts are set with `set_threads`: `torch.set_num_threads` also turns MKL's dynamic threading off
(`mkl_set_dynamic(0)`), after which every MKL call, however small (the optimizer's vector math, a small gemm),
wakes every thread: a tiny adapter's AdamW step took 2.3 ms instead of 0.85 at two threads. `set_threads` turns it
back on, the state of a process that never set a count, so MKL still picks fewer threads than the count for small
calls.

The count is set on the calling thread only (torch's OpenMP intra-op pool is per thread), so a sampler thread in
the same process keeps its own, once it has run a parallel op: torch also keeps the count process-wide and a thread
takes it at its first parallel op, so a thread starting during a one-thread pass starts with one (the count is
restored after each pass). A fixed count (`TWINKLE_TRAIN_THREADS`) turns the choice off.
"""

from __future__ import annotations

import ctypes
import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch


def _torch_mkl() -> ctypes.CDLL | None:
    """The MKL torch links in (x86 builds), to reach its settings; None without one."""
    if not torch.backends.mkl.is_available():
        return None
    for lib in sorted((Path(torch.__file__).parent / "lib").glob("*torch_cpu.*")):  # libtorch_cpu.so, torch_cpu.dll
        try:
            found = ctypes.CDLL(str(lib))
        except OSError:
            continue
        if hasattr(found, "MKL_Set_Dynamic"):
            return found
    return None


_MKL = _torch_mkl()


def set_threads(n: int) -> None:
    """torch's intra-op thread count on this thread, with MKL's dynamic threading left on (see the module's doc)."""
    torch.set_num_threads(n)
    if _MKL is not None:
        _MKL.MKL_Set_Dynamic(1)


TRIALS = 3  # passes per candidate while measuring a size class
REFRESH_SECONDS = 300.0  # how long a class keeps its choice before measuring again
MARGIN = 0.1  # how much faster (per token) than the maximum count a smaller one must be to be chosen


@dataclass
class _SizeClass:
    samples: dict[int, list[float]]  # threads -> seconds per token of its trial passes
    chosen: int | None = None
    chosen_at: float = 0.0  # time.monotonic() of the choice


@dataclass
class ThreadChooser:
    """Picks the intra-op threads of each pass (`fixed` > 0: always that many)."""

    max_threads: int = field(default_factory=torch.get_num_threads)
    fixed: int = 0
    classes: dict[tuple[str, int], _SizeClass] = field(default_factory=dict)  # (work, size class) -> its trials

    @property
    def candidates(self) -> list[int]:
        out, n = [], 1
        while n < self.max_threads:
            out.append(n)
            n *= 2
        return out + [self.max_threads]

    def choose(self, size: int, work: str = "pass") -> int:
        if self.fixed or self.max_threads <= 1:
            return self.fixed or 1
        c = self._class(size, work)
        if c.chosen is not None and time.monotonic() - c.chosen_at < REFRESH_SECONDS:
            return c.chosen
        if c.chosen is not None:  # time to measure again
            c.chosen, c.samples = None, {n: [] for n in self.candidates}
        return min(c.samples, key=lambda n: len(c.samples[n]))  # the candidate with the fewest trials so far

    def record(self, size: int, threads: int, seconds: float, work: str = "pass") -> None:
        if self.fixed or self.max_threads <= 1:
            return
        c = self._class(size, work)
        if c.chosen is not None:
            return
        c.samples.setdefault(threads, []).append(seconds / max(size, 1))  # per token (per element)
        if all(len(s) >= TRIALS for s in c.samples.values()):
            median = {n: statistics.median(trials) for n, trials in c.samples.items()}
            best = min(median, key=median.__getitem__)
            c.chosen = best if median[best] <= (1 - MARGIN) * median[self.max_threads] else self.max_threads
            c.chosen_at = time.monotonic()

    @contextmanager
    def pass_of(self, size: int, work: str = "pass") -> Iterator[int]:
        """Run a piece of work of `size` with the chosen threads (on this thread), timing it: a pass of `size` padded
        tokens, or (work="optim") an optimizer step of `size` parameter elements."""
        threads = self.choose(size, work)
        before = torch.get_num_threads()
        set_threads(threads)
        start = time.perf_counter()
        try:
            yield threads
            self.record(size, threads, time.perf_counter() - start, work)  # a pass that raised is no measurement
        finally:
            set_threads(before)

    def _class(self, size: int, work: str) -> _SizeClass:
        key = (work, max(size, 1).bit_length())
        c = self.classes.get(key)
        if c is None:
            c = self.classes[key] = _SizeClass({n: [] for n in self.candidates})
        return c
