"""ParallelConfig: how many ranks, how they split the model, and where they meet; checked against the model.

Tensor parallelism (TP) is the world: every rank holds 1/TP of the attention heads, of the dense MLP and
(by default) of every expert's intermediate dimension, and 1/TP of the vocabulary. With expert
parallelism (EP) whole routed experts are placed on ranks instead. Decode context parallelism (DCP)
works within the TP group, as in vLLM: consecutive groups of DCP ranks each hold one copy of the KV cache,
split along the sequence (token p lives on group member p mod DCP), so the world size stays TP.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

from dsaserve.config import ModelConfig


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int = 1
    enable_expert_parallel: bool = False
    decode_context_parallel_size: int = 1
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int | None = None  # None: a free port, on one node
    dist_timeout: float = 600.0  # seconds a collective may wait for the other ranks
    check_ranks: bool = False  # ranks compare every full layer's top-k (a debugging check)

    def __post_init__(self) -> None:
        tp, dcp = self.tensor_parallel_size, self.decode_context_parallel_size
        if tp < 1:
            raise ValueError(f"tensor_parallel_size={tp} must be at least 1")
        if dcp < 1 or tp % dcp:
            raise ValueError(f"decode_context_parallel_size={dcp} must divide tensor_parallel_size={tp} "
                             "(DCP shards the KV cache within the TP group, as in vLLM)")
        if self.enable_expert_parallel and tp == 1:
            raise ValueError("enable_expert_parallel needs tensor_parallel_size > 1: "
                             "experts are placed on the TP ranks")
        if self.nnodes < 1 or tp % self.nnodes:
            raise ValueError(f"nnodes={self.nnodes} must divide tensor_parallel_size={tp} (the same number of ranks "
                             "on every node)")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank={self.node_rank} must be in [0, nnodes={self.nnodes})")
        if not self.dist_timeout > 0:
            raise ValueError(f"dist_timeout={self.dist_timeout} must be a positive number of seconds")
        if self.nnodes > 1 and self.master_port is None:
            raise ValueError("several nodes need --master-port (and --master-addr, node 0's address) on every node")

    @property
    def collective_timeout(self) -> timedelta:
        return timedelta(seconds=self.dist_timeout)

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def ranks_per_node(self) -> int:
        return self.world_size // self.nnodes

    def node_ranks(self, node: int | None = None) -> range:
        """The global ranks that run on a node (this one by default); node 0 holds rank 0, the driver."""
        node = self.node_rank if node is None else node
        return range(node * self.ranks_per_node, (node + 1) * self.ranks_per_node)

    def dcp_group_of(self, rank: int) -> range:
        """The ranks that share one copy of the KV cache with `rank` (consecutive TP ranks)."""
        dcp = self.decode_context_parallel_size
        first = rank // dcp * dcp
        return range(first, first + dcp)

    def check_model(self, cfg: ModelConfig, attention_backend: str) -> None:
        """Raise naming the field when the model cannot be split this way."""
        tp = self.tensor_parallel_size
        if tp == 1:
            return
        checks = [("num_attention_heads", cfg.num_attention_heads, "attention heads are split across ranks")]
        if "dense" in cfg.mlp_layer_types:
            checks.append(("intermediate_size", cfg.intermediate_size, "the dense MLP is split across ranks"))
        if self.enable_expert_parallel:
            checks.append(("n_routed_experts", cfg.n_routed_experts, "whole experts are placed on ranks"))
        else:
            checks.append(("moe_intermediate_size", cfg.moe_intermediate_size, "each expert is split across ranks"))
        if cfg.hybrid is not None:
            checks.append(("linear_attn_config.num_heads", cfg.hybrid.linear_num_heads,
                           "KDA heads are split across ranks"))
        if cfg.n_shared_experts:
            checks.append(("moe_intermediate_size × n_shared_experts", cfg.moe_intermediate_size * cfg.n_shared_experts,
                           "the shared experts are split across ranks"))
        for name, value, why in checks:
            if value % tp:
                raise ValueError(f"tensor_parallel_size={tp} does not divide the model's {name}={value} ({why}); "
                                 f"choose a tensor_parallel_size that divides it")
        if self.decode_context_parallel_size > 1 and cfg.hybrid is not None:
            raise ValueError(f"decode_context_parallel_size={self.decode_context_parallel_size}: {cfg.family.name} "
                             "does not split its context across ranks yet (its KDA state is per request); set it to 1")
        if self.decode_context_parallel_size > 1 and attention_backend == "page":
            raise ValueError("attention_backend='page' does not support decode_context_parallel_size > 1; "
                             "use 'sparse' or 'dense'")
