"""BatchMetadata: the addressing contract between the runner and the model.

One forward runs a flattened mixed batch: request i contributes tokens
`query_start_loc[i]:query_start_loc[i+1]`, which are its positions
`seq_lens[i] - query_len .. seq_lens[i] - 1` on top of `seq_lens[i] - query_len` cached tokens.
Prefill, chunked prefill and decode are the same code path. Attention never infers request
boundaries from tensor shapes; it reads them from here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from dsaserve.attention.context_shard import ContextShard


@dataclass(frozen=True)
class BatchMetadata:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64, logical position of each new token inside its request
    query_start_loc: torch.Tensor  # [B + 1] int64, cumulative query lengths
    seq_lens: torch.Tensor  # [B] int64, cached context + new tokens
    block_tables: torch.Tensor  # [B, max_blocks] int64 physical block ids, padded with 0
    slot_mapping: torch.Tensor  # [T] int64 physical slot (block * block_size + offset) of each new token
    logits_indices: torch.Tensor  # [N] int64 rows of the flattened batch that need logits
    block_size: int
    # Host copies of the boundaries, made once per batch, so per-layer loops never sync with the device.
    query_start_loc_host: tuple[int, ...]
    seq_lens_host: tuple[int, ...]
    # Decode context parallelism: this rank's share of the context; only the rows of tokens it owns
    # (`write_rows`) are written to its caches, at `slot_mapping`. None: every row, every token.
    shard: ContextShard | None = None
    write_rows: torch.Tensor | None = None
    # A hybrid model's KDA layers: each request's state slot (attention/linear_state.py); empty otherwise.
    state_slots: tuple[int, ...] = ()
    state_restore: tuple[int, ...] = ()  # per request: the snapshot its state starts from (-1: none)
    state_snapshots: tuple[tuple[tuple[int, int], ...], ...] = ()  # per request: (position, snapshot slot) to keep
    # What the layers derive from the batch alone (the same in every layer), made by the first layer.
    derived: dict = field(default_factory=dict, compare=False, repr=False)

    def once(self, key, make: Callable):
        """make() the first time a layer asks for `key` in this batch, the same object after that."""
        if key not in self.derived:
            self.derived[key] = make()
        return self.derived[key]

    def rows_to_write(self, x: torch.Tensor) -> torch.Tensor:
        """The rows of x ([T, ...], one per new token) whose tokens this rank's caches store."""
        return x if self.write_rows is None else x[self.write_rows]

    @property
    def num_reqs(self) -> int:
        return len(self.seq_lens_host)

    @property
    def num_tokens(self) -> int:
        return self.query_start_loc_host[-1]

    def query_range(self, i: int) -> tuple[int, int]:
        return self.query_start_loc_host[i], self.query_start_loc_host[i + 1]

    def context_len(self, i: int) -> int:
        start, end = self.query_range(i)
        return self.seq_lens_host[i] - (end - start)

    def position_of(self, i: int, row: int) -> int:
        """Logical position of batch row `row` (a row of request i), from the host copies."""
        return self.context_len(i) + row - self.query_start_loc_host[i]

    def split_at_position(self, i: int, position: int) -> int:
        """First batch row of request i whose position is ≥ `position` (its rows are consecutive)."""
        start, end = self.query_range(i)
        return min(max(start + position - self.context_len(i), start), end)

    def decode_requests(self) -> list[int]:
        """Requests with exactly one new token this step (their row is query_start_loc[i])."""
        starts = self.query_start_loc_host
        return [i for i in range(self.num_reqs) if starts[i + 1] - starts[i] == 1]

    def few_row_requests(self, limit: int) -> list[int]:
        """Requests with 2 … limit new tokens (a verified draft round, a short chunk)."""
        starts = self.query_start_loc_host
        return [i for i in range(self.num_reqs) if 1 < starts[i + 1] - starts[i] <= limit]

    def rows_as_single_queries(self, reqs: list[int]) -> "BatchMetadata":
        """A view for the batched single-query paths: every row of `reqs` as a request of its own whose
        context ends at the row's position (its query_start_loc is the row's place in the batch; the
        rows' own keys are already in the cache). Only start, seq_lens and block_tables are meaningful."""
        rows = [r for i in reqs for r in range(*self.query_range(i))]
        owners = [i for i in reqs for _ in range(*self.query_range(i))]
        lens = [self.position_of(i, r) + 1 for i, r in zip(owners, rows)]
        device = self.block_tables.device
        starts = tuple(rows) + (rows[-1] + 1,)
        return BatchMetadata(
            input_ids=self.input_ids, positions=self.positions,
            query_start_loc=torch.tensor(starts, dtype=torch.int64, device=device),
            seq_lens=torch.tensor(lens, dtype=torch.int64, device=device),
            block_tables=self.block_tables[torch.tensor(owners, device=device)], slot_mapping=self.slot_mapping,
            logits_indices=self.logits_indices, block_size=self.block_size, query_start_loc_host=starts,
            seq_lens_host=tuple(lens),
        )

    def row_requests(self) -> torch.Tensor:
        """int64 [T]: the request each row of the batch belongs to (made once per step, from host lengths)."""
        def make():
            starts = self.query_start_loc_host
            lengths = torch.tensor([starts[i + 1] - starts[i] for i in range(self.num_reqs)])
            return torch.repeat_interleave(torch.arange(self.num_reqs), lengths).to(self.positions.device)
        return self.once(("row requests",), make)

    def slots_of(self, reqs: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Physical slots of positions [R, W] (all valid) of the requests reqs [R]."""
        tables = self.block_tables[reqs]
        return tables.gather(1, positions // self.block_size) * self.block_size + positions % self.block_size

    def slots(self, i: int, positions: torch.Tensor) -> torch.Tensor:
        """Physical cache slots of request i's logical `positions` (any shape, all valid)."""
        table = self.block_tables[i]
        return table[positions // self.block_size] * self.block_size + positions % self.block_size

    def context_slots(self, i: int, length: int) -> torch.Tensor:
        """Physical slots of request i's first `length` positions, in logical order (position → slot)."""
        return self.slots(i, torch.arange(length, device=self.block_tables.device))

    @classmethod
    def build(
        cls,
        token_ids: list[list[int]],
        context_lens: list[int],
        block_tables: list[list[int]],
        block_size: int,
        logits_indices: list[int],
        device: torch.device | str = "cpu",
        shard: ContextShard | None = None,
        state_slots: list[int] | None = None,
        state_restore: list[int] | None = None,
        state_snapshots: list[tuple[tuple[int, int], ...]] | None = None,
    ) -> "BatchMetadata":
        """token_ids[i] are request i's new tokens, placed after context_lens[i] cached ones. With a
        shard, block_size is the scheduler's (tokens per block across the DCP group)."""
        if not (len(token_ids) == len(context_lens) == len(block_tables)):
            raise ValueError("token_ids, context_lens and block_tables need one entry per request")
        flat_ids, positions, starts, seq_lens = [], [], [0], []
        for ids, ctx in zip(token_ids, context_lens):
            flat_ids.extend(ids)
            positions.extend(range(ctx, ctx + len(ids)))
            starts.append(starts[-1] + len(ids))
            seq_lens.append(ctx + len(ids))
        for i, (table, n) in enumerate(zip(block_tables, seq_lens)):
            if len(table) * block_size < n:
                raise ValueError(f"request {i} has {n} tokens but its block table covers {len(table) * block_size}")
        # Built from host lists, a tensor each: a decode step builds this for every forward (MTP draft
        # steps included), and a handful of tensor operators per field cost more than the arithmetic.
        width = max(max((len(t) for t in block_tables), default=0), 1)
        tables = torch.tensor([list(t) + [0] * (width - len(t)) for t in block_tables] or [[0] * width],
                              dtype=torch.int64)[: len(block_tables)]
        pos = torch.tensor(positions, dtype=torch.int64)
        write_rows = None
        if shard is None:
            slot_mapping = torch.tensor([table[p // block_size] * block_size + p % block_size
                                         for ids, ctx, table in zip(token_ids, context_lens, block_tables)
                                         for p in range(ctx, ctx + len(ids))], dtype=torch.int64)
        else:
            req_of_token = torch.repeat_interleave(
                torch.arange(len(token_ids)), torch.tensor([len(t) for t in token_ids], dtype=torch.int64))
            write_rows = shard.owns(pos).nonzero().squeeze(1)
            slot_mapping = shard.local_slots(tables[req_of_token[write_rows]], pos[write_rows, None]).squeeze(1)
            write_rows = write_rows.to(device)
        fields = on_device(device, input_ids=torch.tensor(flat_ids, dtype=torch.int64), positions=pos,
                           query_start_loc=torch.tensor(starts, dtype=torch.int64),
                           seq_lens=torch.tensor(seq_lens, dtype=torch.int64), block_tables=tables,
                           slot_mapping=slot_mapping,
                           logits_indices=torch.tensor(logits_indices, dtype=torch.int64))
        return cls(
            **fields,
            block_size=block_size,
            query_start_loc_host=tuple(starts),
            seq_lens_host=tuple(seq_lens),
            shard=shard,
            write_rows=write_rows,
            state_slots=tuple(state_slots or ()),
            state_restore=tuple(state_restore or [-1] * len(token_ids)),
            state_snapshots=tuple(state_snapshots or [()] * len(token_ids)),
        )


def on_device(device: torch.device | str, **host: torch.Tensor) -> dict[str, torch.Tensor]:
    """The step's int64 host tensors on `device`. On a GPU they travel as one pinned buffer in one asynchronous
    copy (the step's kernels queue behind it; seven blocking copies would each wait for the GPU to drain)."""
    device = torch.device(device)
    if device.type == "cpu":
        return host
    flat = torch.cat([t.reshape(-1) for t in host.values()]).pin_memory().to(device, non_blocking=True)
    out, start = {}, 0
    for name, t in host.items():
        out[name] = flat[start:start + t.numel()].view(t.shape)
        start += t.numel()
    return out
