"""The multi-token-prediction (MTP) layer: checkpoint layer `num_hidden_layers`, which drafts the token after next.

    e   = enorm(embed(t))                       (zero at position 0, as vLLM does)
    h_k = block(eh_proj(cat[e, hnorm(h_{k-1})]))
    logits = head(shared_head.norm(h_k))

`block` is a full decoder layer (MLA with its own indexer, MoE; a plain residual, also on glm5_next whose main
layers carry mHC streams) with its own latent and indexer-key cache. h_0 is the target's hidden state at the same
position after its final norm (the model's output, which is what vLLM feeds its MTP layers); a draft round then
feeds the MTP layer's own output back: before shared_head.norm on GLM-5.2 and DeepSeek-V3.2, after it on glm5_next
(`normed_output`, as vLLM's GLM-5.3-Flash MTP recycles it). `embed` and `head` are the main model's unless the
checkpoint carries the layer's own `embed_tokens` / `shared_head.head`.

A model that drafts inherits `Drafting`: the three calls engine/speculative/mtp_drafter.py makes.
"""

from __future__ import annotations

import torch
from torch import nn

from dsaserve.attention.metadata import BatchMetadata
from dsaserve.config import ModelConfig
from dsaserve.distributed.parallel_context import ParallelContext
from dsaserve.model.decode_plan import DecodePlan
from dsaserve.model.layers import RMSNorm
from dsaserve.model.linear import Linear
from dsaserve.model.parallel_layers import ParallelLMHead, VocabParallelEmbedding
from dsaserve.prepared_calls import PreparedCalls


class MTPLayer(PreparedCalls):
    def __init__(self, cfg: ModelConfig, block: nn.Module, own_head: bool = False, own_embed: bool = False,
                 parallel: ParallelContext | None = None, decode_plan: bool = True, normed_output: bool = False):
        """block: a full MoE decoder layer at index num_hidden_layers; decode_plan: a few tokens run as its native
        pieces where it has them (model/decode_plan.py); normed_output: forward returns the hidden state after
        shared_head.norm (what is fed back and what the head reads)."""
        super().__init__()
        self.decode_plan = decode_plan
        self.normed_output = normed_output
        parallel = parallel or ParallelContext.single()
        h = cfg.hidden_size
        self.layer_idx = cfg.num_hidden_layers
        self.enorm = RMSNorm(h, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(h, cfg.rms_norm_eps)
        self.eh_proj = Linear(2 * h, h, bias=False)
        self.block = block
        self.head_norm = RMSNorm(h, cfg.rms_norm_eps)  # shared_head.norm
        self.head = (ParallelLMHead(cfg.vocab_size, h, parallel.plan, parallel.tp) if own_head
                     else None)  # shared_head.head
        self.embed = VocabParallelEmbedding(cfg.vocab_size, h, parallel.plan, parallel.tp) if own_embed else None

    def forward(self, embed: nn.Module, rotary, meta: BatchMetadata, prev_hidden: torch.Tensor,
                kv_cache: torch.Tensor, indexer_cache, topk: torch.Tensor | None = None):
        """meta: the rows to run (input ids = the next tokens); prev_hidden [T, hidden]. With `topk`, the
        indexer does not run and attention uses it. Returns (hidden before the head norm, or after it with
        normed_output; the top-k used)."""
        x = self.block_input(embed, meta, prev_hidden)
        cos, sin = rotary.cos_sin(meta.positions, x.dtype, max(meta.seq_lens_host))
        plan = self.prepared("decode plan", self._plan)
        out = (plan.run(x, cos, sin, meta, [kv_cache], {0: indexer_cache}, topk, need_topk=True)
               if plan is not None else None)
        if out is None:
            out = self.block(x, cos, sin, meta, kv_cache, indexer_cache, topk, run_indexer=topk is None)
        return (self.head_norm(out[0]), out[1]) if self.normed_output else out

    def _plan(self) -> DecodePlan | None:
        return DecodePlan.build([self.block]) if self.decode_plan else None

    def fill_caches(self, embed: nn.Module, rotary, meta: BatchMetadata, prev_hidden: torch.Tensor,
                    kv_cache: torch.Tensor, indexer_cache) -> None:
        """The block's cache entries for meta's rows, as forward() writes them, without its attention and
        MoE: for the rows only later rows attend to."""
        x = self.block_input(embed, meta, prev_hidden)
        cos, sin = rotary.cos_sin(meta.positions, x.dtype, max(meta.seq_lens_host))
        self.block.self_attn.write_caches(self.block.input_layernorm(x), cos, sin, meta, kv_cache, indexer_cache)

    def block_input(self, embed: nn.Module, meta: BatchMetadata, prev_hidden: torch.Tensor) -> torch.Tensor:
        """eh_proj(cat[enorm(embed(t)), hnorm(h)]) of meta's rows."""
        e = (self.embed or embed)(meta.input_ids, prev_hidden.dtype)
        e = e.masked_fill((meta.positions == 0)[:, None], 0)
        return self.eh_proj(torch.cat([self.enorm(e), self.hnorm(prev_hidden.to(e.dtype))], dim=-1))

    def logits(self, lm_head: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        return (self.head or lm_head)(hidden if self.normed_output else self.head_norm(hidden)).float()


class Drafting:
    """What the MTP drafter calls on a model with an `mtp` layer, `config`, `model.embed_tokens`, `rotary` and
    `lm_head`; the MTP layer's caches are layer num_hidden_layers's."""

    @torch.inference_mode()
    def draft(self, meta: BatchMetadata, prev_hidden: torch.Tensor, kv_caches: list, indexer_caches: dict,
              topk: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One MTP step over meta's rows: (hidden [T, hidden], the top-k it attended with)."""
        layer = self.config.num_hidden_layers
        return self.mtp(self.model.embed_tokens, self.rotary, meta, prev_hidden, kv_caches[layer],
                        indexer_caches.get(layer), topk)

    @torch.inference_mode()
    def fill_draft_caches(self, meta: BatchMetadata, prev_hidden: torch.Tensor, kv_caches: list,
                          indexer_caches: dict) -> None:
        """The MTP layer's cache entries for meta's rows, without running the layer past them."""
        layer = self.config.num_hidden_layers
        self.mtp.fill_caches(self.model.embed_tokens, self.rotary, meta, prev_hidden, kv_caches[layer],
                             indexer_caches.get(layer))

    @torch.inference_mode()
    def draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.mtp.logits(self.lm_head, hidden)


_OWN_NAMES = {"enorm": "enorm", "hnorm": "hnorm", "eh_proj": "eh_proj", "shared_head.norm": "head_norm",
              "shared_head.head": "head", "embed_tokens": "embed"}


def mtp_param_name(checkpoint_name: str, layer_idx: int) -> str:
    """The model parameter of an MTP checkpoint tensor (`model.layers.{layer_idx}.…` → `mtp.…`)."""
    rest = checkpoint_name.removeprefix(f"model.layers.{layer_idx}.")
    for own, param in _OWN_NAMES.items():
        if rest.startswith(own + "."):
            return f"mtp.{param}{rest[len(own):]}"
    return f"mtp.block.{rest}"
