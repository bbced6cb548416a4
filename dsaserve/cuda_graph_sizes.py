"""Which decode steps CUDA graphs are captured for (engine/workers/decode_graphs.py): the batch sizes
(`cuda_graph_sizes`) and the context buckets, the widths of the indexer's scoring that the captures take."""

from __future__ import annotations

DEFAULT_LARGEST = 256
SMALLEST_BUCKET = 4096  # tokens of context the smallest captured scoring width covers


def capture_sizes(requested: tuple[int, ...] | None, max_num_seqs: int) -> tuple[int, ...]:
    """The batch sizes to capture: as requested, else powers of two up to max_num_seqs (at most 256) and that bound
    itself."""
    if requested is not None:
        return tuple(sorted(set(requested)))
    largest = min(max_num_seqs, DEFAULT_LARGEST)
    sizes = {1 << i for i in range(largest.bit_length()) if 1 << i <= largest}
    return tuple(sorted(sizes | {largest}))


def context_buckets(max_model_len: int) -> tuple[int, ...]:
    """The scoring widths captured: SMALLEST_BUCKET × 4^i below max_model_len, and max_model_len."""
    buckets, width = [], SMALLEST_BUCKET
    while width < max_model_len:
        buckets.append(width)
        width *= 4
    return tuple(buckets) + (max_model_len,)


def parse_sizes(value: str | list[int] | tuple[int, ...] | None) -> tuple[int, ...] | None:
    """`cuda_graph_sizes` as given ("1,2,4,8" or a list) → sizes; a bad entry is a ValueError naming it."""
    if value is None:
        return None
    items = value.split(",") if isinstance(value, str) else list(value)
    try:
        sizes = tuple(int(str(item).strip()) for item in items if str(item).strip())
    except ValueError:
        raise ValueError(f"cuda_graph_sizes={value!r} must be batch sizes, e.g. '1,2,4,8'") from None
    if not sizes or min(sizes) < 1:
        raise ValueError(f"cuda_graph_sizes={value!r} must be positive batch sizes, e.g. '1,2,4,8'")
    return sizes
