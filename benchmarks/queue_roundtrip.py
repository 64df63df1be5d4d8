"""Job round trip through gateway + Redis + dispatcher: p50/p99 of a no-op job, and the overhead of a 20 ms job.

A real gateway (`twinkle-server serve` with TWINKLE_REDIS_URL) and a real Dispatcher on the Redis queue, whose
executor does no work (or sleeps `--work-ms`) instead of training: what is measured is everything around the
compute. Each job is an optim_step submitted over HTTP and fetched with retrieve_future (keep-alive connection),
the way the SDK does it, with httpx (the SDK's HTTP client). The 20 ms jobs also run, interleaved, from the
standard library's http.client, which costs the client ~0.3 ms less per request: the difference between the two
ratios is the client library's share of the overhead, the rest is the server's. Also reported: the bare queue round trip (RedisQueue submit -> worker -> wait_result).
Starts its own redis-server on a free loopback port unless --redis-url is given. Prints one JSON line.

Usage: python benchmarks/queue_roundtrip.py [--jobs 1000] [--work-jobs 200] [--work-ms 20]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import http.client
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx  # noqa: E402

from api_schemas.jobs import Job, JobResult, OptimStep, OptimStepResult, queue_name  # noqa: E402
from api_schemas.training import AdamW
from api_schemas.models import ServedModel  # noqa: E402
from jobqueue.redis_queue import RedisQueue  # noqa: E402

MODEL = "bench/noop"
ADAM = {"learning_rate": 1e-3, "beta1": 0.9, "beta2": 0.95, "eps": 1e-12, "weight_decay": 0.0, "grad_clip_norm": 0.0}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (Linux /proc), to report CPU cost per job independent of load."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


async def worker(redis_url: str, prefix: str, work_file: Path) -> None:
    """A Dispatcher on the Redis queue whose executor sleeps as long as `work_file` says (ms), then answers."""
    from workers.dispatcher import Dispatcher

    q = RedisQueue(redis_url, prefix=prefix)
    await q.register_served(ServedModel(name=MODEL, vocab_size=1000, max_context=1024, tokenizer_id=MODEL))

    def execute(job: Job) -> JobResult:
        ms = float(work_file.read_text() or 0)
        if ms > 0:
            time.sleep(ms / 1000)
        return JobResult(job_id=job.job_id, output=OptimStepResult(metrics={}, learning_rate=0.0, step=0))

    await Dispatcher(q, queue_name(MODEL, "train"), execute).run()


Post = Callable[[str, dict], dict]


@contextlib.contextmanager
def httpx_client(base_url: str, api_key: str) -> Iterator[Post]:
    """httpx, the HTTP client the tinker SDK uses."""
    with httpx.Client(base_url=base_url, headers={"X-API-Key": api_key}, timeout=60) as http:
        def post(path: str, body: dict) -> dict:
            r = http.post(path, json=body)
            assert r.status_code == 200, r.text
            return r.json()  # type: ignore[no-any-return]
        yield post


@contextlib.contextmanager
def stdlib_client(base_url: str, api_key: str) -> Iterator[Post]:
    """http.client from the standard library: a lean client, to tell the server's overhead from httpx's."""
    url = urllib.parse.urlsplit(base_url)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=60)
    headers = {"X-API-Key": api_key, "Content-Type": "application/json"}

    def post(path: str, body: dict) -> dict:
        conn.request("POST", path, body=json.dumps(body), headers=headers)
        r = conn.getresponse()
        data = r.read()
        assert r.status == 200, data
        return json.loads(data)  # type: ignore[no-any-return]
    try:
        yield post
    finally:
        conn.close()


def http_roundtrips(client: Post, n: int, first_seq: int, model_id: str) -> list[float]:
    out = []
    for i in range(n):
        t0 = time.perf_counter()
        r = client("/api/v1/optim_step", {"model_id": model_id, "seq_id": first_seq + i, "adam_params": ADAM})
        res = client("/api/v1/retrieve_future", {"request_id": r["request_id"], "allow_metadata_only": False})
        assert "metrics" in res, res
        out.append(time.perf_counter() - t0)
    return out


async def queue_roundtrips(redis_url: str, prefix: str, n: int) -> list[float]:
    q = RedisQueue(redis_url, prefix=prefix)
    adam = AdamW(**ADAM)
    out = []
    for i in range(n):
        job = Job(job_id=str(uuid.uuid4()), tenant_id="bench", base_model=MODEL, model_id="bench-q", seq_id=i,
                  payload=OptimStep(optimizer=adam))
        t0 = time.perf_counter()
        await q.submit(job, dedup_key=f"bench-q#{i}")
        assert await q.wait_result(job.job_id, 10) is not None
        out.append(time.perf_counter() - t0)
    await q.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--jobs", type=int, default=1000)
    ap.add_argument("--work-jobs", type=int, default=200)
    ap.add_argument("--work-ms", type=float, default=20.0)
    ap.add_argument("--redis-url")
    ap.add_argument("--role", default="bench", help=argparse.SUPPRESS)
    ap.add_argument("--prefix", help=argparse.SUPPRESS)
    ap.add_argument("--work-file", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.role == "worker":  # on the loop `twinkle-server worker` runs on
        from deploy.loop import run_loop

        run_loop(worker(args.redis_url, args.prefix, Path(args.work_file)))
        return

    tmp = Path(tempfile.mkdtemp(prefix="twinkle-bench-"))
    procs: list[subprocess.Popen[bytes]] = []
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "HF_HUB_OFFLINE": "1", "TWINKLE_LOG_LEVEL": "WARNING"}
    try:
        redis_url = args.redis_url
        if redis_url is None:
            port = free_port()
            procs.append(subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                                           "--appendonly", "no"], stdout=subprocess.DEVNULL))
            redis_url = f"redis://127.0.0.1:{port}/0"
        prefix = f"bench{uuid.uuid4().hex[:8]}"
        env.update(TWINKLE_REDIS_URL=redis_url, TWINKLE_REDIS_PREFIX=prefix, TWINKLE_DATA_DIR=str(tmp))
        work_file = tmp / "work_ms"
        work_file.write_text("0")
        me = [sys.executable, __file__, "--role", "worker", "--redis-url", redis_url, "--prefix", prefix,
              "--work-file", str(work_file)]
        time.sleep(0.3)
        worker_proc = subprocess.Popen(me, env=env)
        procs.append(worker_proc)
        cli = [sys.executable, "-m", "deploy.cli"]
        key = subprocess.run([*cli, "keys", "create", "--tenant", "bench"], env=env, capture_output=True, text=True,
                             check=True).stdout.strip()
        gw_port = free_port()
        gateway = subprocess.Popen([*cli, "serve", "--port", str(gw_port), "--log-level", "WARNING"], env=env,
                                   stdout=subprocess.DEVNULL, stderr=open(tmp / "gateway.log", "wb"))
        procs.append(gateway)
        base_url = f"http://127.0.0.1:{gw_port}"
        with httpx.Client(base_url=base_url, headers={"X-API-Key": key}, timeout=60) as http:
            for _ in range(600):
                try:
                    caps = http.get("/api/v1/get_server_capabilities")
                    if caps.status_code == 200 and caps.json()["supported_models"]:
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(0.1)
            sid = http.post("/api/v1/create_session", json={"tags": []}).json()["session_id"]
            made = http.post("/api/v1/create_model", json={"session_id": sid, "model_seq_id": 0, "base_model": MODEL,
                                                           "lora_config": {"rank": 1}}).json()
            http.post("/api/v1/retrieve_future", json={"request_id": made["request_id"]})
        model_id = made["model_id"]
        with httpx_client(base_url, key) as client, stdlib_client(base_url, key) as lean:
            http_roundtrips(client, 50, 1, model_id)  # warm-up
            cpu0 = (cpu_seconds(gateway.pid), cpu_seconds(worker_proc.pid))
            noop = http_roundtrips(client, args.jobs, 51, model_id)
            cpu1 = (cpu_seconds(gateway.pid), cpu_seconds(worker_proc.pid))
            work_file.write_text(str(args.work_ms))
            seq = 51 + args.jobs
            work, work_lean = [], []
            for _ in range(args.work_jobs // 20):  # the two clients alternate, so a change of load hits both
                work += http_roundtrips(client, 10, seq, model_id)
                work_lean += http_roundtrips(lean, 10, seq + 10, model_id)
                seq += 20
            work_file.write_text("0")
        bare = asyncio.run(queue_roundtrips(redis_url, prefix, args.jobs))
        ms = 1000.0
        print(json.dumps({
            "benchmark": "queue_roundtrip", "jobs": args.jobs, "cpus": os.cpu_count(),
            "loadavg_1m": round(os.getloadavg()[0], 2),
            "noop_p50_ms": round(pct(noop, 0.5) * ms, 3), "noop_p99_ms": round(pct(noop, 0.99) * ms, 3),
            "queue_only_p50_ms": round(pct(bare, 0.5) * ms, 3), "queue_only_p99_ms": round(pct(bare, 0.99) * ms, 3),
            "gateway_cpu_ms_per_job": round((cpu1[0] - cpu0[0]) * ms / args.jobs, 3),
            "worker_cpu_ms_per_job": round((cpu1[1] - cpu0[1]) * ms / args.jobs, 3),
            "work_ms": args.work_ms, "work_p50_ms": round(pct(work, 0.5) * ms, 3),
            "overhead_ratio_p50": round(pct(work, 0.5) * ms / args.work_ms, 3),
            "overhead_ratio_mean": round(sum(work) / len(work) * ms / args.work_ms, 3),
            "lean_client_work_p50_ms": round(pct(work_lean, 0.5) * ms, 3),
            "lean_client_overhead_ratio_p50": round(pct(work_lean, 0.5) * ms / args.work_ms, 3),
        }))
    finally:
        for p in reversed(procs):
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()


if __name__ == "__main__":
    main()
