"""Gateway CPU per training step, in process: the app driven as ASGI on one event loop, no HTTP, no compute.

A step is what the SDK sends per SFT step: forward_backward (protobuf, `--batch` ROWSxTOKENS), optim_step, and
retrieve_future of both. A no-op worker on the in-process queue answers every job with a constant result, so what
is measured is the gateway's own work (auth, parsing, validation, job building, admission, queueing, result
encoding). CPU time of the process (GC off, after a warm-up), the minimum over `--rounds` rounds of `--steps`,
and per request kind. On a shared VM this is steadier than the wall-clock benchmarks; to compare two trees run
this file from each (it works with the contract before and after typed results). Prints one JSON line.
`--client native`: the same step as twinkle_client sends it (forward_backward + clip_grad_and_step, each answered
when its job is done) on the native routes, per request kind too.
Usage: python benchmarks/gateway_cpu.py [--batch 4x64] [--steps 200] [--rounds 7] [--client tinker|native]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import struct
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.pop("TWINKLE_DATABASE_URL", None)
os.environ.pop("TWINKLE_REDIS_URL", None)

import numpy as np  # noqa: E402
from tinker.proto import tinker_public_pb2 as pb  # noqa: E402

import api_schemas.jobs as jobs  # noqa: E402
from api_schemas.models import ServedModel  # noqa: E402
from jobqueue.local_queue import LocalQueue  # noqa: E402
from server.app import create_app  # noqa: E402
from server.config import Settings  # noqa: E402
from server.services.tenants import create_key  # noqa: E402

MODEL = "bench/noop"
ADAM = {"learning_rate": 1e-4, "beta1": 0.9, "beta2": 0.95, "eps": 1e-12, "weight_decay": 0.0, "grad_clip_norm": 0.0}
TYPED = hasattr(jobs, "ForwardBackwardResult")  # the engine-native results (an older tree answers bytes)


def constant_result(job: jobs.Job, rows: int, tokens: int) -> jobs.JobResult:
    kind = job.payload.kind
    outs = [{"logprobs": np.zeros(tokens, "f4"), "elementwise_loss": np.zeros(tokens, "f4")} for _ in range(rows)]
    if TYPED:
        if kind == "forward_backward":
            return jobs.JobResult(job_id=job.job_id, output=jobs.ForwardBackwardResult.of(outs, {"loss:sum": 1.0}))
        if kind == "optim_step":
            return jobs.JobResult(job_id=job.job_id, output=jobs.OptimStepResult(metrics={"grad_norm": 1.0},
                                                                                 learning_rate=0.0, step=1))
        return jobs.JobResult(job_id=job.job_id, output=jobs.ModelReady(model_id=job.model_id))
    if kind == "forward_backward":  # pragma: no cover - the tree before typed results
        from api_schemas.tinker.proto import encode_forward_backward_output  # type: ignore[attr-defined]

        body = encode_forward_backward_output(outs, {"loss:sum": 1.0})
        return jobs.JobResult(job_id=job.job_id, media_type="application/x-protobuf", body=body)  # type: ignore[call-arg]
    return jobs.JobResult(job_id=job.job_id, body=b'{"metrics": {}}')  # type: ignore[call-arg]


def request_body(model_id: str, seq: int, batch: list[list[int]]) -> bytes:
    msg = pb.ForwardBackwardRequest(model_id=model_id, seq_id=seq, loss_fn="cross_entropy")
    for row in batch:
        n = len(row) - 1
        d = pb.Datum(model_input=[pb.Chunk(encoded_text=pb.EncodedTextChunk(tokens=struct.pack(f"<{n}i", *row[:-1])))])
        d.loss_fn_inputs["target_tokens"].CopyFrom(
            pb.Tensor(dense=np.asarray(row[1:], "<i8").tobytes(), dtype=pb.DTYPE_INT64, shape=[n]))
        d.loss_fn_inputs["weights"].CopyFrom(pb.Tensor(dense=np.ones(n, "<f4").tobytes(), dtype=pb.DTYPE_FLOAT32, shape=[n]))
        msg.data.append(d)
    return msg.SerializeToString()


async def call(app, path: str, body: bytes, headers: dict[str, str]) -> tuple[int, bytes]:  # type: ignore[no-untyped-def]
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "", "state": {},
             "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()]
             + [(b"content-length", str(len(body)).encode())],
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80)}
    sent = False
    status, content = 0, bytearray()

    async def receive() -> dict:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await asyncio.sleep(3600)
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]
        elif message["type"] == "http.response.body":
            content.extend(message.get("body", b""))

    await app(scope, receive, send)
    return status, bytes(content)


async def run(args: argparse.Namespace) -> dict:
    rows, tokens = (int(x) for x in args.batch.split("x"))
    batch = np.random.default_rng(0).integers(3, 300, size=(rows, tokens + 1)).tolist()
    queue = LocalQueue()

    async def worker() -> None:
        answers: dict[str, jobs.JobResult] = {}
        while True:
            for job in await queue.fetch(jobs.queue_name(MODEL, "train"), 1.0):
                kind = job.payload.kind
                if kind not in answers:
                    answers[kind] = constant_result(job, rows, tokens)
                await queue.complete(answers[kind].model_copy(update={"job_id": job.job_id}), job=job)

    served = ServedModel(name=MODEL, vocab_size=1000, max_context=4096, tokenizer_id=MODEL)
    app = create_app(Settings(data_dir=Path(tempfile.mkdtemp()), long_poll_seconds=5), queue, {MODEL: served},
                     background=[worker])
    async with app.router.lifespan_context(app):
        key, _ = await create_key(app.state.ctx.db, "bench")
        headers = {"X-API-Key": key, "content-type": "application/json"}
        proto = {**headers, "content-type": "application/x-protobuf"}

        async def post(path: str, body: bytes | dict, hdrs: dict[str, str] = headers) -> bytes:
            status, content = await call(app, path, body if isinstance(body, bytes) else json.dumps(body).encode(), hdrs)
            assert status == 200, (path, status, content[:300])
            return content

        session = json.loads(await post("/api/v1/create_session", {"tags": []}))["session_id"]
        made = json.loads(await post("/api/v1/create_model", {"session_id": session, "model_seq_id": 0,
                                                              "base_model": MODEL, "lora_config": {"rank": 1}}))
        await post("/api/v1/retrieve_future", {"request_id": made["request_id"]})
        model, seq = made["model_id"], 1
        parts = [0.0, 0.0, 0.0, 0.0]
        native_url = f"/api/v1/model/{MODEL}/twinkle"
        native_rows = [{"input_ids": row[:-1], "labels": row[1:]} for row in batch]
        if args.client == "native":
            auth = {"Authorization": f"Bearer {key}", "content-type": "application/json"}
            sid = json.loads(await post("/api/v1/twinkle/create_session", {"metadata": None}, auth))["session_id"]
            auth["X-Twinkle-Session-Id"] = sid
            await post(f"{native_url}/add_adapter_to_model", {"adapter_name": "a", "config": '{"r": 1}'}, auth)
            await post(f"{native_url}/set_optimizer", {"adapter_name": "a", "optimizer_cls": "AdamW"}, auth)

        async def native_step() -> None:
            t0 = time.process_time()
            await post(f"{native_url}/forward_backward", {"adapter_name": "a", "inputs": native_rows}, auth)
            t1 = time.process_time()
            await post(f"{native_url}/clip_grad_and_step", {"adapter_name": "a", "max_grad_norm": 0.0}, auth)
            t2 = time.process_time()
            parts[0] += t1 - t0
            parts[1] += t2 - t1

        async def tinker_step() -> None:
            nonlocal seq
            body = request_body(model, seq, batch)
            t0 = time.process_time()
            fb = json.loads(await post("/api/v1/forward_backward", body, proto))["request_id"]
            t1 = time.process_time()
            opt = json.loads(await post("/api/v1/optim_step", {"model_id": model, "seq_id": seq + 1,
                                                               "adam_params": ADAM}))["request_id"]
            t2 = time.process_time()
            seq += 2
            for _ in range(3):  # the worker answers both (outside the measured requests)
                await asyncio.sleep(0)
            t3 = time.process_time()
            await post("/api/v1/retrieve_future", {"request_id": fb})
            t4 = time.process_time()
            await post("/api/v1/retrieve_future", {"request_id": opt})
            t5 = time.process_time()
            for k, dt in enumerate((t1 - t0, t2 - t1, t4 - t3, t5 - t4)):
                parts[k] += dt

        step = native_step if args.client == "native" else tinker_step
        for _ in range(50):
            await step()
        gc.collect()
        gc.disable()
        parts[:] = [0.0] * 4
        rounds = []
        for _ in range(args.rounds):
            start = time.process_time()
            for _ in range(args.steps):
                await step()
            rounds.append((time.process_time() - start) / args.steps * 1e3)
        gc.enable()
    n = args.rounds * args.steps
    names = (("forward_backward", "clip_grad_and_step") if args.client == "native" else
             ("forward_backward", "optim_step", "retrieve_forward_backward", "retrieve_optim_step"))
    return {"benchmark": "gateway_cpu", "client": args.client, "batch": args.batch, "steps": args.steps, "rounds": args.rounds,
            "typed_results": TYPED, "cpu_ms_per_step_min": round(min(rounds), 3),
            "cpu_ms_per_step_rounds": [round(r, 3) for r in sorted(rounds)],
            "us_per_request": {name: round(t / n * 1e6, 1) for name, t in zip(names, parts)}}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", default="4x64", help="ROWSxTOKENS")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--client", choices=["tinker", "native"], default="tinker")
    print(json.dumps(asyncio.run(run(ap.parse_args()))))


if __name__ == "__main__":
    main()
