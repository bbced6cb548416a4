"""Mixture of Experts: fp32 sigmoid router with correction bias and group-limited top-k, plus shared experts."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch
import torch.nn.functional as F
from torch import nn

from dsaserve import triton_ops
from dsaserve.config import ModelConfig
from dsaserve.distributed.parallel_context import ParallelContext
from dsaserve.model.decode_plan import NewRegister, Piece
from dsaserve.model.layers import GatedMLP, GatedMlpBinding, one_operator, swiglu
from dsaserve.model.linear import expert_weight, linear
from dsaserve.prepared_calls import PreparedCalls
from dsaserve.quantization.packed_experts import add_routed_experts, fused_applies
from dsaserve.quantization.quantized_weight import KERNEL_ROWS, QuantizedWeight, row_layout


@dataclass(frozen=True)
class RouterBinding:
    """The router's native arguments (native/moe_route.cpp), its tensors in fp32."""

    weight: torch.Tensor
    bias: torch.Tensor
    top_k: int
    n_group: int
    topk_group: int
    normalize: bool
    scaling: float

    @cached_property
    def native_args(self) -> tuple:
        return self.weight, self.bias, self.top_k, self.n_group, self.topk_group, self.normalize, self.scaling


@dataclass(frozen=True)
class MoEBinding:
    """A MoE layer in one native chain: the router, then every chosen expert and the shared experts (moe_experts)."""

    router: RouterBinding
    experts: GatedMlpBinding  # the stacked experts' gate|up and down
    shared: GatedMlpBinding | None

    @cached_property
    def native_args(self) -> tuple:
        shared = self.shared.native_args if self.shared is not None else (None, None, [], None, None, [])
        return *self.router.native_args, *self.experts.native_args, *shared


class Router(PreparedCalls):
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
        native = self.prepared("route", self.binding)
        trains = torch.is_grad_enabled() and self.weight.requires_grad  # the operator has no backward
        if native is not None and x.shape[0] <= KERNEL_ROWS and one_operator(x) and not trains:  # (prefill: the GEMM)
            return torch.ops.dsaserve.moe_route.default(x, *native.native_args)
        scores = F.linear(x.float(), self.weight.float()).sigmoid()  # (a GEMM: many tokens, or no operators)
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

    def binding(self) -> RouterBinding | None:
        """moe_route's arguments after x, or None unless the router's tensors are fp32 as the operator takes them."""
        if not self.weight.dtype == self.e_score_correction_bias.dtype == torch.float32:
            return None
        return RouterBinding(self.weight, self.e_score_correction_bias, self.top_k, self.n_group, self.topk_group,
                             self.norm_topk_prob, self.scaling)


