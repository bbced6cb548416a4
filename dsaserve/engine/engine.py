"""LLMEngine: load a checkpoint once, then `add_request` / `abort_request` / `step` until done.

`step()` runs one continuous-batching step and returns, per request that progressed, only what is
new since its previous output (token ids, text, logprobs), plus finish reasons.
"""

from __future__ import annotations

import logging
import re
import time

import torch

from dsaserve import native
from dsaserve.config import ModelConfig
from dsaserve.device import resolve_device, resolve_dtype
from dsaserve.engine.block_manager import KVCacheManager
from dsaserve.engine.detokenizer import IncrementalDetokenizer
from dsaserve.engine.kv_cache import KVCache, KVCacheLayout, blocks_needed
from dsaserve.engine.logits_processors import process_logits
from dsaserve.engine.request import Request
from dsaserve.engine.runner import ModelRunner
from dsaserve.engine.sampler import sample, top_logprobs
from dsaserve.engine.scheduler import RequestRejected, ScheduledBatch, Scheduler, SchedulerConfig
from dsaserve.model import load_model
from dsaserve.outputs import CompletionOutput, Logprob, RequestOutput
from dsaserve.sampling_params import SamplingParams
from dsaserve.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

DEFAULT_KV_CACHE_MEMORY = 1 << 30  # bytes, when the caller does not say


def parse_bytes(value: int | str | None) -> int | None:
    """`kv_cache_memory` as bytes: an int, or a string such as '512MiB', '4GiB', '1.5GB'."""
    if value is None or isinstance(value, int):
        return value
    m = re.fullmatch(r"\s*([0-9.]+)\s*([KMGT]?)(i?)B?\s*", str(value), re.IGNORECASE)
    if not m:
        raise ValueError(f"kv_cache_memory={value!r} is not a size; use bytes or e.g. '512MiB', '4GiB'")
    base = 1024 if m.group(3) or not m.group(2) else 1000
    power = " KMGT".index(m.group(2).upper() or " ")
    return int(float(m.group(1)) * base**power)


