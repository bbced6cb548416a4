"""Helpers that run the transformers reference (the numerical oracle) and dsaserve side by side."""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial

import torch

from dsaserve.attention.metadata import BatchMetadata
from dsaserve.config import ModelConfig
from dsaserve.engine.workers.kv_cache import KVCache
from dsaserve.model import load_model


def load_reference(model_dir: str, **config_overrides):
    """The transformers class of the checkpoint's family (GlmMoeDsaForCausalLM, DeepseekV32ForCausalLM), fp32."""
    import transformers

    architecture = ModelConfig.from_pretrained(model_dir).family.architecture
    return getattr(transformers, architecture).from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager", **config_overrides
    ).eval()


@dataclass
class ForwardResult:
    logprobs: torch.Tensor  # [L, V]
    topk: dict[int, list[set[int]]]  # full layer → per position, the selected visible positions


@contextmanager
def indexer_hooks(model, hook):
    """While open, every indexer's forward calls hook(layer_idx, module, args, kwargs, output); the
    reference's and dsaserve's models both name it `model.layers[i].self_attn.indexer`."""
    hooks = [
        layer.self_attn.indexer.register_forward_hook(partial(hook, i), with_kwargs=True)
        for i, layer in enumerate(model.model.layers)
        if layer.self_attn.indexer is not None
    ]
    try:
        yield
    finally:
        for h in hooks:
            h.remove()


def reference_forward(ref, ids: list[int]) -> ForwardResult:
    captured = {}
    with indexer_hooks(ref, lambda i, m, args, kwargs, out: captured.__setitem__(i, out[0])), torch.no_grad():
        logits = ref(torch.tensor([ids])).logits[0].float()
    topk = {i: [{p for p in row.tolist() if p <= t} for t, row in enumerate(idx)] for i, idx in captured.items()}
    return ForwardResult(logits.log_softmax(-1), topk)


def reference_greedy(ref, ids: list[int], steps: int) -> list[int]:
    """Greedy continuation by full recomputation: the plainest possible oracle."""
    ids = list(ids)
    out = []
    with torch.no_grad():
        for _ in range(steps):
            token = int(ref(torch.tensor([ids])).logits[0, -1].argmax())
            out.append(token)
            ids.append(token)
    return out


def reference_index_scores(ref, ids: list[int]) -> dict[int, torch.Tensor]:
    """Each full layer's indexer scores [S, S] (before the causal mask), recomputed from the hook's inputs."""
    from transformers.models.deepseek_v32.modeling_deepseek_v32 import apply_rotary_pos_emb
    from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import apply_rotary_pos_emb_interleave

    rotate = apply_rotary_pos_emb if ref.config.model_type == "deepseek_v32" else apply_rotary_pos_emb_interleave
    out = {}

    def hook(layer, module, args, kwargs, _):
        hidden, q_resid, (cos, sin) = args[0], args[1], args[2]
        b, s, _ = hidden.shape
        q = module.wq_b(q_resid).view(b, s, module.n_heads, module.head_dim)
        k = module.k_norm(module.wk(hidden)).unsqueeze(2)
        r = module.qk_rope_head_dim
        q_rot, k_rot = rotate(q[..., :r], k[..., :r], cos, sin, unsqueeze_dim=2)
        q = torch.cat([q_rot, q[..., r:]], -1)
        k = torch.cat([k_rot, k[..., r:]], -1).squeeze(2)
        scores = torch.relu(q.float() @ k.transpose(-1, -2).float().unsqueeze(1)) * module.softmax_scale
        w = module.weights_proj(hidden.float()).float() * module.n_heads**-0.5
        out[layer] = (w.unsqueeze(-2) @ scores).squeeze(-2)[0]

    with indexer_hooks(ref, hook), torch.no_grad():
        ref(torch.tensor([ids]))
    return out


