"""Load campaign (issue 19): many stock-SDK clients of several tenants at once, for minutes, on the tiny model.

`--clients` client threads (default 50) over `--tenants` tenants (default 10; one `tinker.ServiceClient` a tenant)
for `--seconds` (default 300) against `twinkle-server serve` on loopback. The clients take three roles in turn:
- sft: forward_backward (cross_entropy) + optim_step, each future awaited;
- rl: every few steps a sampler checkpoint and its sampling client; each step samples, then trains on the samples
  with importance_sampling (advantages centred per prompt) + optim_step;
- rest: the RestClient's reads (training runs, one run, checkpoints) and a training run's own `save_state` now and
  then.
Every SDK call's result is awaited with a bound (`--future-timeout`): one that does not resolve in it is a lost
future. An error the SDK raises with an HTTP status is counted by status (4xx are the service refusing, e.g. a
quota); anything else is a non-4xx error (5xx, a dropped connection, a bad result). The server's RSS is read
from /proc every `--rss-every` seconds; growth is the last quarter's median over the value at the end of the
warm-up (`--warmup` seconds, default the first fifth). The server keeps finished results retrievable for
`--result-ttl` seconds (TWINKLE_RESULT_TTL_SECONDS, the server's default 900), so its memory grows with the
requests of that window by design: a warm-up of at least the TTL measures what remains. Prints one JSON line;
`targets_met` is 0 non-4xx errors, 0 lost futures and growth under 10 %.
Usage: python benchmarks/load_campaign.py [--clients 50] [--tenants 10] [--seconds 300] [--warmup S] [--result-ttl S]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

ROLES = ("sft", "rl", "rest")
SAMPLER_EVERY = 4  # rl: a new sampler checkpoint every this many steps
SAVE_EVERY = 10  # rest: a save_state every this many rounds of reads


@dataclass
class Tally:
    """What the clients saw, shared by their threads (under `lock`)."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    latency: dict[str, list[float]] = field(default_factory=dict)  # kind -> seconds to a resolved result
    errors: Counter[str] = field(default_factory=Counter)  # "4xx:429", "non_4xx:ReadTimeout", ...
    lost: int = 0
    counts: Counter[str] = field(default_factory=Counter)  # steps, samples, requests

    def ok(self, kind: str, seconds: float) -> None:
        with self.lock:
            self.latency.setdefault(kind, []).append(seconds)
            self.counts["requests"] += 1

    def failed(self, error: BaseException) -> None:
        import tinker

        status = getattr(error, "status_code", None)
        with self.lock:
            if isinstance(error, (FutureTimeout, TimeoutError)):
                self.lost += 1
            elif isinstance(error, tinker.APIStatusError) and status is not None and 400 <= int(status) < 500:
                self.errors[f"4xx:{status}"] += 1
            else:
                self.errors[f"non_4xx:{type(error).__name__}:{status}"] += 1


def _timed(tally: Tally, kind: str, bound: float, call: Callable[[], Any]) -> Any:
    """`call()` gives a future (or a result); its result within `bound` seconds, timed under `kind`."""
    t0 = time.perf_counter()
    out = call()
    if hasattr(out, "result"):
        out = out.result(timeout=bound)
    tally.ok(kind, time.perf_counter() - t0)
    return out


def _datums(rng: np.random.Generator, vocab: int, rows: int = 2, tokens: int = 32) -> list[Any]:
    from tinker import types

    out = []
    for _ in range(rows):
        ids = rng.integers(5, vocab, size=tokens + 1).tolist()
        out.append(types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]),
                               loss_fn_inputs={"target_tokens": ids[1:], "weights": [1.0] * tokens}))
    return out


