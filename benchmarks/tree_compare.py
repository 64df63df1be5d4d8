"""This tree against an older one on the four end-to-end benchmarks, side by side in one run.

The older revision is checked out in a temporary git worktree; each round runs every benchmark once from each tree
(each tree's own copy of the benchmark file, in a child process with that tree first on the path), alternating which
tree goes first, so a change of load on a shared machine hits both alike. Each benchmark's headline figures are
collected per round; the report gives each figure's median per tree and the median of the per-round ratios
new/old, oriented so that a ratio above 1 means this tree is slower (times: new/old; throughputs: old/new).
Prints one JSON line.
Usage: python benchmarks/tree_compare.py --old REV [--rounds 3] [--only sft_overhead,queue_roundtrip,...]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

# benchmark -> (arguments, {figure: (reader of its JSON line, True when higher is better)})
Figures = dict[str, tuple[Callable[[dict[str, Any]], float], bool]]
BENCHMARKS: dict[str, tuple[list[str], Figures]] = {
    "sft_overhead": (["--steps", "20"], {"sdk_step_s": (lambda o: o["sdk_step_s"], False)}),
    "merged_step": (["--shapes", "16x64,4x512", "--repeats", "3"], {
        "16x64_merged_s": (lambda o: o["results"][0]["merged_s"], False),
        "4x512_merged_s": (lambda o: o["results"][1]["merged_s"], False),
    }),
    "queue_roundtrip": (["--jobs", "500", "--work-jobs", "100"], {
        "noop_p50_ms": (lambda o: o["noop_p50_ms"], False),
        "work_p50_ms": (lambda o: o["work_p50_ms"], False),
        "gateway_cpu_ms_per_job": (lambda o: o["gateway_cpu_ms_per_job"], False),
    }),
    "sdk_throughput": (["--clients", "1,4", "--seconds", "4", "--rounds", "1"], {
        "1_client_tokens_s": (lambda o: o["phases"][0]["tokens_per_s"], True),
        "4_clients_tokens_s": (lambda o: o["phases"][1]["tokens_per_s"], True),
    }),
}


def run_one(tree: Path, name: str, args: list[str]) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": str(tree), "HF_HUB_OFFLINE": "1", "OMP_WAIT_POLICY": "PASSIVE"}
    env.pop("TWINKLE_DATABASE_URL", None)
    env.pop("TWINKLE_REDIS_URL", None)
    done = subprocess.run([sys.executable, str(tree / "benchmarks" / f"{name}.py"), *args], cwd=tree, env=env,
                          capture_output=True, text=True, timeout=1800)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"{name} in {tree} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(lines[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--old", required=True, help="the git revision to compare with")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--only", default=",".join(BENCHMARKS))
    args = ap.parse_args()
    names = args.only.split(",")
    seen: dict[str, dict[str, list[float]]] = {}  # "tree:figure" -> per-round values
    with tempfile.TemporaryDirectory() as tmp:
        old = Path(tmp) / "old"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(old), args.old], check=True,
                       capture_output=True)
        try:
            for r in range(args.rounds):
                trees = [("old", old), ("new", ROOT)] if r % 2 == 0 else [("new", ROOT), ("old", old)]
                for name in names:
                    bench_args, figures = BENCHMARKS[name]
                    for label, tree in trees:
                        out = run_one(tree, name, bench_args)
                        for fig, (read, _) in figures.items():
                            seen.setdefault(fig, {}).setdefault(label, []).append(float(read(out)))
                    print(f"round {r + 1}: {name} done", file=sys.stderr, flush=True)
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(old)], capture_output=True)
    report: dict[str, Any] = {}
    for name in names:
        for fig, (_, higher_better) in BENCHMARKS[name][1].items():
            o, n = seen[fig]["old"], seen[fig]["new"]
            ratios = [(a / b if higher_better else b / a) for a, b in zip(o, n)]
            report[f"{name}.{fig}"] = {"old": o, "new": n, "old_median": statistics.median(o),
                                       "new_median": statistics.median(n),
                                       "slowdown_median": round(statistics.median(ratios), 3)}
    print(json.dumps({"benchmark": "tree_compare", "old": args.old, "rounds": args.rounds, "figures": report}))


if __name__ == "__main__":
    main()
