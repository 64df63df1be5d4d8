"""End-to-end training throughput through the stock tinker SDK: aggregate tokens/s of 1, 4 and 16 concurrent
training clients on ONE `twinkle-server serve` (embedded mode), the server started once for all phases.

Each client (its own ServiceClient, session and LoRA, on its own thread) runs SFT steps for `--seconds`:
forward_backward on its batch + optim_step, submitted back to back as the cookbook does, then waits for both.
Clients wait at a barrier after a warm-up step; every phase then runs equally long (the steps finished by the time
the last client stops count), so one client's phase is as long as sixteen's. CPU seconds of the server process
and of the clients' process per client step are reported too (both share the machine's cores). With `--rounds` > 1 the phases
run again in reverse order, alternately (1,4,16,16,4,1,...), and each phase reports its median, so a change of
load on a shared machine hits every phase alike. Prints one JSON line with the tokens/s of each phase and each
phase's ratio to the first one.

Usage: python benchmarks/sdk_throughput.py [--model tiny|smollm2] [--clients 1,4,16] [--seconds 4] [--batch 1x64]
       [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from benchmarks.merged_step import MODELS, model_folder  # noqa: E402


def cpu_seconds(pid: int | None = None) -> float:
    """User + system CPU seconds of a process (this one when pid is None), all its threads."""
    if pid is None:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return usage.ru_utime + usage.ru_stime
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run_phase(base_url: str, key: str, base_model: str, clients: int, seconds: float, rows: int, tokens: int,
              vocab: int, rank: int, server_pid: int | None = None) -> dict:
    import tinker
    from tinker import types

    ready = threading.Barrier(clients + 1)
    done = threading.Barrier(clients + 1)
    stop = threading.Event()
    steps_done = [0] * clients
    errors: list[BaseException] = []

    def client(i: int) -> None:
        try:
            rng = np.random.default_rng(i)
            batch = rng.integers(3, vocab, size=(rows, tokens + 1)).tolist()
            data = [types.Datum(model_input=types.ModelInput.from_ints(b[:-1]),
                                loss_fn_inputs={"target_tokens": b[1:], "weights": [1.0] * tokens}) for b in batch]
            with tinker.ServiceClient(base_url=base_url, api_key=key) as sc:
                tc = sc.create_lora_training_client(base_model=base_model, rank=rank, seed=i).result()

                def step() -> None:
                    fb = tc.forward_backward(data, "cross_entropy")
                    opt = tc.optim_step(types.AdamParams(learning_rate=1e-4))
                    fb.result()
                    opt.result()

                step()  # warm-up
                ready.wait()
                while not stop.is_set():
                    step()
                    steps_done[i] += 1
                done.wait()
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)
            ready.abort()
            done.abort()

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(clients)]
    for t in threads:
        t.start()
    ready.wait()
    start = time.perf_counter()
    cpu0 = (cpu_seconds(), cpu_seconds(server_pid) if server_pid else 0.0)
    time.sleep(seconds)
    stop.set()
    done.wait()
    wall = time.perf_counter() - start
    cpu1 = (cpu_seconds(), cpu_seconds(server_pid) if server_pid else 0.0)
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    steps = sum(steps_done)
    return {"clients": clients, "wall_s": round(wall, 3), "tokens_per_s": round(steps * rows * tokens / wall, 1),
            "client_cpu_ms_per_step": round(1000 * (cpu1[0] - cpu0[0]) / steps, 1),
            "server_cpu_ms_per_step": round(1000 * (cpu1[1] - cpu0[1]) / steps, 1)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", choices=MODELS, default="tiny")
    ap.add_argument("--clients", default="1,4,16")
    ap.add_argument("--seconds", type=float, default=4.0, help="length of each timed phase")
    ap.add_argument("--batch", default="1x64", help="ROWSxTOKENS per client and step")
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--server-threads", type=int, default=0,
                    help="torch threads of the server process (OMP_NUM_THREADS; 0: torch's default)")
    args = ap.parse_args()
    rows, tokens = (int(x) for x in args.batch.split("x"))
    from tests.support.server import ServerProcess

    with tempfile.TemporaryDirectory() as tmp:
        folder = model_folder(args.model, Path(tmp))
        vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
        env = {"OMP_NUM_THREADS": str(args.server_threads)} if args.server_threads else None
        srv = ServerProcess(Path(tmp) / "data", str(folder), env=env)
        key = srv.create_key("bench")
        srv.start()
        counts = [int(n) for n in args.clients.split(",")]
        runs: dict[int, list[dict]] = {n: [] for n in counts}
        try:
            for r in range(args.rounds):
                for n in counts if r % 2 == 0 else counts[::-1]:
                    runs[n].append(run_phase(srv.base_url, key, str(folder), n, args.seconds, rows, tokens, vocab,
                                             args.rank, srv.proc.pid if srv.proc else None))
        finally:
            srv.stop()
    phases = []
    for n in counts:
        rates = [x["tokens_per_s"] for x in runs[n]]
        phases.append({"clients": n, "tokens_per_s": round(statistics.median(rates), 1), "runs": rates,
                       "server_cpu_ms_per_step": statistics.median(x["server_cpu_ms_per_step"] for x in runs[n]),
                       "client_cpu_ms_per_step": statistics.median(x["client_cpu_ms_per_step"] for x in runs[n])})
    one = phases[0]["tokens_per_s"]
    for p in phases:
        p["vs_first"] = round(p["tokens_per_s"] / one, 3)
    print(json.dumps({"benchmark": "sdk_throughput", "model": args.model, "batch_per_client": args.batch,
                      "seconds": args.seconds, "rank": args.rank, "rounds": args.rounds, "server_threads": args.server_threads or "default", "phases": phases}))


if __name__ == "__main__":
    main()
