"""Worker: one rank's share of the model, its KV cache and its ModelRunner.

With one device the engine owns the only worker. With several ranks every rank's process owns one
(rank 0's lives in the engine process, the driver) and every step they all run the same
SchedulerOutput, exchanging partial results inside the model's layers; rank 0's output is the one
the engine uses (engine/workers/executor.py).
"""

from __future__ import annotations

import logging

import torch

from dsaserve import triton_ops
from dsaserve.attention.context_shard import ContextShard
from dsaserve.attention.indexer_cache import describe_indexer_keys, indexer_key_kind
from dsaserve.config import ModelConfig
from dsaserve.device import widened_for_cpu
from dsaserve.distributed.parallel_context import ParallelContext
from dsaserve.engine.scheduling.cache_plan import StateCounts
from dsaserve.engine.scheduling.scheduler_output import SchedulerOutput
from dsaserve.engine.speculative import draft_graphs
from dsaserve.engine.workers import decode_graphs, memory_profile
from dsaserve.engine.workers.kv_cache import KVCache, KVCacheLayout, blocks_needed
from dsaserve.engine.workers.memory_profile import DeviceMemory
from dsaserve.engine.workers.model_runner import ModelRunner
from dsaserve.engine.workers.runner_output import ModelRunnerOutput
from dsaserve.engine_args import EngineArgs, parse_bytes
from dsaserve.model import load_model
from dsaserve.model.loader import fp8_params
from dsaserve.native import torch_ops
from dsaserve.quantization.apply import weight_forms

logger = logging.getLogger(__name__)


class Worker:
    def __init__(self, args: EngineArgs, cfg: ModelConfig, device: torch.device, dtype: torch.dtype,
                 parallel: ParallelContext | None = None, progress: bool = True):
        self.args, self.cfg, self.device, self.dtype = args, cfg, device, dtype
        self.parallel = parallel or ParallelContext.single()
        self.with_mtp = args.speculative is not None
        page_budget = args.page_budget or max(1, cfg.index_topk // args.block_size)  # the same token budget as top-k
        triton_ops.configure(args.triton_kernels, device)  # before anything asks which kernels run
        # Triton on CPU tensors stands in for the CUDA path: CPU operators off, as on a GPU. (On a GPU they stay
        # available for load-time work on the CPU, such as converting the mapped FP8 file.)
        native = "off" if device.type == "cpu" and triton_ops.active_device() is not None else args.native_kernels
        torch_ops.configure(native, args.cpu_isa)
        if self.parallel.tp.rank == 0:
            if device.type == "cpu" and native != args.native_kernels:
                logger.info("native kernels: off (triton_kernels='on' runs the CUDA path's kernels on this CPU)")
            elif device.type == "cpu":
                logger.info("native kernels: %s", torch_ops.summary())  # (builds them the first time on this machine)
            logger.info("triton kernels: %s", triton_ops.summary())
        forms = weight_forms(args.quantization, fp8_params(cfg, args.model), dtype, device,
                             keep_bf16=widened_for_cpu(args.dtype, cfg.checkpoint_dtype, dtype))
        self.model = load_model(cfg, args.model, dtype, device, args.attention_backend, progress=progress,
                                page_budget=page_budget, with_mtp=self.with_mtp, parallel=self.parallel,
                                weight_forms=forms, decode_plan=not args.enforce_eager, huge_pages=args.huge_pages,
                                scratch_budget=parse_bytes(args.load_scratch_memory, "load_scratch_memory"))
        self.with_indexer = self.model.backend.uses_indexer
        self.indexer_keys = indexer_key_kind(args.indexer_cache_dtype, cfg.fp8_checkpoint or args.quantization == "fp8")
        if self.with_indexer and cfg.hybrid is None and self.parallel.tp.rank == 0:
            logger.info("indexer keys: %s", describe_indexer_keys(self.indexer_keys, args.indexer_cache_dtype, dtype))
        # Bytes per token this rank stores (under DCP, per token it holds: 1/N of a request's tokens).
        self.kv_layout = KVCacheLayout.of(cfg, dtype, self.indexer_keys, self.with_indexer, self.with_mtp,
                                          self.parallel.tp.size)
        self.kv_cache: KVCache | None = None
        self.runner: ModelRunner | None = None

    def init_cache(self, num_blocks: int, states: StateCounts, max_model_len: int) -> None:
        """num_blocks KV blocks and, for a hybrid model, the KDA states the engine planned (plan_state_counts); on
        CUDA, the decode steps' graphs captured over them (one more block, and for a hybrid model one more KDA state:
        the padding rows')."""
        graphs_off = decode_graphs.graphs_off_because(self.args, self.cfg, self.device, self.model, self.parallel)
        if graphs_off is not None and decode_graphs.graphs_possible(self.device) and self.parallel.tp.rank == 0:
            logger.info("CUDA graphs: off (%s)", graphs_off)
        padding = 1 if graphs_off is None else 0
        hybrid = self.cfg.hybrid is not None
        self.kv_cache = self._cache(num_blocks + padding,
                                    StateCounts(states.slots + padding * hybrid, states.snapshots))
        # A hybrid model's verify steps keep the KDA state after each draft's row, which a captured step does not:
        # they run eagerly.
        verify = () if self.args.speculative is None or hybrid else (1 + self.args.speculative.num_speculative_tokens,)
        graphs = None if graphs_off is not None else decode_graphs.capture(
            self.model, self.kv_cache, self.args.graph_sizes, max_model_len, pad_block=num_blocks, rows=(1, *verify),
            pad_slot=states.slots if hybrid else -1)
        drafts = None if graphs is None or not verify else draft_graphs.capture(
            self.model, self.kv_cache, self.args.graph_sizes, max_model_len, num_blocks,
            self.args.speculative.num_speculative_tokens, self.cfg.index_share_for_mtp_iteration, pool=graphs.pool)
        self.runner = ModelRunner(self.model, self.kv_cache, self.device, self.args.seed,
                                  self.cfg.index_share_for_mtp_iteration, graphs, drafts)

    def profile_memory(self, tokens: int, logits_rows: int) -> DeviceMemory:
        """The device's memory after the largest step the scheduler can give (engine/workers/memory_profile.py),
        run on a cache of its own that is released after."""
        tokens_per_block = self.args.block_size * self.parallel.dcp.size
        return memory_profile.profile(
            self.device, lambda: self._cache(blocks_needed(tokens, tokens_per_block), StateCounts(1, 0)),
            lambda cache: memory_profile.run_largest_step(self.model, cache, tokens, logits_rows, tokens_per_block),
            tokens)

    def _cache(self, num_blocks: int, states: StateCounts) -> KVCache:
        dcp = self.parallel.dcp
        shard = ContextShard(dcp.rank, dcp.size, self.args.block_size, dcp) if dcp.size > 1 else None
        return KVCache(self.cfg, num_blocks, self.args.block_size, self.dtype, self.device,
                       with_indexer=self.with_indexer, indexer_dtype=self.indexer_keys, with_mtp=self.with_mtp,
                       shard=shard, state_slots=states.slots, state_snapshots=states.snapshots,
                       tp_size=self.parallel.tp.size, draft_states=self.args.num_draft_states)

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.runner.execute(scheduler_output)
