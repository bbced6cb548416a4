"""Each row's top k of a score tile in Triton, by radix selection (the indexer's top-k on the CUDA path).

A score's fp32 bits map to an int32 whose order is the scores' order (`_order_key`). One program per row finds the
k-th largest key a digit at a time, from the top: a histogram of the next digit over the keys that match the digits
found so far says which digit value holds the k-th and how many keys lie above it. Three histograms (the top byte,
then 12 bits, then the last 12) fix the key exactly; one more pass writes the positions of the keys above it and,
of the keys equal to it, the first ones by position until k are written. Memory is the row and the output: nothing
grows with k or the context. The reads are whole rows: four passes, three where the scoring kernel counted the top
byte as it wrote the scores (index_scores.py's `counts`), one where a row has at most k candidates. The candidates
are the scores above -inf: -inf (a position in the query's future, or past its request) and NaN are never chosen,
and a row with fewer than k candidates fills its remaining entries with -1. -0.0 and +0.0 are one value. The
positions come out in no particular order (the sparse attention does not care); `top_byte_counts` is the first
histogram in torch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BINS = 256  # values of the top byte: the first histogram, the one the scoring kernel counts
COLUMNS_PER_STEP = 1024


@triton.jit
def _order_key(x):
    """int32 keys ordered as the fp32 values are: non-negative floats keep their bits, negative ones flip the
    magnitude bits so that a larger magnitude orders lower (-0.0 taken as +0.0: equal scores, one key)."""
    bits = tl.where(x == 0.0, 0, x.to(tl.int32, bitcast=True))
    return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


@triton.jit
def _key_digit(key, SHIFT: tl.constexpr, BITS: tl.constexpr):
    """The BITS bits of `key` from SHIFT up as a bin, in the keys' order (the top byte's sign bit flipped: negative
    keys order below non-negative ones)."""
    digit = (key >> SHIFT) & ((1 << BITS) - 1)
    if SHIFT == 24:
        digit = digit ^ 0x80
    return digit


@triton.jit
def _digit_histogram(row, columns, prefix, SHIFT: tl.constexpr, BITS: tl.constexpr, BLOCK: tl.constexpr):
    """Counts per value of the digit at SHIFT over the row's candidates whose higher bits equal `prefix`
    (key >> (SHIFT + BITS) as a signed value; any key for the top byte)."""
    counts = tl.full((1 << BITS,), 0, tl.int32)
    for start in range(0, columns, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(row + cols, mask=cols < columns, other=float("-inf"))
        key = _order_key(x)
        match = x > float("-inf")
        if SHIFT + BITS < 32:
            match = match & ((key >> (SHIFT + BITS)) == prefix)
        counts += tl.histogram(_key_digit(key, SHIFT, BITS), 1 << BITS, mask=match)
    return counts


@triton.jit
def _row_topk_kernel(scores, first_counts, out, columns, k, score_stride, count_stride, out_stride,
                     HAS_COUNTS: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    row = scores + t * score_stride
    if HAS_COUNTS:
        counts = tl.load(first_counts + t * count_stride + tl.arange(0, 256))
    else:
        counts = _digit_histogram(row, columns, 0, 24, 8, BLOCK)
    candidates = tl.sum(counts, axis=0)
    chosen = tl.minimum(candidates, k)
    prefix = -2147483648  # below every key: where every candidate is chosen, no pass looks further
    wanted = 0  # of the keys equal to prefix, how many go in
    if candidates > k:
        wanted = chosen
        prefix = 0  # the digits found so far: key >> shift (signed) of the k-th key
        for step in tl.static_range(3):  # bits 24-31, 12-23, 0-11
            if step == 0:
                level = counts
            else:
                level = _digit_histogram(row, columns, prefix, 24 - 12 * step, 12, BLOCK)
            # The digit value holding the wanted-th largest key among those counted; the keys above it all go in.
            at_or_above = tl.cumsum(level, axis=0, reverse=True)
            digit = tl.sum((at_or_above >= wanted).to(tl.int32), axis=0) - 1
            wanted -= tl.sum(tl.where(tl.arange(0, level.shape[0]) == digit, at_or_above - level, 0), axis=0)
            if step == 0:
                prefix = digit - 128  # (the top byte's bins flip the sign bit)
            else:
                prefix = prefix * 4096 + digit
    # prefix is the k-th largest key (or below every key); `wanted` of the keys equal to it go in, after those above.
    greater_seen = 0
    equal_seen = 0
    for start in range(0, columns, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(row + cols, mask=cols < columns, other=float("-inf"))
        key = _order_key(x)
        greater = (x > float("-inf")) & (key > prefix)
        equal = (x > float("-inf")) & (key == prefix)
        greater_slot = greater_seen + tl.cumsum(greater.to(tl.int32), axis=0) - 1
        equal_rank = equal_seen + tl.cumsum(equal.to(tl.int32), axis=0) - 1
        slot = tl.where(greater, greater_slot, chosen - wanted + equal_rank)
        take = (greater | (equal & (equal_rank < wanted))) & (slot < k)  # (the bound: never a write past the row)
        tl.store(out + t * out_stride + slot, cols, mask=take)
        greater_seen += tl.sum(greater.to(tl.int32), axis=0)
        equal_seen += tl.sum(equal.to(tl.int32), axis=0)
    for start in range(chosen, k, BLOCK):  # fewer candidates than k: the rest of the entries are empty
        slot = start + tl.arange(0, BLOCK)
        tl.store(out + t * out_stride + slot, tl.full((BLOCK,), -1, tl.int32), mask=slot < k)


def row_topk(scores: torch.Tensor, k: int, out: torch.Tensor, first_counts: torch.Tensor | None = None) -> None:
    """out[:, :k] int32 = the column of each row's k largest scores above -inf (scores fp32 [t, C], rows contiguous),
    -1 past a row's count of them. `first_counts` int32 [t, 256]: each row's `top_byte_counts`, where the scoring
    kernel counted them (skips a pass)."""
    t, columns = scores.shape
    if scores.dtype != torch.float32 or scores.stride(-1) != 1 or out.dtype != torch.int32 or out.stride(-1) != 1:
        raise ValueError(f"row top-k: scores {scores.dtype} (stride {scores.stride()}) and out {out.dtype} "
                         f"(stride {out.stride()}) must be fp32 and int32 with contiguous rows")
    if out.shape[0] != t or out.shape[1] < k:
        raise ValueError(f"row top-k: out {tuple(out.shape)} has no room for {t} rows of {k}")
    if first_counts is not None and (first_counts.shape != (t, BINS) or first_counts.dtype != torch.int32
                                     or first_counts.stride(-1) != 1 or first_counts.device != scores.device):
        raise ValueError(f"row top-k: first_counts {tuple(first_counts.shape)} {first_counts.dtype} (stride "
                         f"{first_counts.stride()}, {first_counts.device}) is not int32 [{t}, {BINS}] with "
                         f"contiguous rows on {scores.device}")
    if t == 0 or k == 0:
        return
    counts = first_counts if first_counts is not None else out  # an unread pointer where no counts come
    _row_topk_kernel[(t,)](scores, counts, out, columns, k, scores.stride(0), counts.stride(0), out.stride(0),
                           HAS_COUNTS=first_counts is not None, BLOCK=COLUMNS_PER_STEP)


def top_byte_counts(scores: torch.Tensor) -> torch.Tensor:
    """int32 [t, 256]: each row's candidates counted by the top byte of their key (`_order_key`, `_key_digit`), in
    torch: what the scoring kernel's `counts` must hold (tests and gpu_check compare them)."""
    bits = scores.contiguous().view(torch.int32)
    bits = torch.where(scores == 0, 0, bits)
    key = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    byte = ((key >> 24) & 0xFF) ^ 0x80
    counts = torch.zeros(scores.shape[0], BINS, dtype=torch.int32, device=scores.device)
    return counts.scatter_add_(1, byte.long(), (scores > float("-inf")).to(torch.int32))
