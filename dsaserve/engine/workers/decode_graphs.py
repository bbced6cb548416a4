"""Decode steps replayed from CUDA graphs: the model's forward over a batch of single-token decodes, captured at
start-up once per batch size and context bucket, and replayed with each step's inputs copied into static buffers.

A captured forward reads its batch only from those buffers (input ids, positions, the slots its rows write, block
tables) for `size` rows. A batch of n requests replays the smallest captured size ≥ n; its other rows are padding:
each writes its latent row and indexer key into a block of its own that the scheduler never hands out (the cache's
last, `pad_block`) and attends to that row alone; their logits are dropped. What an eager step takes from the host
(the indexer's scoring width: the batch's longest context; the rope table's length) is the capture's context
bucket: 4,096 tokens × 4^i up to max_model_len (cuda_graph_sizes.py), the smallest that holds the step's longest
context. Positions past each query score -inf and are never selected, so a replay selects what an eager step
selects, and the buckets keep the scoring and top-k of a short batch from spanning max_model_len. Steps not plain
decodes (prompt rows, drafts to verify, prompt logprobs, more requests than the largest size) run eagerly.
Sampling and the logits processors run after the replay on its logits, as after an eager step.

The model's forward under capture must not read a device value on the host or make a tensor from host data: what
eager steps make from host lengths is made before the capture (`_forward`), and the Triton path's kernels take
their shapes from the tensors they get (tests/test_decode_graphs.py watches a replayed forward for both).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable

import torch

from dsaserve import cuda_graph_sizes
from dsaserve.attention.metadata import BatchMetadata
from dsaserve.engine.scheduling.scheduler_output import ScheduledRequest

logger = logging.getLogger(__name__)



def graphs_off_because(args, cfg, device: torch.device, model, parallel) -> str | None:
    """Why decode steps do not replay CUDA graphs in this engine (None: they do)."""
    from dsaserve import triton_ops

    if not graphs_possible(device):
        return f"the device is {device.type}"
    reasons = [
        (args.enforce_eager, "--enforce-eager"),
        (triton_ops.active_device() is None, "the Triton kernels are off (their forward is the one captured)"),
        (args.speculative is not None, "speculative decoding (its verify and draft steps run eagerly)"),
        (cfg.hybrid is not None, f"{cfg.family.name}'s KDA state slots"),
        (parallel.dcp.size > 1, "decode context parallelism"),
        (parallel.check_ranks, "--check-ranks (it compares values on the host)"),
        (not model.backend.uses_indexer, f"the {model.backend.name} backend (its attention loops on the host)"),
    ]
    return next((why for off, why in reasons if off), None)


def graphs_possible(device: torch.device) -> bool:
    return device.type == "cuda"


def device_free_bytes(device: torch.device) -> int | None:
    """Free memory on a CUDA device (what the driver reports, other processes included); None elsewhere."""
    return torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else None


def capture(model, kv_cache, sizes: tuple[int, ...], max_model_len: int, pad_block: int) -> "DecodeGraphs | None":
    """The engine's decode graphs; None, with a warning saying why, where a capture fails (decode then runs eagerly,
    as with --enforce-eager)."""
    try:
        return DecodeGraphs(model, kv_cache, sizes, max_model_len, pad_block, make_graph=CudaGraph)
    except RuntimeError as error:  # an operation the capture refused
        logger.warning("CUDA graphs: capture failed, so decode steps run eagerly (--enforce-eager skips the "
                       "attempt): %s", error)
        return None


class CudaGraph:
    """One captured forward (torch.cuda.CUDAGraph), warmed up on a side stream first as capture requires."""

    def __init__(self, pool=None):
        self.graph = torch.cuda.CUDAGraph()
        self.pool = pool

    def capture(self, forward: Callable[[], torch.Tensor]) -> torch.Tensor:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):  # Triton compiles and torch's allocator settles outside the capture
                forward()
        torch.cuda.current_stream().wait_stream(side)
        with torch.cuda.graph(self.graph, pool=self.pool):
            out = forward()
        return out

    def replay(self) -> None:
        self.graph.replay()

    def memory_pool(self):
        return self.graph.pool()


@dataclass
class CapturedStep:
    size: int
    context: int  # the longest context it scores (its bucket)
    graph: object  # CudaGraph, or what a test puts in its place (capture / replay / memory_pool)
    logits: torch.Tensor  # [size, vocab], rewritten by every replay


class StaticInputs:
    """The buffers captured forwards read, for up to `largest` rows. A step's rows (input id, position, slot, block
    table) are written densely for its context bucket's table width w ([rows, 3 + w] at the start of one pinned host
    buffer) and reach the device in one copy; the captured forward starts by copying them out into the contiguous
    fields the kernels read (device to device, inside the graph). Only the bucket's columns travel."""

    def __init__(self, largest: int, max_blocks: int, device: torch.device):
        self.largest = largest
        cells = largest * (3 + max_blocks)
        self.host = torch.zeros(cells, dtype=torch.int64, pin_memory=device.type == "cuda")
        self.staged = torch.zeros(cells, dtype=torch.int64, device=device)
        self.ids = torch.zeros(largest, dtype=torch.int64, device=device)
        self.positions = torch.zeros_like(self.ids)
        self.slots = torch.zeros_like(self.ids)
        self.tables = torch.zeros(largest * max_blocks, dtype=torch.int64, device=device)
        self.copied = torch.cuda.Event() if device.type == "cuda" else None  # the last copy's end

    def rows(self, flat: torch.Tensor, width: int) -> torch.Tensor:
        return flat[: self.largest * (3 + width)].view(self.largest, 3 + width)

    def table(self, width: int) -> torch.Tensor:
        """The block tables' field for tables `width` blocks wide: [largest, width], contiguous."""
        return self.tables[: self.largest * width].view(self.largest, width)

    def fill(self, width: int, rows: list[tuple[int, int, int, list[int]]], size: int, pad_block: int,
             pad_slot: int) -> None:
        """Rows (token, position, slot, block table) then padding rows up to `size`, sent to the device."""
        if self.copied is not None:
            self.copied.synchronize()  # the previous step's copy has left the pinned buffer
        host = self.rows(self.host, width).numpy()
        for r, (token, position, slot, table) in enumerate(rows):
            table = table[:width]  # (blocks past the bucket hold no position the step reads)
            host[r, :3] = (token, position, slot)
            host[r, 3:3 + len(table)] = table
            host[r, 3 + len(table):] = 0
        host[len(rows):size] = 0  # padding: position 0 of the padding block
        host[len(rows):size, 2] = pad_slot
        host[len(rows):size, 3] = pad_block
        self.rows(self.staged, width)[:size].copy_(self.rows(self.host, width)[:size], non_blocking=True)
        if self.copied is not None:
            self.copied.record()

    def unstage(self, size: int, width: int) -> None:
        """The staged rows into the fields (a captured forward's first operations)."""
        staged = self.rows(self.staged, width)[:size]
        self.ids[:size].copy_(staged[:, 0])
        self.positions[:size].copy_(staged[:, 1])
        self.slots[:size].copy_(staged[:, 2])
        self.table(width)[:size].copy_(staged[:, 3:])


