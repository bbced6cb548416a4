"""Attention backends over the paged latent cache, selected by `attention_backend`."""

from dsaserve.attention.dense import DenseAttention
from dsaserve.attention.metadata import BatchMetadata
from dsaserve.attention.sparse import SparseAttention

ATTENTION_BACKENDS = ("sparse", "dense")


def make_attention_backend(name: str, index_topk: int):
    if name == "sparse":
        return SparseAttention(index_topk)
    if name == "dense":
        return DenseAttention()
    raise ValueError(
        f"attention_backend={name!r} is not supported; choose one of {', '.join(ATTENTION_BACKENDS)} "
        "('sparse' is the model's trained semantics, 'dense' attends to every causal token)"
    )


__all__ = ["ATTENTION_BACKENDS", "BatchMetadata", "DenseAttention", "SparseAttention", "make_attention_backend"]