def _rl_datums(prompt: list[int], samples: Any) -> list[Any]:
    """importance_sampling data from one prompt's samples: advantages are the rewards centred over the group."""
    from tinker import types

    seqs = [s for s in samples.sequences if s.tokens]
    rewards = [float(len(set(s.tokens))) for s in seqs]  # any deterministic score
    mean = statistics.fmean(rewards) if rewards else 0.0
    out = []
    for seq, reward in zip(seqs, rewards):
        full = prompt + list(seq.tokens)
        n, m = len(prompt), len(seq.tokens)
        out.append(types.Datum(
            model_input=types.ModelInput.from_ints(full[:-1]),
            loss_fn_inputs={"target_tokens": full[1:], "logprobs": [0.0] * (n - 1) + list(seq.logprobs or [0.0] * m),
                            "advantages": [0.0] * (n - 1) + [reward - mean] * m}))
    return out


def _client(i: int, sc: Any, rest: Any, base_model: str, vocab: int, stop: threading.Event, tally: Tally,
            bound: float) -> None:
    from tinker import types

    role = ROLES[i % len(ROLES)]
    rng = np.random.default_rng(i)
    adam = types.AdamParams(learning_rate=1e-4)
    try:
        tc = _timed(tally, "create_model", bound, lambda: sc.create_lora_training_client(
            base_model=base_model, rank=4, seed=i))
    except BaseException as e:  # noqa: BLE001 - counted; this client stops
        tally.failed(e)
        return
    sampler, step = None, 0
    while not stop.is_set():
        try:
            if role == "sft":
                data = _datums(rng, vocab)
                _timed(tally, "forward_backward", bound, lambda: tc.forward_backward(data, "cross_entropy"))
                _timed(tally, "optim_step", bound, lambda: tc.optim_step(adam))
                with tally.lock:
                    tally.counts["steps"] += 1
            elif role == "rl":
                if sampler is None or step % SAMPLER_EVERY == 0:
                    sampler = _timed(tally, "save_for_sampler", bound,
                                     lambda: tc.save_weights_and_get_sampling_client(f"rl{step}"))
                prompt = rng.integers(5, vocab, size=8).tolist()
                params = types.SamplingParams(max_tokens=8, temperature=1.0, seed=step)
                got = _timed(tally, "sample", bound, lambda: sampler.sample(
                    types.ModelInput.from_ints(prompt), num_samples=4, sampling_params=params))
                data = _rl_datums(prompt, got)
                _timed(tally, "forward_backward", bound, lambda: tc.forward_backward(data, "importance_sampling"))
                _timed(tally, "optim_step", bound, lambda: tc.optim_step(adam))
                with tally.lock:
                    tally.counts["steps"] += 1
                    tally.counts["samples"] += len(got.sequences)
            else:
                runs = _timed(tally, "list_runs", bound, lambda: rest.list_training_runs(limit=20))
                if runs.training_runs:
                    run_id = runs.training_runs[0].training_run_id
                    _timed(tally, "get_run", bound, lambda: rest.get_training_run(run_id))
                _timed(tally, "list_checkpoints", bound, lambda: rest.list_user_checkpoints())
                if step % SAVE_EVERY == 0:
                    _timed(tally, "save_state", bound, lambda: tc.save_state(f"s{step}"))
                time.sleep(0.2)  # a person's pace of reads, not a loop's
            step += 1
        except BaseException as e:  # noqa: BLE001 - counted; the client goes on
            tally.failed(e)
            time.sleep(0.5)


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def _pct(values: list[float], q: float) -> float:
    return round(1000 * float(np.percentile(values, q)), 1) if values else 0.0