class DecodeGraphs:
    """Captured decode forwards, one per batch size and context bucket, and the copy-in / replay / slice that runs a
    step on them."""

    def __init__(self, model, kv_cache, sizes: tuple[int, ...], max_model_len: int, pad_block: int,
                 make_graph: Callable[[object], object] = CudaGraph):
        self.model, self.kv_cache = model, kv_cache
        self.sizes, self.contexts = sizes, cuda_graph_sizes.context_buckets(max_model_len)
        self.block_size = kv_cache.block_size
        self.pad_block, self.pad_slot = pad_block, pad_block * self.block_size
        self.inputs = StaticInputs(sizes[-1], self._width(max_model_len), kv_cache.device)
        start, free_before = time.perf_counter(), device_free_bytes(kv_cache.device)
        self.captured: dict[tuple[int, int], CapturedStep] = {}
        pool = None
        # The widest first: the rope table is made for it, and the others fit in its memory pool.
        with torch.inference_mode():
            for context in reversed(self.contexts):
                for size in reversed(sizes):
                    graph = make_graph(pool)
                    # Captured on padding rows alone: their writes go to the padding block.
                    self.inputs.fill(self._width(context), [], size, self.pad_block, self.pad_slot)
                    meta = self._metadata(size, context)
                    logits = graph.capture(lambda meta=meta: self._forward(meta))
                    pool = graph.memory_pool()
                    self.captured[size, context] = CapturedStep(size, context, graph, logits)
        # Device memory the captures took (their pool, the rope table, Triton's compiled kernels): None off CUDA.
        self.memory_bytes = None if free_before is None else free_before - device_free_bytes(kv_cache.device)
        logger.info("CUDA graphs: %d captured in %.1f s%s, decode batch sizes %s × contexts up to %s tokens (steps of "
                    "up to %d single-token decodes replay them, the rest run eagerly; --enforce-eager turns them off)",
                    len(self.captured), time.perf_counter() - start,
                    "" if self.memory_bytes is None else f" using {self.memory_bytes / 2**20:.0f} MiB",
                    ",".join(map(str, sizes)), ",".join(map(str, self.contexts)), sizes[-1])

    def takes(self, scheduled: list[ScheduledRequest], logits_rows: list[int]) -> bool:
        """Whether this step is one the graphs replay: every request one new token, sampled, no drafts, and no
        other logits rows (prompt logprobs)."""
        return (0 < len(scheduled) <= self.sizes[-1] and logits_rows == list(range(len(scheduled)))
                and all(len(s.token_ids) == 1 and s.sample and not s.spec_token_ids and s.state_slot < 0
                        for s in scheduled))

    def run(self, scheduled: list[ScheduledRequest]) -> torch.Tensor:
        """The step's logits [n, vocab] from the smallest captured size that holds its n requests and the smallest
        context bucket that holds its longest context."""
        n = len(scheduled)
        longest = max(s.num_computed_tokens + 1 for s in scheduled)
        step = self.captured[next(size for size in self.sizes if size >= n),
                             next(context for context in self.contexts if context >= longest)]
        rows = []
        for s in scheduled:
            position = s.num_computed_tokens
            slot = s.block_table[position // self.block_size] * self.block_size + position % self.block_size
            rows.append((s.token_ids[0], position, slot, s.block_table))
        self.inputs.fill(self._width(step.context), rows, step.size, self.pad_block, self.pad_slot)
        step.graph.replay()
        return step.logits[:n]

    def _width(self, context: int) -> int:
        """Block table entries that cover `context` tokens."""
        return -(-context // self.block_size)

    def _metadata(self, size: int, context: int) -> BatchMetadata:
        """The batch a captured forward of `size` rows reads: the static fields' first rows, and host values that are
        the capture's, not any step's (every context as long as the bucket's, for the shapes taken from them)."""
        inputs = self.inputs
        device = inputs.ids.device
        return BatchMetadata(
            input_ids=inputs.ids[:size], positions=inputs.positions[:size],
            query_start_loc=torch.arange(size + 1, dtype=torch.int64, device=device),
            seq_lens=torch.full((size,), context, dtype=torch.int64, device=device),
            block_tables=inputs.table(self._width(context))[:size], slot_mapping=inputs.slots[:size],
            logits_indices=torch.arange(size, dtype=torch.int64, device=device), block_size=self.block_size,
            query_start_loc_host=tuple(range(size + 1)), seq_lens_host=(context,) * size)

    def _forward(self, meta: BatchMetadata) -> torch.Tensor:
        """The captured work: the staged rows into the fields, the model, the logits."""
        size = meta.num_reqs
        self.inputs.unstage(size, meta.block_tables.shape[1])
        meta.derived.clear()  # a fresh batch each run; what eager steps make from host lengths, made on the device:
        meta.derived[("row requests",)] = meta.logits_indices  # row r is request r
        hidden = self.model.forward_hidden(meta, self.kv_cache.latent, self.kv_cache.indexer)
        return self.model.compute_logits(self.model.final_norm(hidden[meta.logits_indices]))