class MoE(PreparedCalls):
    QUANTIZABLE = ("experts_gate_up", "experts_down")

    """Routed experts plus shared experts. With tensor parallelism each rank holds its share of every
    expert's intermediate dimension; with expert parallelism it holds whole experts [first, first + n)
    and runs only the tokens routed to them. Either way the router runs on every rank (replicated), and
    one all-reduce sums the ranks' partial outputs: the combine of the dispatch, since every rank already
    has every token."""

    def __init__(self, cfg: ModelConfig, parallel: ParallelContext | None = None, swiglu_limit: float | None = None):
        super().__init__()
        parallel = parallel or ParallelContext.single()
        self.swiglu_limit = swiglu_limit  # clamps every expert's gate and up (GLM-5.3-Flash)
        plan = parallel.plan
        self.comm = parallel.tp
        hidden = cfg.hidden_size
        self.first_expert, last = plan.local_experts(cfg.n_routed_experts)
        inter = cfg.moe_intermediate_size if parallel.expert_parallel else plan.local(cfg.moe_intermediate_size)
        self.gate = Router(cfg)
        self.inter = inter
        # Per-expert checkpoint tensors are stacked here at load time: gate|up fused, then down.
        self.experts_gate_up = nn.Parameter(torch.empty(last - self.first_expert, 2 * inter, hidden))
        self.experts_down = nn.Parameter(torch.empty(last - self.first_expert, hidden, inter))
        shared = cfg.moe_intermediate_size * cfg.n_shared_experts
        self.shared_experts = (GatedMLP(hidden, plan.local(shared), first_column=plan.split(shared)[0],
                                        swiglu_limit=swiglu_limit)
                               if shared else None)  # summed below, with the routed experts
        # experts_down's first column in the full expert (its input is this rank's share of the intermediate).
        self.column_offsets = {"experts_down": 0 if parallel.expert_parallel else plan.rank * inter}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, gate_up, down, shared, shared_weights, elsewhere = self.prepared("parts", self._parts)
        weights, ids = gate(x)
        if fused_applies(x, gate_up, down):  # a few tokens: one native call
            if elsewhere:
                local = ids - self.first_expert
                ids = torch.where((local >= 0) & (local < gate_up.shape[0]), local, -1)
            in_call = (shared is not None and fused_applies(x, *shared_weights)
                       and shared_weights[0].kind == gate_up.kind)
            out = torch.empty_like(x) if in_call else self._shared_output(x)  # in_call: written first, in the call
            add_routed_experts(x, gate_up, down, ids, weights, out, shared if in_call else None, self.swiglu_limit)
            return self.comm.all_reduce(out)
        out = self._shared_output(x)
        if triton_ops.runs_on(x) and (isinstance(gate_up, torch.Tensor) or row_layout(gate_up) and row_layout(down)
                                      and gate_up.kind == down.kind):
            from dsaserve.triton_ops.moe import routed_experts  # grouped GEMMs, no host sync (the CUDA path)

            if isinstance(gate_up, torch.Tensor):
                routed = routed_experts(x, ids, weights, gate_up, down, self.first_expert, self.swiglu_limit)
            else:  # quantized experts in their stored form
                routed = routed_experts(x, ids, weights, gate_up.qweight, down.qweight, self.first_expert,
                                        self.swiglu_limit, (gate_up.scale, down.scale), down.col_offset, gate_up.kind)
            return self.comm.all_reduce(out + routed.to(out.dtype))
        flat_ids = ids.flatten()
        order = flat_ids.argsort(stable=True)
        counts = torch.bincount(flat_ids, minlength=self.gate.weight.shape[0]).tolist()
        token_of = order // ids.shape[1]
        weight_of = weights.flatten()[order]
        start = sum(counts[: self.first_expert])
        for local, count in enumerate(counts[self.first_expert : self.first_expert + self.experts_gate_up.shape[0]]):
            if count == 0:
                continue
            tokens = token_of[start : start + count]
            gate, up = linear(x[tokens], expert_weight(self.experts_gate_up, local)).split(self.inter, dim=-1)
            y = linear(swiglu(gate, up, self.swiglu_limit), expert_weight(self.experts_down, local))
            out.index_add_(0, tokens, (y * weight_of[start : start + count, None]).to(out.dtype))
            start += count
        return self.comm.all_reduce(out)

    def decode_pieces(self, reads: tuple[int, ...], new: NewRegister) -> tuple[list[Piece], object] | None:
        """forward() as one native piece (model/decode_plan.py), where the router is fp32, every expert here and
        all weights packed in one kind; None otherwise (the layer then runs through its modules)."""
        gate, gate_up, down, shared, shared_weights, elsewhere = self.prepared("parts", self._parts)
        router = gate.binding()
        if router is None or elsewhere or self.comm.size != 1 or self.swiglu_limit is not None:
            return None
        weights = (gate_up, down, *(shared_weights or ()))
        if not all(isinstance(w, QuantizedWeight) and w.kind == gate_up.kind and w.col_offset == 0 for w in weights):
            return None
        shared_binding = shared.binding() if shared is not None else None
        out = new()
        return [Piece("moe", MoEBinding(router, GatedMlpBinding(gate_up, down), shared_binding), reads, (out,))], out

    def _parts(self):
        """(router, experts' gate|up and down, shared experts and their two weights (or None), whether some
        experts are held elsewhere): what forward reads on every call."""
        shared = self.shared_experts
        shared_weights = (shared.gate_up_proj, shared.down_proj.weight) if shared is not None else None
        elsewhere = bool(self.first_expert) or self.experts_gate_up.shape[0] < self.gate.weight.shape[0]
        return self.gate, self.experts_gate_up, self.experts_down, shared, shared_weights, elsewhere

    def _shared_output(self, x: torch.Tensor) -> torch.Tensor:
        """The shared experts' output, or zeros without any: what the routed experts add into."""
        return self.shared_experts(x) if self.shared_experts is not None else torch.zeros_like(x)
