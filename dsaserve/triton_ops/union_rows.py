"""Sparse MLA over a query tile's union, in Triton: a few neighbouring queries of one request read the rows any of them
selected once, each (query, head) pair keeping only its own query's rows.

With few heads per rank (GLM-5.2's 64 over TP=8: 8), the per-query kernel (selected_rows.py) fills half of
tl.dot's smallest tile and reads each query's 2,048 rows for 8 products. Here a program takes TILE_ROWS (query,
head) pairs, 32 // heads queries (4 at 8 heads, 2 at 16), and walks their union: neighbouring queries of a prompt
select mostly the same rows, so each row is read once for up to 32 products instead of once per query. A union
entry holds the row's cache slot and a bit per tile query that selected it; a pair's scores outside its query's
bits are masked out of the online softmax. Tiles (union_tiles.py) come from attention/tile_unions.py (built on
the device, sorted, no host synchronisation).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsaserve.triton_ops.selected_rows import ROWS_PER_STEP, _online_softmax_step, _query_tiles, dot_inputs
from dsaserve.triton_ops.union_tiles import TILE_ROWS, TileUnions, tile_queries


@triton.jit
def _union_rows_kernel(
    query, rows, tile_first, tile_len, slots, members, counts, out, scale, heads,
    q_stride_n, q_stride_h, row_stride, union_stride, out_stride_n, out_stride_h,
    QUERIES: tl.constexpr, VALUE: tl.constexpr, REST: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_V: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, LOW_PRECISION_DOT: tl.constexpr,
    PRECISION: tl.constexpr,
):
    tile = tl.program_id(0).to(tl.int64)
    m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    q = m // heads  # the pair's query within the tile
    h = m % heads
    pair_ok = (q < QUERIES) & (q < tl.load(tile_len + tile))
    row = tl.load(tile_first + tile) + q.to(tl.int64)
    v = tl.arange(0, BLOCK_V)
    q_value, q_rest = _query_tiles(query + row[:, None] * q_stride_n + h[:, None] * q_stride_h, pair_ok, VALUE, REST,
                                   BLOCK_V, BLOCK_R, LOW_PRECISION_DOT)
    best = tl.full((BLOCK_M,), -1.0e30, tl.float32)
    total = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_V), tl.float32)
    count = tl.load(counts + tile)
    for k0 in range(0, count, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        in_union = k < count
        slot = tl.load(slots + tile * union_stride + k, mask=in_union, other=-1)
        bits = tl.load(members + tile * union_stride + k, mask=in_union, other=0)
        member = (((bits[None, :] >> q[:, None]) & 1) != 0) & (slot[None, :] >= 0)  # [pairs, entries]
        best, total, acc = _online_softmax_step(q_value, q_rest, rows, slot, member, scale, best, total, acc,
                                                row_stride, VALUE, REST, BLOCK_V, BLOCK_R, LOW_PRECISION_DOT,
                                                PRECISION)
    result = acc / tl.where(total > 0, total, 1.0)[:, None]
    out_ptr = out + row[:, None] * out_stride_n + h[:, None] * out_stride_h + v[None, :]
    tl.store(out_ptr, result.to(out.dtype.element_ty), mask=pair_ok[:, None] & (v[None, :] < VALUE))


def attend_union_rows(query: torch.Tensor, rows: torch.Tensor, tiles: TileUnions, scale: float,
                      out: torch.Tensor) -> None:
    """out[i, h] = softmax(scale · query[i, h] · rows[S_i]ᵀ) · rows[S_i, :V] for every row i of a tile, S_i the
    slots of the union entries whose bit for i is set (tiles of tile_queries(heads) rows; heads at most TILE_ROWS)."""
    n, heads, dim = query.shape
    value = out.shape[-1]
    if rows.shape[1] != dim or out.shape[:2] != (n, heads) or value > dim:
        raise ValueError(f"union rows: query {tuple(query.shape)}, rows {tuple(rows.shape)}, out {tuple(out.shape)} "
                         "do not fit together")
    if heads > TILE_ROWS or tiles.queries != tile_queries(heads):
        raise ValueError(f"union rows: tiles of {tiles.queries} queries, {heads} heads take {tile_queries(heads)}")
    if tiles.members.stride() != tiles.slots.stride() or tiles.slots.stride(-1) != 1:
        raise ValueError("union rows: a tile's slots and member bits must be rows of one contiguous layout")
    count = tiles.first.shape[0]
    if count == 0:
        return
    query = query if query.stride(-1) == 1 else query.contiguous()
    rows = rows if rows.stride(-1) == 1 else rows.contiguous()
    target = out if out.stride(-1) == 1 else torch.empty_like(out)
    rest = dim - value
    low, precision = dot_inputs(rows.dtype)
    # fp32 tiles (the parity path) split their pairs over two programs: a [32, 512] fp32 query tile alone is 64 KiB of
    # shared memory, and with the rest over the 99 KiB of an RTX PRO 6000 (triton_ops/compile_check.py).
    block_m = TILE_ROWS if rows.element_size() <= 2 else TILE_ROWS // 2
    _union_rows_kernel[(count, TILE_ROWS // block_m)](
        query, rows, tiles.first, tiles.length, tiles.slots, tiles.members, tiles.counts, target, float(scale), heads,
        query.stride(0), query.stride(1), rows.stride(0), tiles.slots.stride(0), target.stride(0), target.stride(1),
        QUERIES=tiles.queries, VALUE=value, REST=rest, BLOCK_M=block_m,
        BLOCK_V=max(16, triton.next_power_of_2(value)), BLOCK_R=max(16, triton.next_power_of_2(max(rest, 1))),
        BLOCK_K=ROWS_PER_STEP if rows.element_size() <= 2 else ROWS_PER_STEP // 2, LOW_PRECISION_DOT=low,
        PRECISION=precision, num_warps=8 if value >= 256 else 4,
    )
    if target is not out:
        out.copy_(target)
