"""Mixture of Experts: fp32 sigmoid router with correction bias and group-limited top-k, plus shared experts."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dsaserve.config import ModelConfig
from dsaserve.model.layers import GatedMLP


class Router(nn.Module):
    """Chooses experts with `sigmoid(x·Wᵀ) + e_score_correction_bias`; weights are the plain sigmoid scores."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(cfg.n_routed_experts, cfg.hidden_size))  # kept in fp32
        self.e_score_correction_bias = nn.Parameter(torch.zeros(cfg.n_routed_experts))  # kept in fp32
        self.top_k = cfg.num_experts_per_tok
        self.n_group = cfg.n_group
        self.topk_group = cfg.topk_group
        self.norm_topk_prob = cfg.norm_topk_prob
        self.scaling = cfg.routed_scaling_factor

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, hidden] → (weights fp32 [T, top_k], expert ids int64 [T, top_k])."""
        scores = F.linear(x.float(), self.weight.float()).sigmoid()
        choice = scores + self.e_score_correction_bias.float()
        if self.n_group > 1:
            grouped = choice.view(x.shape[0], self.n_group, -1)
            group_scores = grouped.topk(2, dim=-1).values.sum(-1)
            keep = torch.zeros_like(group_scores, dtype=torch.bool)
            keep.scatter_(1, group_scores.topk(self.topk_group, dim=-1).indices, True)
            choice = grouped.masked_fill(~keep[..., None], float("-inf")).view(x.shape[0], -1)
        ids = choice.topk(self.top_k, dim=-1).indices
        weights = scores.gather(1, ids)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return weights * self.scaling, ids


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        n, hidden, inter = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.gate = Router(cfg)
        self.inter = inter
        # Per-expert checkpoint tensors are stacked here at load time: gate|up fused, then down.
        self.experts_gate_up = nn.Parameter(torch.empty(n, 2 * inter, hidden))
        self.experts_down = nn.Parameter(torch.empty(n, hidden, inter))
        shared = cfg.moe_intermediate_size * cfg.n_shared_experts
        self.shared_experts = GatedMLP(hidden, shared) if shared else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        out = self.shared_experts(x) if self.shared_experts is not None else torch.zeros_like(x)
        flat_ids = ids.flatten()
        order = flat_ids.argsort(stable=True)
        counts = torch.bincount(flat_ids, minlength=self.experts_gate_up.shape[0]).tolist()
        token_of = order // ids.shape[1]
        weight_of = weights.flatten()[order]
        start = 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            tokens = token_of[start : start + count]
            gate, up = F.linear(x[tokens], self.experts_gate_up[expert]).split(self.inter, dim=-1)
            y = F.linear(F.silu(gate) * up, self.experts_down[expert])
            out.index_add_(0, tokens, (y * weight_of[start : start + count, None]).to(out.dtype))
            start += count
        return out