def indexer_margin(ref, ids: list[int]) -> float:
    """Smallest relative gap, over full layers and queries with more visible tokens than index_topk,
    between the k-th and (k+1)-th indexer score. Tiny margins make top-k comparisons meaningless."""
    k = ref.config.index_topk
    margins = []
    for index in reference_index_scores(ref, ids).values():
        for t in range(k, index.shape[0]):
            top = index[t, : t + 1].topk(k + 1).values
            margins.append(float((top[-2] - top[-1]) / (top.abs().max() + 1e-12)))
    return min(margins) if margins else float("inf")


def untied_topk_mismatch(ours: ForwardResult, ref: ForwardResult, scores: dict[int, torch.Tensor], k: int
                         ) -> str | None:
    """Like first_topk_mismatch, except that selections may differ among tokens tied at the k-th score
    (which of them a top-k keeps is the implementation's choice), ties counted within fp32 rounding: scores
    within 1e-5 of the row's largest magnitude of the boundary, which two correct summation orders can rank
    either way (a trained indexer met one 1.4e-6 apart)."""
    for layer in sorted(ref.topk):
        for t, (a, b) in enumerate(zip(ours.topk[layer], ref.topk[layer])):
            if a == b:
                continue
            row = scores[layer][t, : t + 1]
            boundary = row.topk(k).values[-1]
            rounding = 1e-5 * row.abs().max()
            if any((row[p] - boundary).abs() > rounding for p in a ^ b):
                return (f"layer {layer} position {t}: only dsaserve {sorted(a - b)[:5]}, "
                        f"only reference {sorted(b - a)[:5]}")
    return None


def dsaserve_forward(model_dir: str, ids: list[int], attention_backend: str = "sparse", block_size: int = 16,
                     hf_overrides=None) -> ForwardResult:
    """One prefill through dsaserve's paged path, with a scrambled block table."""
    cfg = ModelConfig.from_pretrained(model_dir, hf_overrides=hf_overrides)
    model = load_model(cfg, model_dir, torch.float32, torch.device("cpu"), attention_backend, progress=False)
    nblocks = -(-len(ids) // block_size)
    cache = KVCache(cfg, 2 * nblocks + 1, block_size, torch.float32, torch.device("cpu"))
    table = list(range(2 * nblocks, 0, -2))  # physical order unrelated to logical order
    meta = BatchMetadata.build([ids], [0], [table], block_size, list(range(len(ids))))
    # The indexers' outputs are the top-k each full layer produces (shared layers reuse it; the dense
    # backend runs no indexer).
    captured = {}
    with indexer_hooks(model, lambda i, m, args, kwargs, out: captured.__setitem__(i, out.clone())):
        logits = model.compute_logits(model(meta, cache.latent, cache.indexer))
    topk = {i: [{p for p in row.tolist() if p >= 0} for row in t] for i, t in captured.items()}
    return ForwardResult(logits.log_softmax(-1), topk)


def first_topk_mismatch(ours: ForwardResult, ref: ForwardResult) -> str | None:
    if set(ours.topk) != set(ref.topk):
        return f"full layers differ: dsaserve {sorted(ours.topk)} vs reference {sorted(ref.topk)}"
    for layer in sorted(ref.topk):
        for t, (a, b) in enumerate(zip(ours.topk[layer], ref.topk[layer])):
            if a != b:
                return (f"layer {layer} position {t}: only dsaserve {sorted(a - b)[:5]}, "
                        f"only reference {sorted(b - a)[:5]}")
    return None


def softmax_over_rows(query, rows, slots, scale, value):
    """Attention of each query row over the cache rows at its slots (-1: none; a query with none gets zeros), the
    value columns [:value] averaged, in fp32: what the sparse MLA kernels compute."""
    keys = rows[slots.clamp(min=0)].float()  # [n, K, D]
    scores = torch.einsum("nhd,nkd->nhk", query.float(), keys) * scale
    weights = scores.masked_fill((slots < 0)[:, None, :], float("-inf")).softmax(-1).nan_to_num()
    return torch.einsum("nhk,nkv->nhv", weights, keys[..., :value])
