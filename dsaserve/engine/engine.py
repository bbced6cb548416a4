"""LLMEngine: load a checkpoint once, then `add_request` / `step` until every request is finished."""

from __future__ import annotations

import logging
import re
import time

import torch

from dsaserve.config import ModelConfig
from dsaserve.device import resolve_device, resolve_dtype
from dsaserve.engine.kv_cache import BlockPool, KVCache, KVCacheLayout, blocks_needed
from dsaserve.engine.request import Request, RequestStatus
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
        max_model_len: int | None = None,
        block_size: int = 64,
        kv_cache_memory: int | str | None = None,
        max_num_batched_tokens: int = 8192,
        max_num_seqs: int = 256,
        tensor_parallel_size: int = 1,
        hf_overrides: dict | str | None = None,
        seed: int = 0,
        progress: bool = True,
    ):
        if tensor_parallel_size != 1:
            raise ValueError(f"tensor_parallel_size={tensor_parallel_size}: only 1 is supported so far")
        if block_size < 1:
            raise ValueError(f"block_size={block_size} must be positive")
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
        self.model = load_model(self.config, model, self.dtype, self.device, attention_backend, progress=progress)
        layout = KVCacheLayout.of(self.config, self.dtype)
        num_blocks = self._num_blocks(layout, block_size, parse_bytes(kv_cache_memory), max_num_seqs)
        self.kv_cache = KVCache(self.config, num_blocks, block_size, self.dtype, self.device,
                                with_indexer=self.model.backend.uses_indexer)
        self.pool = BlockPool(num_blocks)
        self.scheduler = Scheduler(
            SchedulerConfig(self.max_model_len, block_size, max_num_seqs, max_num_batched_tokens), self.pool
        )
        self.runner = ModelRunner(self.model, self.kv_cache, self.device)
        self.requests: dict[str, Request] = {}
        self._rng = torch.Generator(device=self.device).manual_seed(seed)
        logger.info(
            "engine ready in %.1fs: %s, %s, backend=%s, %d KV blocks of %d tokens (%.1f MiB)",
            time.perf_counter() - start, self.device, str(self.dtype).removeprefix("torch."), attention_backend,
            num_blocks, block_size, self.kv_cache.nbytes() / 2**20,
        )

    def _num_blocks(self, layout: KVCacheLayout, block_size: int, memory: int | None, max_num_seqs: int) -> int:
        per_block = layout.bytes_per_token * block_size
        wanted = blocks_needed(self.max_model_len, block_size) * max_num_seqs
        if memory is None:
            return max(1, min(wanted, DEFAULT_KV_CACHE_MEMORY // per_block))
        if memory < per_block:
            raise ValueError(f"kv_cache_memory={memory} bytes is smaller than one KV block ({per_block} bytes)")
        return memory // per_block

    # ---- requests --------------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams) -> None:
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        if isinstance(prompt, str):
            text, ids = prompt, self.tokenizer.encode(prompt)
        else:
            text, ids = None, list(prompt)
        if not ids:
            raise RequestRejected("prompt", "the prompt is empty; give at least one token")
        bad = [t for t in ids if not 0 <= t < self.config.vocab_size]
        if bad:
            raise RequestRejected("prompt", f"prompt token ids {bad[:5]} are outside the vocabulary [0, {self.config.vocab_size})")
        max_tokens = params.max_tokens if params.max_tokens is not None else self.max_model_len - len(ids)
        if max_tokens < 1:
            raise RequestRejected("prompt", f"the prompt has {len(ids)} tokens, max_model_len is {self.max_model_len}")
        stop = set(params.stop_token_ids or ())
        if not params.ignore_eos:
            stop |= set(self.config.eos_token_ids)
        request = Request(
            request_id=request_id, prompt=text, prompt_token_ids=ids, params=params,
            stop_token_ids=frozenset(stop), max_tokens=max_tokens,
            logprobs=[] if params.logprobs is not None else None,
            prompt_logprobs=[None] if params.prompt_logprobs is not None else None,
        )
        if params.seed is not None:
            request.generator = torch.Generator(device=self.device).manual_seed(params.seed)
        self.scheduler.add(request)
        self.requests[request_id] = request

    def abort_request(self, request_id: str) -> None:
        request = self.requests.pop(request_id, None)
        if request is not None and not request.finished:
            request.finish_reason = "abort"
            self.scheduler.finish(request)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    # ---- stepping --------------------------------------------------------------------------------

    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        """Run one batch. Returns the state of every request that took part in it."""
        batch = self.scheduler.schedule()
        if not batch:
            return []
        result = self.runner.execute(batch)
        for request, n in zip(batch.requests, batch.num_new_tokens):
            request.num_computed_tokens += n
        for b, logits in result.prompt_logits.items():
            self._record_prompt_logprobs(batch, b, logits)
        if result.sample_requests:
            self._sample(batch, result.sample_requests, result.sample_logits)
        outputs = [self._output(r) for r in batch.requests]
        for request in batch.requests:
            if request.finished:
                self.requests.pop(request.request_id, None)
        return outputs

    def _sample(self, batch: ScheduledBatch, positions: list[int], logits: torch.Tensor) -> None:
        requests = [batch.requests[b] for b in positions]
        generators = [r.generator or self._rng for r in requests]
        tokens = sample(logits, [r.params for r in requests], generators)
        want = [r.params.logprobs is not None for r in requests]
        top = None
        if any(want):
            n = max(r.params.logprobs or 0 for r in requests)
            top = top_logprobs(logits.log_softmax(-1), tokens, n)
        for j, (request, token) in enumerate(zip(requests, tokens.tolist())):
            request.output_token_ids.append(token)
            if top is not None:
                request.cumulative_logprob += top.chosen_logprob[j].item()
                if want[j]:
                    request.logprobs.append(self._position_logprobs(top, j, token, request.params.logprobs))
            self._check_stop(request, token)

    def _record_prompt_logprobs(self, batch: ScheduledBatch, b: int, logits: torch.Tensor) -> None:
        request = batch.requests[b]
        start = request.num_computed_tokens - batch.num_new_tokens[b]
        targets = torch.tensor(request.prompt_token_ids[start + 1 : start + 1 + logits.shape[0]], device=logits.device)
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
        if token in request.stop_token_ids:
            request.finish_reason = "stop"
            request.stop_reason = token if token in (request.params.stop_token_ids or ()) else None
        elif len(request.output_token_ids) >= request.max_tokens:
            request.finish_reason = "length"
        else:
            return
        self.scheduler.finish(request)

    def _output(self, request: Request) -> RequestOutput:
        text = self.tokenizer.decode(request.output_token_ids, skip_special_tokens=request.params.skip_special_tokens)
        completion = CompletionOutput(
            index=0, text=text, token_ids=list(request.output_token_ids),
            cumulative_logprob=request.cumulative_logprob if request.logprobs is not None else None,
            logprobs=request.logprobs, finish_reason=request.finish_reason, stop_reason=request.stop_reason,
        )
        return RequestOutput(
            request_id=request.request_id, prompt=request.prompt, prompt_token_ids=request.prompt_token_ids,
            outputs=[completion], finished=request.status == RequestStatus.FINISHED,
            prompt_logprobs=request.prompt_logprobs,
        )
