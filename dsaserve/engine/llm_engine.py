"""LLMEngine: load a checkpoint once, then `add_request` / `abort_request` / `step` until done.

One step, one owner per stage: the scheduler picks the batch, the runner computes and samples it, the
scheduler applies the results (token stops free blocks at once), and the output processor turns them
into text; a stop string it finds ends that sequence in the scheduler within the same step. Each
RequestOutput carries only what is new since the previous one.
"""

from __future__ import annotations

import logging
import time

from dsaserve.config import ModelConfig
from dsaserve.device import resolve_device, resolve_dtype
from dsaserve.engine.admission import AdmissionLimits, EngineRequest, compile_grammar
from dsaserve.engine.output_processor import OutputProcessor
from dsaserve.engine.scheduling.cache_plan import (
    fit_max_model_len,
    plan_num_blocks,
    plan_state_counts,
    requested_max_model_len,
)
from dsaserve.engine.scheduling.kv_cache_manager import KVCacheManager
from dsaserve.engine.scheduling.request import Request, samples_of
from dsaserve.engine.scheduling.scheduler import Scheduler, SchedulerConfig
from dsaserve.engine.stats import EngineStats
from dsaserve.engine.workers import memory_profile
from dsaserve.engine.workers.executor import InProcessExecutor, make_executor
from dsaserve.engine_args import EngineArgs
from dsaserve.model.load_memory import memory_available
from dsaserve.outputs import RequestOutput
from dsaserve.parallel_plan import step_activation_bytes
from dsaserve.sampling_params import SamplingParams
from dsaserve.structured_output.compiler import GrammarCompiler
from dsaserve.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, args: EngineArgs):
        start = time.perf_counter()
        self.model_dir = args.model
        self.config = cfg = ModelConfig.from_pretrained(args.model, hf_overrides=args.hf_overrides)
        parallel = args.parallel
        parallel.check_model(cfg, args.attention_backend)
        self.device = resolve_device(args.device)
        self.dtype = resolve_dtype(args.dtype, cfg.checkpoint_dtype, self.device, args.cpu_isa)
        self.tokenizer = Tokenizer(args.model)
        max_model_len = requested_max_model_len(args.max_model_len, cfg)
        self.speculative, with_mtp = args.speculative, args.speculative is not None
        self.executor = make_executor(args, cfg, self.device, self.dtype)  # loads the model on every rank
        try:
            driver = self.executor.driver
            self.model = driver.model
            self.kv_layout = layout = driver.kv_layout
            # Under decode context parallelism a scheduler block holds dcp × block_size tokens, of which each
            # rank stores block_size.
            dcp = parallel.decode_context_parallel_size
            tokens_per_block = args.block_size * dcp
            kv_memory = args.kv_cache_bytes
            self.memory_profiles: list[memory_profile.DeviceMemory] = []  # each rank's, where measured
            self.activation_estimate: int | None = None  # doctor's figure for the measured step
            if kv_memory is None and memory_profile.measured(self.device):
                kv_memory = self._measured_kv_memory(args, max_model_len)
            states = plan_state_counts(layout, kv_memory, args.max_num_seqs, args.num_state_snapshots,
                                       args.num_draft_states, memory_available(self.device))
            num_blocks = plan_num_blocks(layout, args.block_size, kv_memory, max_model_len,
                                         states.slots, tokens_per_block, states.snapshots, args.num_draft_states)
            self.max_model_len = fit_max_model_len(max_model_len, num_blocks * tokens_per_block,
                                                   layout.bytes_per_token / dcp,
                                                   explicit=args.max_model_len is not None)
            self.executor.init_cache(num_blocks, states, self.max_model_len)
        except BaseException:
            self.executor.shutdown()
            raise
        self.kv_cache, self.runner = driver.kv_cache, driver.runner
        self.prefix_caching = args.enable_prefix_caching and (cfg.hybrid is None or states.snapshots > 0)
        if cfg.hybrid is not None and self.prefix_caching:
            logger.info("prefix caching on %s: the KDA state is kept every %d tokens in %d snapshots of %.1f MiB",
                        cfg.family.name, args.state_snapshot_interval, states.snapshots,
                        layout.state_bytes_per_request / 2**20)
        elif cfg.hybrid is not None and args.enable_prefix_caching:
            logger.info("prefix caching is off: state_snapshots=0 keeps no KDA state to resume from")
        self.scheduler = Scheduler(SchedulerConfig(self.max_model_len, states.slots, args.max_num_batched_tokens,
                                                   args.enable_chunked_prefill,
                                                   self.speculative.num_speculative_tokens if with_mtp else 0,
                                                   self.speculative.disable_by_batch_size if with_mtp else None,
                                                   state_slots=cfg.hybrid is not None,
                                                   state_snapshots=states.snapshots,
                                                   state_snapshot_interval=args.state_snapshot_interval),
                                   KVCacheManager(num_blocks, tokens_per_block, self.prefix_caching,
                                                  share_samples=cfg.hybrid is None))
        self.limits = AdmissionLimits(cfg.vocab_size, self.max_model_len, num_blocks, tokens_per_block,
                                      args.enable_chunked_prefill, args.max_num_batched_tokens, cfg.eos_token_ids)
        self.output_processor = OutputProcessor(self.tokenizer)
        # xgrammar loads on first use
        self.grammars = GrammarCompiler(self.tokenizer, cfg.vocab_size, cfg.eos_token_ids)
        logger.info(
            "engine ready in %.1fs: %s, %s, backend=%s, %d KV blocks of %d tokens (%.1f MiB%s), prefix caching %s",
            time.perf_counter() - start, self.device, str(self.dtype).removeprefix("torch."), args.attention_backend,
            num_blocks, tokens_per_block, self.kv_cache.nbytes() / 2**20,
            " per rank" if parallel.distributed else "", "on" if self.prefix_caching else "off",
        )

    def _measured_kv_memory(self, args: EngineArgs, max_model_len: int) -> int:
        """KV cache bytes per rank from gpu_memory_utilization, after every rank ran the largest step: a prompt of
        max_num_batched_tokens tokens (at most max_model_len) with the logits rows of a full batch (its drafts
        included)."""
        tokens = min(args.max_num_batched_tokens, max_model_len)
        drafts = self.speculative.num_speculative_tokens if self.speculative is not None else 0
        rows = min(tokens, args.max_num_seqs * (1 + drafts))
        self.activation_estimate = step_activation_bytes(self.config, args.parallel, tokens, rows, self.dtype.itemsize)
        self.memory_profiles = self.executor.profile_memory(tokens, rows)
        return memory_profile.kv_cache_memory(self.memory_profiles, args.gpu_memory_utilization,
                                              self.activation_estimate)

    def shutdown(self) -> None:
        """Stop the executor's workers (nothing to do on one device)."""
        self.executor.shutdown()

    def make_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                     prompt_text: str | None = None) -> EngineRequest:
        """The admission check: raises RequestRejected naming the field if this request can never run.
        Reads only fixed limits and compiles the structured-output grammar (cached), so it runs off the
        engine's thread. prompt: text, or token ids (with `prompt_text`, their text, for the outputs)."""
        if isinstance(prompt, str):
            prompt_text, prompt = prompt, self.tokenizer.encode(prompt)
        ids = list(prompt)
        return EngineRequest(request_id, prompt_text, ids, params, self.limits.check(ids, params),
                             compile_grammar(self.grammars, params))

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams, prompt_text=None) -> None:
        self.enqueue(self.make_request(request_id, prompt, params, prompt_text))

    def enqueue(self, request: EngineRequest) -> None:
        """Add an admitted request: one sequence per sample; samples 1…n-1 reuse sample 0's prompt blocks."""
        for sequence in self._sequences(request):
            self.scheduler.add_request(sequence)

    def add_prefilled_request(self, request: EngineRequest, num_prefilled: int, fill) -> None:
        """Start a request (n = 1) whose first `num_prefilled` tokens are not computed: `fill(kv_cache,
        block_table, num_prefilled)` writes their cache entries (synthetic long contexts for benchmarks)."""
        if not isinstance(self.executor, InProcessExecutor):
            raise ValueError("prefilled requests write rank 0's cache only: use tensor_parallel_size=1")
        if request.params.n != 1 or not 0 <= num_prefilled < len(request.prompt_token_ids):
            raise ValueError(f"a prefilled request has one sample (n={request.params.n}) and leaves at least its last "
                             f"prompt token to compute (num_prefilled={num_prefilled})")
        if self.scheduler.kv.enable_prefix_caching:
            raise ValueError("prefilled cache entries are not the prompt's own: turn prefix caching off")
        (sequence,) = self._sequences(request)
        try:
            self.scheduler.add_computed(sequence, num_prefilled)
            fill(self.kv_cache, sequence.block_table, num_prefilled)
        except Exception:
            self.abort_request(request.request_id)
            raise

    def _sequences(self, request: EngineRequest) -> list[Request]:
        sequences = samples_of(request, self.config.eos_token_ids)
        if request.request_id in self.output_processor or any(s.request_id in self.output_processor.samples
                                                              for s in sequences):  # a sample's id, "ID#i"
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        self.output_processor.add(request, [s.request_id for s in sequences])
        return sequences

    def abort_request(self, request_id: str) -> None:
        self.scheduler.finish_requests(self.output_processor.abort(request_id), "abort")

    def unfinished_request_ids(self) -> list[str]:
        return list(self.output_processor.parents)

    def failed_step_request_ids(self) -> list[str]:
        """After a step raised: requests with a sequence in the running batch, and those whose every
        unfinished sequence has already left the scheduler (they would never hear again)."""
        running = {self.output_processor.parent_id(r.request_id) for r in self.scheduler.running}
        return [rid for rid in self.output_processor.parents
                if rid in running or not any(map(self.scheduler.has_request, self.output_processor.unfinished(rid)))]

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def stats(self) -> EngineStats:
        scheduler, kv = self.scheduler, self.scheduler.kv
        return EngineStats(len(scheduler.running), len(scheduler.waiting), kv.num_blocks, kv.num_free_blocks,
                           kv.stats.queried_tokens, kv.stats.hit_tokens, scheduler.num_prompt_tokens,
                           scheduler.num_generation_tokens, scheduler.num_preemptions, scheduler.spec_stats.snapshot())

    def step(self) -> list[RequestOutput]:
        """Run one batch. Returns what is new for every request that took part in it."""
        scheduler_output = self.scheduler.schedule()
        runner_output = self.executor.execute(scheduler_output)  # also drops the state of finished requests
        updates = self.scheduler.update_from_output(scheduler_output, runner_output)
        outputs, stopped = self.output_processor.process(updates)
        self.scheduler.finish_requests(stopped, "stop")
        return outputs