def run(clients: int, tenants: int, seconds: float, rss_every: float = 5.0, future_timeout: float = 120.0,
        work_dir: Path | None = None, warmup: float | None = None, result_ttl: float | None = None) -> dict[str, Any]:
    import tinker

    from tests.support.server import ServerProcess
    from tests.support.tiny_model import build_tiny_model

    with tempfile.TemporaryDirectory(dir=work_dir) as tmp:
        folder = build_tiny_model(Path(tmp) / "tiny")
        vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
        env = {"TWINKLE_RESULT_TTL_SECONDS": str(result_ttl)} if result_ttl else None
        srv = ServerProcess(Path(tmp) / "data", str(folder), env=env)
        keys = [srv.create_key(f"load-{t}") for t in range(tenants)]
        srv.start()
        assert srv.proc is not None
        tally, stop = Tally(), threading.Event()
        rss: list[tuple[float, float]] = []
        try:
            services = [tinker.ServiceClient(base_url=srv.base_url, api_key=k) for k in keys]
            rests = [tinker.RestClient(base_url=srv.base_url, api_key=k) for k in keys]
            threads = [threading.Thread(target=_client, daemon=True, args=(
                i, services[i % tenants], rests[i % tenants], str(folder), vocab, stop, tally, future_timeout))
                for i in range(clients)]
            start = time.monotonic()
            for t in threads:
                t.start()
            while (elapsed := time.monotonic() - start) < seconds:
                rss.append((elapsed, _rss_mb(srv.proc.pid)))
                time.sleep(min(rss_every, max(0.0, seconds - elapsed)))
            stop.set()
            for t in threads:
                t.join(timeout=future_timeout + 30)
            wall = time.monotonic() - start
            stuck = sum(t.is_alive() for t in threads)  # a client still waiting past every bound
            alive = srv.proc.poll() is None
        finally:
            srv.stop()
    warm_s = seconds / 5 if warmup is None else warmup
    warm = [m for t, m in rss if t <= warm_s] or [rss[0][1]]
    tail = [m for t, m in rss if t >= seconds * 3 / 4] or [rss[-1][1]]
    growth = 100 * (statistics.median(tail) - warm[-1]) / warm[-1]
    non_4xx = sum(n for k, n in tally.errors.items() if k.startswith("non_4xx"))
    per_s = {f"{k}_per_s": round(tally.counts[k] / wall, 2) for k in ("steps", "samples", "requests")}
    latency = {k: {"n": len(v), "p50": _pct(v, 50), "p99": _pct(v, 99)} for k, v in sorted(tally.latency.items())
               if k != "create_model"}
    out = {
        "benchmark": "load_campaign", "model": "tiny", "clients": clients, "tenants": tenants,
        "seconds": round(wall, 1), "warmup_s": warm_s, "result_ttl_s": result_ttl or 900.0,
        "roles": {r: len(range(ROLES.index(r), clients, len(ROLES))) for r in ROLES}, **per_s, "latency_ms": latency,
        "errors": dict(tally.errors), "non_4xx_errors": non_4xx, "lost_futures": tally.lost + stuck,
        "server_alive": alive,
        "rss_mb": {"after_warmup": round(warm[-1], 1), "last_quarter_median": round(statistics.median(tail), 1),
                   "max": round(max(m for _, m in rss), 1)},
        "rss_growth_pct": round(growth, 1),
        "rss_series_mb": [[round(t), round(m)] for t, m in rss[:: max(1, len(rss) // 12)]],
    }
    out["targets_met"] = non_4xx == 0 and out["lost_futures"] == 0 and alive and growth < 10
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--clients", type=int, default=50)
    ap.add_argument("--tenants", type=int, default=10)
    ap.add_argument("--seconds", type=float, default=300)
    ap.add_argument("--rss-every", type=float, default=5.0)
    ap.add_argument("--future-timeout", type=float, default=120.0)
    ap.add_argument("--warmup", type=float, default=None, help="seconds before growth is measured (default 1/5)")
    ap.add_argument("--result-ttl", type=float, default=None, help="the server's TWINKLE_RESULT_TTL_SECONDS")
    args = ap.parse_args()
    print(json.dumps(run(args.clients, args.tenants, args.seconds, args.rss_every, args.future_timeout,
                         warmup=args.warmup, result_ttl=args.result_ttl)))


if __name__ == "__main__":
    main()
