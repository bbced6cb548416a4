"""Attention backends over the paged latent cache, selected by `attention_backend`."""

from dsaserve.attention.dense import DenseAttention
from dsaserve.attention.metadata import BatchMetadata
from dsaserve.attention.sparse import SparseAttention

ATTENTION_BACKENDS = ("sparse", "dense", "page")


def make_attention_backend(name: str):
    """`sparse`: each query's top-k tokens (the model's trained semantics). `page`: the indexer ranks whole
    pages by their best visible token and attention reads every token of the chosen pages (an opt-in
    approximation). `dense`: every causal token, indexer skipped."""
    if name in ("sparse", "page"):
        return SparseAttention(name)
    if name == "dense":
        return DenseAttention()
    raise ValueError(
        f"attention_backend={name!r} is not supported; choose one of {', '.join(ATTENTION_BACKENDS)} "
        "('sparse' is the model's trained semantics, 'page' selects whole pages, 'dense' attends to every causal token)"
    )


__all__ = ["ATTENTION_BACKENDS", "BatchMetadata", "DenseAttention", "SparseAttention", "make_attention_backend"]
