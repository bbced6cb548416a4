"""The demo model in training: the serving model itself (GlmMoeDsaForCausalLM, fp32, unpacked) run over padded
[batch, seq] tensors by model/training_pass.py, with checkpoint-named initial weights and checkpoint output.

Besides the logits, a forward returns what DSA training needs: each indexer's scores and the attention
probabilities of the layers that use its selection, the tokens each router sent to each expert (for its
correction bias), and chosen heads' attention. `sparse` restricts every attention to the indexer's top-k (the
serving path); otherwise attention is dense. The indexer sees its inputs detached, so only its KL loss trains it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import nn

from dsaserve.config import ModelConfig
from dsaserve.model.checkpoint_layout import checkpoint_shapes
from dsaserve.model.glm_moe_dsa import GlmMoeDsaForCausalLM, checkpoint_tensor, param_of
from dsaserve.model.moe import Router
from dsaserve.model.training_pass import IndexerTrace, TrainingPass

__all__ = ["ForwardOutput", "IndexerTrace", "TrainableGlmMoeDsa", "TrainingPass"]


@dataclass
class ForwardOutput:
    logits: torch.Tensor  # [B, S, vocab]
    mtp_logits: torch.Tensor | None  # [B, S, vocab]: position i predicts token i + 2
    final_hidden: torch.Tensor  # [B, S, hidden]: after the final norm (the MTP layer's h_0)
    traces: list[IndexerTrace]
    expert_counts: dict[str, torch.Tensor]  # correction bias (model parameter name) → tokens per expert
    head_attention: dict[tuple[str, int], torch.Tensor] = field(default_factory=dict)  # watched head → [B, S, T]


def init_weight(name: str, shape: tuple[int, ...], gen: torch.Generator, n_layers: int,
                shared_embedding: bool = False) -> torch.Tensor:
    if "norm" in name and name.endswith(".weight"):
        return torch.ones(shape)
    if name.endswith(("k_norm.bias", "e_score_correction_bias")):
        return torch.zeros(shape)
    if name.endswith("embed_tokens.weight"):
        rows = torch.randn(shape, generator=gen)
        # shared_embedding: every row also shares one random direction, so rotary queries and keys have a part
        # that does not depend on the token and position-only heads (attend to the previous token) can form
        # from the first steps; from independent rows alone they took hundreds (benchmarks/induction_probe.py).
        return rows + torch.randn(shape[-1], generator=gen) if shared_embedding else rows
    std = shape[-1] ** -0.5
    if name.endswith(("o_proj.weight", "down_proj.weight")):
        std /= math.sqrt(2 * n_layers)  # residual branches start small
    return torch.randn(shape, generator=gen) * std


class TrainableGlmMoeDsa(nn.Module):
    def __init__(self, cfg: ModelConfig, seed: int = 0, include_mtp: bool = True, shared_embedding: bool = False):
        super().__init__()
        self.cfg = cfg
        self.net = GlmMoeDsaForCausalLM(cfg, "sparse", mtp=(False, False) if include_mtp else None, decode_plan=False)
        self.net.train()
        gen = torch.Generator().manual_seed(seed)
        shapes = checkpoint_shapes(cfg, include_mtp=include_mtp)
        self.names = list(shapes)
        load = self.net.weight_loader()
        for name, shape in shapes.items():
            load(name, init_weight(name, shape, gen, cfg.num_hidden_layers, shared_embedding))
        for name, param in self.net.named_parameters():
            param.requires_grad_(not name.endswith("e_score_correction_bias"))
        self._counts: dict[str, torch.Tensor] = {}
        for name, module in self.net.named_modules():
            if isinstance(module, Router):
                module.register_forward_hook(self._count_hook(f"{name}.e_score_correction_bias"))

    def _count_hook(self, bias: str):
        def count(module: Router, inputs, output) -> None:
            self._counts[bias] = torch.bincount(output[1].flatten(), minlength=module.weight.shape[0])
        return count

    def w(self, name: str) -> nn.Parameter:
        """The parameter checkpoint tensor `name` loads into, where it is one (not a fused or split one)."""
        return self.net.get_parameter(param_of(name, self.cfg.num_hidden_layers))

    def state_dict_for_checkpoint(self) -> dict[str, torch.Tensor]:
        params = dict(self.net.named_parameters(remove_duplicate=False))
        return {n: checkpoint_tensor(params, n, self.cfg.num_hidden_layers).detach().clone().contiguous()
                for n in self.names}

    def forward(self, ids: torch.Tensor, sparse: bool, with_mtp: bool = True,
                watch_heads: list[tuple[str, int]] | None = None) -> ForwardOutput:
        """with_mtp=False skips the MTP layer (mtp_logits None), for a frozen target's pass; watch_heads names
        heads whose attention probabilities come back (with gradients) in head_attention."""
        net, (b, s) = self.net, ids.shape
        self._counts = {}
        batch = TrainingPass.of(ids, sparse, watch=tuple(watch_heads or ()))
        hidden = net.model.norm(net.hidden_states(batch, [None] * self.cfg.num_hidden_layers, {}))
        logits = net.lm_head(hidden).view(b, s, -1)
        mtp_logits = None
        if net.mtp is not None and with_mtp:
            nxt = torch.cat([ids[:, 1:], ids[:, -1:]], dim=1)  # row i reads token i + 1 (the last row is unused)
            h, _ = net.mtp(net.model.embed_tokens, net.rotary, TrainingPass.of(nxt, sparse, traces=batch.traces),
                           hidden, None, None)
            mtp_logits = net.mtp.logits(net.lm_head, h).view(b, s, -1)
        return ForwardOutput(logits, mtp_logits, hidden.view(b, s, -1), batch.traces, self._counts,
                             batch.head_attention)
