"""The embedded default sampler: batched decoding with a KV cache on a torch base model, many adapters per batch.

Requests arrive from the event loop (`sample`) into an inbox; one engine thread admits them into the running
batch between decode steps (continuous batching: a new request does not wait for the batch to drain), decodes all
rows in one forward pass per step, and hands each finished request's SampleResponse back to the loop.

Sharing the base model: in embedded mode the sampler runs on the trainer's BaseModel instance (one copy of the
weights). multi_lora's routing is thread-local, and the sampler's thread routes its rows through its own adapters
(a FrozenAdapters set the trainer's routing never sees), so the trainer's forward/backward and the sampler's decode
steps may run concurrently.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from api_schemas.jobs import Sample, SampleResult
from workers import metrics
from workers.checkpoints.store import CheckpointStore
from workers.engine.base_model import BaseModel
from workers.engine.multi_lora import FrozenAdapters
from workers.sampling.adapters import AdapterSlots
from workers.sampling.base import (
    SamplerBackend,
    SamplerConfig,
    SamplerUserError,
    eos_token_ids,
    to_result,
)
from workers.sampling.kv_batch import KVBatch
from workers.sampling.requests import ActiveRequest, Row, prompt_scores
from workers.sampling.select import Detokenizer, choose_tokens

log = logging.getLogger(__name__)

PREFILL_LOGITS_BUDGET = 1 << 26  # logits elements of one joint prefill (256 MiB in float32)


@dataclass
class _Inbound:
    spec: Sample
    future: asyncio.Future[SampleResult]
    loop: asyncio.AbstractEventLoop


class TorchSampler(SamplerBackend):
    def __init__(self, config: SamplerConfig, store: CheckpointStore, base: BaseModel | None = None) -> None:
        self.config = config
        self.store = store
        self.base = base
        self._inbox: queue.Queue[_Inbound | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        self.steps = 0  # decode steps run (a batch of rows counts once)

    async def start(self) -> None:
        if self.base is None:
            c = self.config
            self.base = await asyncio.to_thread(BaseModel, c.model_name, c.model_folder, c.dtype, c.device)
        base = self.base
        self.max_context = self.config.max_context or base.max_context
        self.base_vocab = base.vocab_size
        self.eos = eos_token_ids(self.config.model_folder)
        self.detok = Detokenizer(self.config.model_folder)
        self.lora = FrozenAdapters(base.layers)
        self.slots = AdapterSlots(self.lora, self.store, self.config.max_loaded_adapters)
        self.batch = KVBatch(base.model, self.lora)
        self._thread = threading.Thread(target=self._engine, name="twinkle-sampler", daemon=True)
        self._thread.start()

    async def close(self) -> None:
        if self._thread is not None:
            self._inbox.put(None)
            await asyncio.to_thread(self._thread.join, 30)
            self._thread = None
            self.lora.close()

    async def sample(self, spec: Sample) -> SampleResult:
        if self._thread is None:
            raise RuntimeError("the sampler is not started")
        self._check(spec)
        loop = asyncio.get_running_loop()
        future: asyncio.Future[SampleResult] = loop.create_future()
        self._inbox.put(_Inbound(spec, future, loop))
        return await future

    def _check(self, spec: Sample) -> None:
        assert self.base is not None
        n = len(spec.prompt_tokens)
        if n == 0:
            raise SamplerUserError("the prompt is empty")
        if n >= self.max_context:
            raise SamplerUserError(f"the prompt has {n} tokens; this model's context is {self.max_context}")
        if min(spec.prompt_tokens) < 0 or max(spec.prompt_tokens) >= self.base.vocab_size:
            raise SamplerUserError(f"prompt token ids must lie in [0, {self.base.vocab_size})")
        if spec.params.max_tokens < 1 or spec.num_samples < 1:
            raise SamplerUserError("max_tokens and num_samples must be at least 1")
        if spec.params.stop_strings and not self.detok.available:
            raise SamplerUserError("this model has no tokenizer.json, so stop strings are not supported")

    # --- engine thread ---

    def _engine(self) -> None:
        waiting: list[_Inbound] = []
        active: list[ActiveRequest] = []
        rows: list[Row] = []
        batch_rows = metrics.SAMPLER_BATCH.labels(self.config.model_name)
        with torch.inference_mode():
            while self._receive(waiting, block=not rows and not waiting):
                try:
                    waiting = self._admit(waiting, active, rows)
                    if rows:
                        batch_rows.observe(len(rows))
                        logits = self.batch.decode([r.tokens[-1] for r in rows])
                        self.steps += 1
                        self._advance(rows, logits)
                        self._retire(rows, active)
                except Exception:  # a fault in the shared batch fails its requests; the engine goes on
                    log.exception("sampler step failed")
                    self._fail_all([], active)
                    rows.clear()
                    self.batch.select([])
            self._fail_all(waiting, active)

    def _receive(self, waiting: list[_Inbound], block: bool) -> bool:
        """Move the inbox into `waiting` (waiting for one item when idle); False once asked to stop."""
        try:
            item = self._inbox.get() if block else self._inbox.get_nowait()
            while True:
                if item is None:
                    return False
                waiting.append(item)
                item = self._inbox.get_nowait()
        except queue.Empty:
            return True

    def _admit(self, waiting: list[_Inbound], active: list[ActiveRequest], rows: list[Row]) -> list[_Inbound]:
        """Start what fits in the batch (one request at least, when the batch is empty); prefill them together."""
        chosen: list[_Inbound] = []
        left: list[_Inbound] = []
        used = len(rows)
        for item in waiting:
            if item.future.cancelled():
                continue
            n = item.spec.num_samples
            if (used or chosen) and used + n > self.config.max_batch_rows:
                left.append(item)
                continue
            chosen.append(item)
            used += n
        group: list[_Inbound] = []
        for item in chosen:  # joint prefills, each within the logits budget
            width = max([len(i.spec.prompt_tokens) for i in group] + [len(item.spec.prompt_tokens)])
            if group and (len(group) + 1) * width * self.base_vocab > PREFILL_LOGITS_BUDGET:
                self._start_group(group, active, rows)
                group = []
            group.append(item)
        if group:
            self._start_group(group, active, rows)
        return left

    def _start_group(self, group: list[_Inbound], active: list[ActiveRequest], rows: list[Row]) -> None:
        ready: list[tuple[_Inbound, str | None]] = []
        for item in group:
            try:
                ready.append((item, self.slots.acquire(item.spec.weights)))
            except Exception as e:  # noqa: BLE001 - a bad adapter fails its own request only
                _resolve(item.loop, item.future, error=e)
        if not ready:
            return
        scored = any(i.spec.prompt_logprobs or i.spec.topk_prompt_logprobs > 0 for i, _ in ready)
        try:
            prefilled = self.batch.prefill_many([list(i.spec.prompt_tokens) for i, _ in ready], [s for _, s in ready],
                                                all_logits=scored)
        except Exception as e:  # these requests' prefill failed before they joined the batch
            log.exception("sampler prefill failed")
            for item, _ in ready:
                self.slots.release(item.spec.weights)
                _resolve(item.loop, item.future, error=e)
            return
        for (item, slot), (cache, logits) in zip(ready, prefilled):
            try:
                self._start_request(item, slot, cache, logits, active, rows)
            except Exception as e:  # this request fails before its rows join the batch
                log.exception("sampler could not start a request")
                self.slots.release(item.spec.weights)
                _resolve(item.loop, item.future, error=e)

    def _start_request(self, item: _Inbound, slot: str | None, cache: DynamicCache, logits: torch.Tensor,
                       active: list[ActiveRequest], rows: list[Row]) -> None:
        """Score the prompt, pick each sample's first token, and merge the rows still going into the batch."""
        spec = item.spec
        req = ActiveRequest(spec=spec, loop=item.loop, future=item.future, slot=slot, eos=self.eos,
                            max_context=self.max_context)
        if spec.prompt_logprobs or spec.topk_prompt_logprobs > 0:
            req.output = prompt_scores(spec, logits)
        new_rows = req.make_rows()
        last = logits[-1:].expand(len(new_rows), -1)
        self._advance(new_rows, last)
        live = [i for i, r in enumerate(new_rows) if not r.done]
        if live:
            if len(new_rows) > 1:
                cache.batch_repeat_interleave(len(new_rows))
                if len(live) < len(new_rows):
                    cache.batch_select_indices(torch.tensor(live, device=logits.device))
            self.batch.merge(cache, len(spec.prompt_tokens), [slot] * len(live))
            rows.extend(new_rows[i] for i in live)
            self._regroup(rows)
        active.append(req)
        self._finish_ready(active)

    def _regroup(self, rows: list[Row]) -> None:
        """Row objects follow the batch's adapter grouping (KVBatch.merge sorts rows by slot, stably)."""
        rows.sort(key=lambda r: (r.request.slot is not None, r.request.slot or ""))

    def _advance(self, rows: list[Row], logits: torch.Tensor) -> None:
        """Pick each row's next token from its logits (B, V) and update its stop state."""
        logits = logits.float()
        lse = torch.logsumexp(logits, dim=-1, keepdim=True)  # log p = logit - lse: no (B, V) log-softmax
        params = [r.request.spec.params for r in rows]
        device = logits.device
        temperature = torch.tensor([p.temperature for p in params], device=device)
        top_k = torch.tensor([p.top_k for p in params], device=device)
        top_p = torch.tensor([p.top_p for p in params], device=device)
        uniforms = torch.stack([torch.rand((), generator=r.generator) for r in rows]).to(device)
        tokens = choose_tokens(logits, temperature, top_k, top_p, uniforms)
        chosen = (logits.gather(1, tokens[:, None]) - lse)[:, 0]
        k = max(r.request.spec.topk_sample_logprobs for r in rows)
        top = None
        if k > 0:
            best = logits.topk(k, dim=-1)
            top = (best.indices, best.values - lse)
        tokens_l, chosen_l = tokens.tolist(), chosen.tolist()
        for i, row in enumerate(rows):
            topk_row = None
            if top is not None and row.request.spec.topk_sample_logprobs > 0:
                kk = row.request.spec.topk_sample_logprobs
                topk_row = (top[0][i, :kk].cpu().numpy(), top[1][i, :kk].cpu().numpy())
            row.push(tokens_l[i], chosen_l[i], topk_row, self.detok)

    def _retire(self, rows: list[Row], active: list[ActiveRequest]) -> None:
        keep = [i for i, r in enumerate(rows) if not r.done]
        if len(keep) < len(rows):
            self.batch.select(keep)
            rows[:] = [rows[i] for i in keep]
            self._finish_ready(active)

    def _finish_ready(self, active: list[ActiveRequest]) -> None:
        for req in [r for r in active if r.finished]:
            active.remove(req)
            self.slots.release(req.spec.weights)
            try:
                _resolve(req.loop, req.future, result=to_result(req.result()))
            except Exception as e:  # noqa: BLE001 - encoding is this request's problem only
                _resolve(req.loop, req.future, error=e)

    def _fail_all(self, waiting: list[_Inbound], active: list[ActiveRequest]) -> None:
        err = RuntimeError("the sampler stopped or failed while serving this request")
        for item in waiting:
            _resolve(item.loop, item.future, error=err)
        for req in active:
            self.slots.release(req.spec.weights)
            _resolve(req.loop, req.future, error=err)
        active.clear()


def _resolve(loop: asyncio.AbstractEventLoop, fut: asyncio.Future[SampleResult],
             result: SampleResult | None = None, error: BaseException | None = None) -> None:
    def _set() -> None:
        if fut.done():
            return
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(result if result is not None else SampleResult())

    try:
        loop.call_soon_threadsafe(_set)
    except RuntimeError:  # the loop is closed: nobody is waiting any more
        pass

