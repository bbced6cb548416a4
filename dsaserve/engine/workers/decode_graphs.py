"""Decode steps replayed from CUDA graphs: the model's forward over a batch of decoding requests, captured at start-up
once per batch size, tokens per request and context bucket, and replayed with each step's inputs copied into static
buffers.

A captured forward reads its batch only from those buffers (input ids, positions, the slots its rows write, block
tables) for `size` requests. A batch of n requests replays the smallest captured size ≥ n; its other requests are
padding: their rows write latent rows and indexer keys into a block of its own that the scheduler never hands out
(the cache's last, `pad_block`) and attend only to it; their logits are dropped. What an eager step takes from the host
(the indexer's scoring width: the batch's longest context; the rope table's length) is the capture's context
bucket: 4,096 tokens × 4^i up to max_model_len (cuda_graph_sizes.py), the smallest that holds the step's longest
context. Positions past each query score -inf and are never selected, so a replay selects what an eager step
selects, and the buckets keep the scoring and top-k of a short batch from spanning max_model_len. With speculative
decoding, verify steps (each request's last known token and its drafts: 1 + num_speculative_tokens rows) are
captured too, and the replay gives the hidden states the MTP drafter reads; the drafter's catch-ups and rounds
replay graphs of their own (engine/speculative/draft_graphs.py, CapturedSteps as these are, in their memory pool).
A request with fewer drafts (none after its prompt, fewer near its max_tokens) runs padding rows after its tokens, so
a step that mixes them still replays. Other steps (prompt rows, prompt logprobs, more requests than the largest size)
run eagerly. Sampling, verification and the logits processors run after the replay on its logits, as after an
eager step. A hybrid model's (GLM-5.3-Flash) requests bring their KDA state slots in the static buffers (the padding
requests one slot of their own, started afresh every step), and each row writes the pooled key its token would
complete, into a pool of the padding block where it completes none; its verify steps and the steps that keep or
restore a prefix-cache snapshot of the state run eagerly. Under decode context parallelism a captured step's
members write every row, each row whose token another member holds into the padding block (`slot_of`): the eager
step's subset of rows would be a data-sized tensor.

The model's forward under capture must not read a device value on the host or make a tensor from host data: what
eager steps make from host lengths is made from the capture's shapes instead (`_metadata`, `_fresh_batch`,
`_state_rows`), and the Triton path's kernels take
their shapes from the tensors they get (tests/test_decode_graphs.py watches a replayed forward for both).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable

import torch

from dsaserve import cuda_graph_sizes, triton_ops
from dsaserve.attention import pooled_keys, tile_unions
from dsaserve.attention.context_shard import ContextShard
from dsaserve.attention.metadata import BatchMetadata
from dsaserve.engine.scheduling.scheduler_output import ScheduledRequest
from dsaserve.model import kda

logger = logging.getLogger(__name__)


def graphs_off_because(args, cfg, device: torch.device, model, parallel) -> str | None:
    """Why decode steps do not replay CUDA graphs in this engine (None: they do)."""
    if not graphs_possible(device):
        return f"the device is {device.type}"
    reasons = [
        (args.enforce_eager, "--enforce-eager"),
        (triton_ops.active_device() is None, "the Triton kernels are off (their forward is the one captured)"),
        (parallel.check_ranks, "--check-ranks (it compares values on the host)"),
        (not model.backend.uses_indexer, f"the {model.backend.name} backend (its attention loops on the host)"),
    ]
    return next((why for off, why in reasons if off), None)


def graphs_possible(device: torch.device) -> bool:
    return device.type == "cuda"


def device_free_bytes(device: torch.device) -> int | None:
    """Free memory on a CUDA device (what the driver reports, other processes included); None elsewhere."""
    return torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else None


def capture(model, kv_cache, sizes: tuple[int, ...], max_model_len: int, pad_block: int,
            rows: tuple[int, ...], pad_slot: int = -1) -> "DecodeGraphs | None":
    """The engine's decode graphs; None, with a warning saying why, where a capture fails (decode then runs eagerly,
    as with --enforce-eager)."""
    try:
        return DecodeGraphs(model, kv_cache, sizes, max_model_len, pad_block, make_graph=CudaGraph, rows=rows,
                            pad_slot=pad_slot)
    except RuntimeError as error:  # an operation the capture refused
        logger.warning("CUDA graphs: capture failed, so decode steps run eagerly (--enforce-eager skips the "
                       "attempt): %s", error)
        return None


class CudaGraph:
    """One captured forward (torch.cuda.CUDAGraph), warmed up on a side stream first as capture requires."""

    def __init__(self, pool=None):
        self.graph = torch.cuda.CUDAGraph()
        self.pool = pool

    def capture(self, forward: Callable[[], tuple[torch.Tensor, ...]]) -> tuple[torch.Tensor, ...]:
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


@dataclass(frozen=True)
class Shape:
    """What one captured forward takes: `size` requests of `rows` tokens each (1, or a verify step's known token and
    its drafts), contexts up to `context` tokens (block tables `blocks` wide)."""

    size: int
    rows: int
    context: int
    blocks: int

    @property
    def tokens(self) -> int:
        return self.size * self.rows


@dataclass
class CapturedStep:
    shape: Shape
    graph: object  # CudaGraph, or what a test puts in its place (capture / replay / memory_pool)


class StaticInputs:
    """The buffers captured forwards read. A step's token rows (input id, position, slot) and its requests' block
    tables (its bucket's width) are written densely at the start of one pinned host buffer and reach the device in one
    copy; the captured forward starts by copying them out into the contiguous fields the kernels read (device to
    device, inside the graph). Only what the step's shape needs travels."""

    def __init__(self, tokens: int, requests: int, max_blocks: int, device: torch.device):
        cells = 3 * tokens + requests * max_blocks + requests
        self.host = torch.zeros(cells, dtype=torch.int64, pin_memory=device.type == "cuda")
        self.staged = torch.zeros(cells, dtype=torch.int64, device=device)
        self.ids = torch.zeros(tokens, dtype=torch.int64, device=device)
        self.positions = torch.zeros_like(self.ids)
        self.slots = torch.zeros_like(self.ids)
        self.tables = torch.zeros(requests * max_blocks, dtype=torch.int64, device=device)
        self.state_slots = torch.zeros(requests, dtype=torch.int64, device=device)  # a hybrid model's KDA states
        self.copied = torch.cuda.Event() if device.type == "cuda" else None  # the last copy's end

    @staticmethod
    def parts(flat: torch.Tensor, shape: Shape) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(token rows [tokens, 3], block tables [size, blocks], state slots [size]) of `shape` at the start of
        `flat`."""
        n, tables = 3 * shape.tokens, shape.size * shape.blocks
        return (flat[:n].view(shape.tokens, 3), flat[n:n + tables].view(shape.size, shape.blocks),
                flat[n + tables:n + tables + shape.size])

    def table(self, shape: Shape) -> torch.Tensor:
        """The block tables' field of `shape`: [size, blocks], contiguous."""
        return self.tables[: shape.size * shape.blocks].view(shape.size, shape.blocks)

    def fill(self, shape: Shape, requests: list[tuple[list[int], int, list[int], int]], pad_block: int,
             block_size: int, shard: ContextShard | None = None, pad_slot: int = -1) -> None:
        """Requests (their tokens, up to `rows`; the first one's position, block table, KDA state slot), then padding
        requests up to the shape's size (positions 0 … rows - 1 of the padding block, the padding state slot), sent to
        the device. A request with fewer tokens gets padding rows after them (token 0 at the next positions, which no
        row of this step attends to and a later step rewrites before any row does; past its block table they write into
        the padding block). Under decode context parallelism (`shard`; block_size the scheduler's) a row whose token
        another member holds writes into the padding block, so every member writes every row (a captured forward takes
        no data-sized subset)."""
        if self.copied is not None:
            self.copied.synchronize()  # the previous step's copy has left the pinned buffer
        tokens, tables, slots = (part.numpy() for part in self.parts(self.host, shape))
        slots[:] = pad_slot
        for i, (ids, start, table, state_slot) in enumerate(requests):
            rows = tokens[i * shape.rows:(i + 1) * shape.rows]
            positions = range(start, start + shape.rows)
            rows[:len(ids), 0] = ids
            rows[len(ids):, 0] = 0
            rows[:, 1] = positions
            rows[:, 2] = [slot_of(table, p, pad_block, block_size, shard) for p in positions]
            table = table[: shape.blocks]  # (blocks past the bucket hold no position the step reads)
            tables[i, :len(table)] = table
            tables[i, len(table):] = 0
            slots[i] = state_slot
        padding = tokens[len(requests) * shape.rows:]
        padding[:, 0] = 0
        padding[:, 1] = [j % shape.rows for j in range(len(padding))]
        padding[:, 2] = [slot_of([pad_block], p, pad_block, block_size, shard) for p in padding[:, 1]]
        tables[len(requests):] = 0
        tables[len(requests):, 0] = pad_block
        cells = 3 * shape.tokens + shape.size * (shape.blocks + 1)  # every part, at the buffer's start: one copy
        self.staged[:cells].copy_(self.host[:cells], non_blocking=True)
        if self.copied is not None:
            self.copied.record()

    def unstage(self, shape: Shape) -> None:
        """The staged rows into the fields (a captured forward's first operations)."""
        tokens, tables, slots = self.parts(self.staged, shape)
        self.ids[:shape.tokens].copy_(tokens[:, 0])
        self.positions[:shape.tokens].copy_(tokens[:, 1])
        self.slots[:shape.tokens].copy_(tokens[:, 2])
        self.table(shape).copy_(tables)
        self.state_slots[:shape.size].copy_(slots)


def slot_of(table: list[int], position: int, pad_block: int, block_size: int, shard: ContextShard | None) -> int:
    """The cache slot a captured step writes `position` of the request with block table `table` to: its own slot (a
    member's local one under DCP), or one of the padding block's past the table, or under DCP where another member
    holds the token."""
    if shard is None:
        block = position // block_size
        return (table[block] if block < len(table) else pad_block) * block_size + position % block_size
    local = position // shard.size
    block = local // shard.block_size
    if position % shard.size != shard.rank or block >= len(table):
        return pad_block * shard.block_size + local % shard.block_size
    return table[block] * shard.block_size + local % shard.block_size


class CapturedSteps:
    """What decode graphs and the drafter's graphs share: the static inputs, one graph captured per shape (the widest
    first, all in one memory pool), the outputs every graph copies into, and the shape a step replays."""

    what = "steps"  # for the log line

    def __init__(self, model, kv_cache, sizes: tuple[int, ...], max_model_len: int, pad_block: int,
                 rows: tuple[int, ...], pad_slot: int = -1):
        self.model, self.kv_cache = model, kv_cache
        self.sizes, self.rows, self.contexts = sizes, rows, cuda_graph_sizes.context_buckets(max_model_len)
        self.block_size, self.shard = kv_cache.block_size, kv_cache.shard  # (the scheduler's tokens per block)
        if max(rows) > self.block_size:
            raise ValueError(f"{max(rows)} tokens per request in a captured step need block_size ≥ {max(rows)}")
        self.pad_block, self.pad_slot = pad_block, pad_slot
        self.inputs = StaticInputs(sizes[-1] * max(rows), sizes[-1], self._width(max_model_len), kv_cache.device)
        self.captured: dict[Shape, CapturedStep] = {}
        # Every graph writes its outputs into these (made by the first warm-up, outside the graphs' pool), so a graph
        # keeps no output of its own and the pool holds one step's intermediates, not the sum of every graph's logits.
        self.outputs: tuple[torch.Tensor, ...] | None = None
        self.memory_bytes: int | None = None
        self.pool = None

    def capture_all(self, make_graph: Callable[[object], object], pool=None) -> None:
        """Every shape's graph, into `pool` (another set's, to share it) or a new one; logs what was captured."""
        start, free_before = time.perf_counter(), device_free_bytes(self.kv_cache.device)
        shapes = sorted(self._shapes(), key=lambda s: (s.context, s.tokens), reverse=True)
        with torch.inference_mode():
            # The widest first: the rope table and the outputs are made for it, and the others fit in its memory pool.
            for shape in shapes:
                graph = make_graph(pool)
                # padding alone: the padding block (and state slot)
                self.inputs.fill(shape, [], self.pad_block, self.block_size, self.shard, self.pad_slot)
                body = self._body(shape)
                graph.capture(lambda body=body, shape=shape: self._into_outputs(body(), shape))
                pool = graph.memory_pool()
                self.captured[shape] = CapturedStep(shape, graph)
        self.pool = pool
        # Device memory the captures took (their pool, the rope table, Triton's compiled kernels): None off CUDA.
        self.memory_bytes = None if free_before is None else free_before - device_free_bytes(self.kv_cache.device)
        logger.info("CUDA graphs: %d %s captured in %.1f s%s, batch sizes %s × %s tokens per request × contexts "
                    "up to %s tokens (%s; --enforce-eager turns them off)",
                    len(self.captured), self.what, time.perf_counter() - start,
                    "" if self.memory_bytes is None else f" using {self.memory_bytes / 2**20:.0f} MiB",
                    ",".join(map(str, self.sizes)), " or ".join(map(str, self.rows)),
                    ",".join(map(str, self.contexts)), self.replayed())

    def replayed(self) -> str:
        """Which steps replay the graphs (for the log line)."""
        raise NotImplementedError

    def _shapes(self) -> list[Shape]:
        return [Shape(size, rows, context, self._width(context))
                for size in self.sizes for rows in self.rows for context in self.contexts]

    def _body(self, shape: Shape) -> Callable[[], tuple[torch.Tensor, ...]]:
        """The captured work of `shape`, returning its outputs (copied into the first rows of the shared ones)."""
        raise NotImplementedError

    def _into_outputs(self, outputs: tuple[torch.Tensor, ...], shape: Shape) -> tuple[torch.Tensor, ...]:
        if self.outputs is None:  # the widest shape's warm-up, before any capture
            self.outputs = tuple(torch.empty_like(out) for out in outputs)
        for shared, out in zip(self.outputs, outputs):
            shared[:out.shape[0]].copy_(out)
        return tuple(shared[:out.shape[0]] for shared, out in zip(self.outputs, outputs))

    def _replay(self, n: int, rows: int, longest: int, requests: list[tuple[list[int], int, list[int], int]]) -> None:
        """Replays the smallest captured size that holds n requests of `rows` tokens and the smallest context bucket
        that holds the longest context, with `requests` (StaticInputs.fill's) in its static inputs."""
        size = next(size for size in self.sizes if size >= n)
        context = next(context for context in self.contexts if context >= longest)
        step = self.captured[Shape(size, rows, context, self._width(context))]
        self.inputs.fill(step.shape, requests, self.pad_block, self.block_size, self.shard, self.pad_slot)
        step.graph.replay()

    def _width(self, context: int) -> int:
        """Block table entries that cover `context` tokens."""
        return -(-context // self.block_size)

    def _metadata(self, shape: Shape, rows: int, ids: torch.Tensor, positions: torch.Tensor,
                  slots: torch.Tensor) -> BatchMetadata:
        """A batch of `shape.size` requests of `rows` tokens each from these fields, with host values that are the
        capture's, not any step's (every context as long as the bucket's, for the shapes taken from them)."""
        n, size, device = ids.shape[0], shape.size, ids.device
        return BatchMetadata(
            input_ids=ids, positions=positions,
            query_start_loc=torch.arange(0, n + 1, rows, dtype=torch.int64, device=device),
            seq_lens=torch.full((size,), shape.context, dtype=torch.int64, device=device),
            block_tables=self.inputs.table(shape), slot_mapping=slots,
            logits_indices=torch.arange(n, dtype=torch.int64, device=device), block_size=self.block_size,
            query_start_loc_host=tuple(range(0, n + 1, rows)), seq_lens_host=(shape.context,) * size,
            shard=self.shard, state_slots=(self.pad_slot,) * size if self.pad_slot >= 0 else (),
            state_restore=(-1,) * size, state_snapshots=((),) * size)

    @staticmethod
    def _fresh_batch(meta: BatchMetadata, rows: int) -> None:
        """What eager steps make from host lengths, made inside the captured work: a fresh batch each run."""
        meta.derived.clear()
        requests = torch.arange(meta.num_reqs * rows, device=meta.positions.device) // rows
        meta.derived["requests"] = meta.derived[("row requests",)] = requests  # the request of each row
        tile_unions.per_query_only(meta)


class DecodeGraphs(CapturedSteps):
    """Captured decode forwards, one per batch size, tokens per request and context bucket, and the copy-in / replay /
    slice that runs a step on them."""

    what = "decode steps"

    def __init__(self, model, kv_cache, sizes: tuple[int, ...], max_model_len: int, pad_block: int,
                 make_graph: Callable[[object], object] = CudaGraph, rows: tuple[int, ...] = (1,), pad_slot: int = -1):
        """rows: tokens per request captured (1; with speculative decoding also 1 + its drafts). pad_slot: a hybrid
        model's KDA state slot that no request holds, the padding requests' (-1: the model keeps no state)."""
        self.hybrid = model.config.hybrid
        if self.hybrid is not None and (pad_slot < 0 or rows != (1,)):
            raise ValueError("a hybrid model's decode graphs take one token per request and a padding state slot "
                             f"(rows={rows}, pad_slot={pad_slot})")
        super().__init__(model, kv_cache, sizes, max_model_len, pad_block, rows, pad_slot)
        self.capture_all(make_graph)

    def replayed(self) -> str:
        return (f"steps of up to {self.sizes[-1]} requests that all decode or verify drafts replay them, a request "
                "with fewer drafts on padding rows; the rest run eagerly")

    def takes(self, scheduled: list[ScheduledRequest], logits_rows: list[int]) -> bool:
        """Whether this step is one the graphs replay: every request sampled from its last known token and its drafts
        (none to as many as a captured shape has rows for), every row's logits wanted (no prompt logprobs), and no KDA
        state restored from or copied to a prefix-cache snapshot (those steps run eagerly)."""
        if not 0 < len(scheduled) <= self.sizes[-1]:
            return False
        rows = self._rows(scheduled)
        return (rows is not None and logits_rows == list(range(sum(len(s.token_ids) for s in scheduled)))
                and max(s.num_computed_tokens for s in scheduled) + rows <= self.contexts[-1]
                and all(len(s.spec_token_ids) == len(s.token_ids) - 1 and s.sample
                        and s.state_restore < 0 and not s.state_snapshots for s in scheduled))

    def run(self, scheduled: list[ScheduledRequest]) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's (logits, hidden states) of its tokens, in the step's order (a request with fewer tokens than the
        shape's rows per request ran padding rows after them: theirs are dropped)."""
        n, rows = len(scheduled), self._rows(scheduled)
        self._replay(n, rows, max(s.num_computed_tokens for s in scheduled) + rows,
                     [(s.token_ids, s.num_computed_tokens, s.block_table, s.state_slot) for s in scheduled])
        logits, hidden = self.outputs
        if all(len(s.token_ids) == rows for s in scheduled):
            return logits[: n * rows], hidden[: n * rows]
        kept = torch.tensor([i * rows + j for i, s in enumerate(scheduled) for j in range(len(s.token_ids))],
                            device=logits.device)
        return logits[kept], hidden[kept]

    def _rows(self, scheduled: list[ScheduledRequest]) -> int | None:
        """The fewest captured rows per request that hold every request's tokens (None: more than any)."""
        widest = max(len(s.token_ids) for s in scheduled)
        return next((rows for rows in sorted(self.rows) if rows >= widest), None)

    def _body(self, shape: Shape) -> Callable[[], tuple[torch.Tensor, ...]]:
        inputs, n = self.inputs, shape.tokens
        meta = self._metadata(shape, shape.rows, inputs.ids[:n], inputs.positions[:n], inputs.slots[:n])
        return lambda: self._step(meta, shape)

    def _step(self, meta: BatchMetadata, shape: Shape) -> tuple[torch.Tensor, torch.Tensor]:
        """The staged rows into the fields, the model, the logits and hidden states."""
        self.inputs.unstage(shape)
        self._fresh_batch(meta, shape.rows)
        if self.hybrid is not None:
            self._state_rows(meta, shape)
        hidden = self.model.forward_hidden(meta, self.kv_cache.latent, self.kv_cache.indexer)
        return self.model.compute_logits(self.model.final_norm(hidden[meta.logits_indices])), hidden

    def _state_rows(self, meta: BatchMetadata, shape: Shape) -> None:
        """What a hybrid model's eager step makes from host values, from the static buffers instead: each request's
        KDA state slot (padding requests start theirs afresh each step), and the pooled keys every row writes
        (attention/pooled_keys.py)."""
        slots = self.inputs.state_slots[:shape.size]
        rows = torch.arange(shape.size, device=slots.device)  # (one token per request: row i is request i's)
        kda.seed_single_rows(meta, rows, slots, slots == self.pad_slot)
        kpool = self.hybrid.index_kpool
        pooled_keys.every_row_writes_a_pool(meta, kpool, self.pad_block * (self.kv_cache.block_size // kpool))