class LLMEngine:
    def __init__(
        self,
        model: str,
        *,
        dtype: str | torch.dtype = "auto",
        device: str | None = None,
        attention_backend: str = "sparse",
        page_budget: int | None = None,
        indexer_cache_dtype: str = "auto",
        max_model_len: int | None = None,
        block_size: int = 64,
        kv_cache_memory: int | str | None = None,
        max_num_batched_tokens: int = 8192,
        max_num_seqs: int = 256,
        enable_prefix_caching: bool = True,
        enable_chunked_prefill: bool = True,
        tensor_parallel_size: int = 1,
        hf_overrides: dict | str | None = None,
        seed: int = 0,
        progress: bool = True,
    ):
        if tensor_parallel_size != 1:
            raise ValueError(f"tensor_parallel_size={tensor_parallel_size}: only 1 is supported so far")
        if block_size < 1:
            raise ValueError(f"block_size={block_size} must be positive")
        if max_num_batched_tokens < 1 or max_num_seqs < 1:
            raise ValueError("max_num_batched_tokens and max_num_seqs must be positive")
        start = time.perf_counter()
        self.model_dir = model
        self.config = ModelConfig.from_pretrained(model, hf_overrides=hf_overrides)
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype, self.config.checkpoint_dtype, self.device)
        self.tokenizer = Tokenizer(model)
        self.max_model_len = max_model_len or self.config.max_position_embeddings
        if self.max_model_len > self.config.max_position_embeddings:
            raise ValueError(
                f"max_model_len={self.max_model_len} exceeds the model's max_position_embeddings="
                f"{self.config.max_position_embeddings}; lower it"
            )
        if page_budget is None:
            page_budget = max(1, self.config.index_topk // block_size)  # the same token budget as top-k
        if page_budget < 1:
            raise ValueError(f"page_budget={page_budget} must be at least 1 page")
        self.model = load_model(self.config, model, self.dtype, self.device, attention_backend, progress=progress,
                                page_budget=page_budget)
        with_indexer = self.model.backend.uses_indexer
        if with_indexer and self.device.type == "cpu":
            native.library()  # build (first time on this machine) or load the CPU kernels now, not in a step
        self.kv_layout = KVCacheLayout.of(self.config, self.dtype, indexer_cache_dtype, with_indexer)
        num_blocks = self._num_blocks(self.kv_layout, block_size, parse_bytes(kv_cache_memory), max_num_seqs)
        self._fit_max_model_len(num_blocks * block_size, explicit=max_model_len is not None)
        self.kv_cache = KVCache(self.config, num_blocks, block_size, self.dtype, self.device,
                                with_indexer=with_indexer, indexer_dtype=indexer_cache_dtype)
        self.kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching)
        self.scheduler = Scheduler(
            SchedulerConfig(self.max_model_len, max_num_seqs, max_num_batched_tokens, enable_chunked_prefill), self.kv
        )
        self.runner = ModelRunner(self.model, self.kv_cache, self.device)
        self.groups: dict[str, list[Request]] = {}  # request id → its sequences (n samples)
        self._rng = torch.Generator(device=self.device).manual_seed(seed)
        self.num_prompt_tokens = 0  # counters for metrics
        self.num_generation_tokens = 0
        logger.info(
            "engine ready in %.1fs: %s, %s, backend=%s, %d KV blocks of %d tokens (%.1f MiB), prefix caching %s",
            time.perf_counter() - start, self.device, str(self.dtype).removeprefix("torch."), attention_backend,
            num_blocks, block_size, self.kv_cache.nbytes() / 2**20, "on" if enable_prefix_caching else "off",
        )

    def _num_blocks(self, layout: KVCacheLayout, block_size: int, memory: int | None, max_num_seqs: int) -> int:
        per_block = layout.bytes_per_token * block_size
        wanted = blocks_needed(self.max_model_len, block_size) * max_num_seqs
        if memory is None:
            return max(1, min(wanted, DEFAULT_KV_CACHE_MEMORY // per_block))
        if memory < per_block:
            raise ValueError(f"kv_cache_memory={memory} bytes is smaller than one KV block ({per_block} bytes)")
        return memory // per_block

    def _fit_max_model_len(self, capacity: int, explicit: bool) -> None:
        """One sequence of max_model_len tokens must fit in the cache, or no long request could ever run."""
        if self.max_model_len <= capacity:
            return
        if explicit:
            raise ValueError(
                f"max_model_len={self.max_model_len} needs {self.max_model_len} tokens of KV cache but the cache "
                f"holds {capacity} ({self.kv_layout.bytes_per_token} bytes per token); raise kv_cache_memory "
                f"or lower max_model_len"
            )
        logger.info("max_model_len lowered from %d to %d, what the KV cache holds (set kv_cache_memory for more)",
                    self.max_model_len, capacity)
        self.max_model_len = capacity

    # ---- requests --------------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                    prompt_text: str | None = None) -> None:
        """prompt: text, or token ids (with `prompt_text`, the text they came from, for the outputs)."""
        if request_id in self.groups:
            raise ValueError(f"request_id {request_id!r} is already in use")
        if isinstance(prompt, str):
            text, ids = prompt, self.tokenizer.encode(prompt)
        else:
            text, ids = prompt_text, list(prompt)
        max_tokens = self.validate(ids, params)
        request = self._new_sequence(request_id, text, ids, params, max_tokens, index=0)
        if params.prompt_logprobs is not None:
            request.prompt_logprobs = [None]
        self.scheduler.add(request)
        self.groups[request_id] = [request]
        self.num_prompt_tokens += len(ids)

    def validate(self, ids: list[int], params: SamplingParams) -> int:
        """Raise RequestRejected if this prompt and these params can never run; returns max_tokens."""
        if not ids:
            raise RequestRejected("prompt", "the prompt is empty; give at least one token")
        bad = [t for t in ids if not isinstance(t, int) or not 0 <= t < self.config.vocab_size]
        if bad:
            raise RequestRejected("prompt", f"prompt token ids {bad[:5]} are outside the vocabulary [0, {self.config.vocab_size})")
        vocab = self.config.vocab_size
        for name, tokens in (("logit_bias", params.logit_bias or {}), ("stop_token_ids", params.stop_token_ids or [])):
            outside = [t for t in tokens if not 0 <= t < vocab]
            if outside:
                raise RequestRejected(name, f"{name} has token ids {outside[:5]} outside the vocabulary [0, {vocab})")
        max_tokens = params.max_tokens if params.max_tokens is not None else self.max_model_len - len(ids)
        if max_tokens < 1:
            raise RequestRejected(
                "prompt", f"the prompt has {len(ids)} tokens but max_model_len is {self.max_model_len}; shorten it"
            )
        self.scheduler.check_fits(len(ids), max_tokens)
        return max_tokens

    def _new_sequence(self, request_id, text, ids, params: SamplingParams, max_tokens: int, index: int) -> Request:
        stop = set(params.stop_token_ids or ())
        if not params.ignore_eos:
            stop |= set(self.config.eos_token_ids)
        request = Request(
            request_id=request_id, prompt=text, prompt_token_ids=ids, params=params,
            stop_token_ids=frozenset(stop), max_tokens=max_tokens, index=index, arrival_time=time.monotonic(),
            detokenizer=IncrementalDetokenizer(self.tokenizer, ids, params.skip_special_tokens, params.stop,
                                               params.include_stop_str_in_output),
            logprobs=[] if params.logprobs is not None else None,
        )
        if params.seed is not None:
            request.generator = torch.Generator(device=self.device).manual_seed(params.seed + index)
        return request

    def abort_request(self, request_id: str) -> None:
        for request in self.groups.pop(request_id, []):
            if not request.finished:
                request.finish_reason = "abort"
                self.scheduler.finish(request)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    @property
    def num_free_blocks(self) -> int:
        return self.kv.num_free_blocks

    # ---- stepping --------------------------------------------------------------------------------

    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        """Run one batch. Returns what is new for every request that took part in it."""
        batch = self.scheduler.schedule()
        if not batch:
            return []
        result = self.runner.execute(batch)
        for request, n in zip(batch.requests, batch.num_new_tokens):
            request.num_computed_tokens += n
            self.kv.cache_computed_blocks(request)
        for b, (first, logits) in result.prompt_logits.items():
            self._record_prompt_logprobs(batch.requests[b], first, logits)
        touched = dict.fromkeys(r.request_id for r in batch.requests)
        if result.sample_requests:
            self._sample(batch, result.sample_requests, result.sample_logits)
        return [self._output(rid) for rid in touched if rid in self.groups]

    def _sample(self, batch: ScheduledBatch, positions: list[int], logits: torch.Tensor) -> None:
        requests = [batch.requests[b] for b in positions]
        rows = list(range(len(requests)))
        for row, request in list(zip(rows, requests)):
            if request.params.n > 1 and request.index == 0 and len(self.groups[request.request_id]) == 1:
                for child in self._fork(request):
                    requests.append(child)
                    rows.append(row)
        logits = logits[rows]
        finite = torch.isfinite(logits).all(dim=-1).tolist()
        for request, ok in zip(requests, finite):
            if not ok:
                self._finish(request, "error", error="the model produced non-finite logits for this request")
        keep = [i for i, ok in enumerate(finite) if ok]
        if not keep:
            return
        requests = [requests[i] for i in keep]
        raw = logits[keep]
        processed = process_logits(raw, requests)
        tokens = sample(processed, [r.params for r in requests], [r.generator or self._rng for r in requests])
        top = None
        want = [r.logprobs is not None for r in requests]
        if any(want):
            n = max(r.params.logprobs or 0 for r in requests)
            top = top_logprobs(raw.log_softmax(-1), tokens, n)
        now = time.monotonic()
        for j, (request, token) in enumerate(zip(requests, tokens.tolist())):
            request.output_token_ids.append(token)
            self.num_generation_tokens += 1
            if request.first_token_time is None:
                request.first_token_time = now
            if top is not None and want[j]:
                request.cumulative_logprob += top.chosen_logprob[j].item()
                request.logprobs.append(self._position_logprobs(top, j, token, request.params.logprobs))
            self._check_stop(request, token)

    def _fork(self, parent: Request) -> list[Request]:
        """Sample 0 has just prefilled the prompt: create samples 1…n-1 sharing its full blocks."""
        children = []
        for index in range(1, parent.params.n):
            child = self._new_sequence(parent.request_id, parent.prompt, parent.prompt_token_ids, parent.params,
                                       parent.max_tokens, index)
            self.kv.fork(parent, child)
            self.scheduler.add_running(child)
            self.groups[parent.request_id].append(child)
            children.append(child)
        return children

    def _record_prompt_logprobs(self, request: Request, first: int, logits: torch.Tensor) -> None:
        targets = torch.tensor(request.prompt_token_ids[first + 1 : first + 1 + logits.shape[0]], device=logits.device)
        n = request.params.prompt_logprobs
        top = top_logprobs(logits.log_softmax(-1), targets, n)
        for j, token in enumerate(targets.tolist()):
            request.prompt_logprobs.append(self._position_logprobs(top, j, token, n))

    def _position_logprobs(self, top, j: int, token: int, n: int) -> dict[int, Logprob]:
        entry = {token: Logprob(top.chosen_logprob[j].item(), int(top.chosen_rank[j]), self._piece(token))}
        for rank, (tid, lp) in enumerate(zip(top.top_ids[j, :n].tolist(), top.top_logprobs[j, :n].tolist()), 1):
            entry.setdefault(tid, Logprob(lp, rank, self._piece(tid)))
        return entry

    def _piece(self, token: int) -> str:
        return self.tokenizer.decode([token], skip_special_tokens=False)

    def _check_stop(self, request: Request, token: int) -> None:
        past_min = len(request.output_token_ids) >= request.params.min_tokens
        if past_min and token in request.stop_token_ids:
            if request.params.include_stop_str_in_output:
                request.detokenizer.add(token)  # otherwise the stop token's text stays out, as in vLLM
            stop_reason = token if token in (request.params.stop_token_ids or ()) else None
            self._finish(request, "stop", stop_reason=stop_reason)
            return
        grown = request.detokenizer.add(token)
        if past_min and (stop := request.detokenizer.find_stop(grown)) is not None:
            self._finish(request, "stop", stop_reason=stop)
        elif len(request.output_token_ids) >= request.max_tokens or request.num_tokens >= self.max_model_len:
            self._finish(request, "length")

    def _finish(self, request: Request, reason: str, stop_reason=None, error: str | None = None) -> None:
        request.finish_reason = reason
        request.stop_reason = stop_reason
        request.error = error
        if not isinstance(stop_reason, str):
            request.detokenizer.flush()
        self.scheduler.finish(request)  # frees its blocks now, in the step that finished it

    def _output(self, request_id: str) -> RequestOutput:
        group = self.groups[request_id]
        completions = []
        for request in group:
            new_tokens = request.output_token_ids[request.num_reported_tokens :]
            text = request.detokenizer.delta(request.finished)
            if not new_tokens and not text and not (request.finished and not request.finish_reported):
                continue
            new_logprobs = None
            if request.logprobs is not None:
                new_logprobs = request.logprobs[request.num_reported_logprobs :]
                request.num_reported_logprobs = len(request.logprobs)
            request.num_reported_tokens = len(request.output_token_ids)
            request.finish_reported = request.finished
            completions.append(CompletionOutput(
                index=request.index, text=text, token_ids=new_tokens,
                cumulative_logprob=request.cumulative_logprob if request.logprobs is not None else None,
                logprobs=new_logprobs, finish_reason=request.finish_reason, stop_reason=request.stop_reason,
            ))
        head = group[0]
        finished = len(group) == head.params.n and all(r.finished for r in group)
        if finished:
            del self.groups[request_id]
        return RequestOutput(
            request_id=request_id, prompt=head.prompt, prompt_token_ids=head.prompt_token_ids,
            outputs=completions, finished=finished, prompt_logprobs=head.prompt_logprobs,
            error="; ".join(r.error for r in group if r.error) or None,
            metrics={"arrival_time": head.arrival_time, "first_token_time": head.first_token_time,
                     "num_prefix_hit_tokens": head.num_prefix_hit_tokens,
                     "num_preemptions": sum(r.num_preemptions for r in group)},
        )
