"""Attention alone at GLM-5.2's real head count: dense vs sparse per decode step over a 64K cache.

    python benchmarks/attention_64heads.py [--context 65536] [--indexer-cache-dtype auto|int8|fp8]

Two MLA layers with GLM-5.2's geometry (64 heads, kv_lora_rank 512, rope 64, nope 192, v 256, indexer
32 heads × 128, index_topk 2048): layer 0 full (runs the indexer), layer 1 shared (reuses its top-k).
Random bf16 weights; the latent and indexer caches are filled with synthetic values. One decode query
at the end of the context. Two measurements per backend:
  core:  the attention over the cache for both layers, plus (sparse) the indexer's scoring and
         top-k selection on the full layer: the work sparsity changes;
  layer: the whole MLAAttention forward of both layers, projections included (the weights read for
         the q/kv/o projections, ~330 MB here, are the same for both backends).
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from dsaserve.attention import make_attention_backend
from dsaserve.attention.indexer_cache import KEY_KINDS
from dsaserve.attention.indexer_selection import Selection, select
from dsaserve.attention.metadata import BatchMetadata
from dsaserve.config import ModelConfig
from dsaserve.demo.checkpoint_builder import small_config
from dsaserve.engine.workers.kv_cache import KVCache
from dsaserve.model.layers import RotaryEmbedding
from dsaserve.model.mla import MLAAttention

BLOCK = 64


def glm52_attention_config() -> ModelConfig:
    return ModelConfig.from_dict(small_config(
        hidden_size=6144, num_hidden_layers=2, num_attention_heads=64, q_lora_rank=2048, kv_lora_rank=512,
        qk_nope_head_dim=192, qk_rope_head_dim=64, v_head_dim=256, index_topk=2048, index_head_dim=128,
        index_n_heads=32, indexer_types=["full", "shared"], max_position_embeddings=1 << 20,
        rope_parameters={"rope_theta": 8000000.0, "rope_type": "default"}))


def build_layers(cfg: ModelConfig, backend_name: str):
    torch.manual_seed(0)
    backend = make_attention_backend(backend_name)
    layers = [MLAAttention(cfg, i, backend, Selection(cfg.index_topk)) for i in range(2)]
    for layer in layers:
        for name, p in layer.named_parameters():
            with torch.no_grad():
                if name.endswith("norm.weight"):
                    p.fill_(1.0)
                elif p.dim() == 1:
                    p.zero_()
                else:
                    p.normal_(0, p.shape[-1] ** -0.5)
        layer.to(torch.bfloat16)
        if layer.indexer is not None:
            layer.indexer.weights_proj.float()
    return layers


def step_ms(cfg: ModelConfig, backend_name: str, context: int, steps: int,
            indexer_dtype: str = "model") -> tuple[float, float]:
    layers = build_layers(cfg, backend_name)
    nblocks = context // BLOCK + 2
    cache = KVCache(cfg, nblocks, BLOCK, torch.bfloat16, torch.device("cpu"), with_indexer=backend_name != "dense",
                    indexer_dtype=indexer_dtype)
    g = torch.Generator().manual_seed(1)
    for latent in cache.latent:
        latent.copy_(torch.randn(latent.shape, generator=g).to(torch.bfloat16))
    for keys in cache.indexer.values():
        keys.write(torch.arange(nblocks * BLOCK), torch.randn(nblocks * BLOCK, cfg.index_head_dim, generator=g))
    meta = BatchMetadata.build([[1]], [context], [list(range(nblocks))], BLOCK, [0])
    rotary = RotaryEmbedding(cfg.rope, cfg.qk_rope_head_dim)
    x = torch.randn(1, cfg.hidden_size, generator=g).to(torch.bfloat16)
    cos, sin = rotary.cos_sin(meta.positions, torch.bfloat16)

    def one_layer_step():
        topk = None
        for i, layer in enumerate(layers):
            _, topk = layer(x, cos, sin, meta, cache.latent[i], cache.indexer.get(i), topk)

    heads, width = cfg.num_attention_heads, cfg.kv_cache_dim
    query = torch.randn(1, heads, width, generator=g).to(torch.bfloat16)
    index_q = torch.randn(1, cfg.index_n_heads, cfg.index_head_dim, generator=g).to(torch.bfloat16)
    index_w = torch.rand(1, cfg.index_n_heads, generator=g)
    backend, scale = layers[0].backend, layers[0].scale

    def one_core_step():
        topk = None
        if backend.uses_indexer:
            topk = select(index_q, index_w, cache.indexer[0], meta, Selection(cfg.index_topk))
        for i in range(2):
            backend.forward(query, cache.latent[i], meta, scale, cfg.kv_lora_rank, topk)

    def timed(fn) -> float:
        fn()
        start = time.perf_counter()
        for _ in range(steps):
            fn()
        return (time.perf_counter() - start) / steps * 1000

    with torch.inference_mode():
        return timed(one_core_step), timed(one_layer_step)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--context", type=int, default=65536)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--indexer-cache-dtype", default="model", choices=KEY_KINDS,
                        help="the indexer keys' cache: model (the model dtype), int8 or fp8")
    args = parser.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    cfg = glm52_attention_config()
    dense_core, dense_layer = step_ms(cfg, "dense", args.context, args.steps)
    sparse_core, sparse_layer = step_ms(cfg, "sparse", args.context, args.steps, args.indexer_cache_dtype)
    print(f"64 heads, one full + one shared layer, {args.context}-token synthetic cache, bf16 (indexer keys "
          f"{args.indexer_cache_dtype}), ms per decode step")
    print(f"{'':8}{'core':>10}{'layer':>10}")
    print(f"{'dense':8}{dense_core:10.1f}{dense_layer:10.1f}")
    print(f"{'sparse':8}{sparse_core:10.1f}{sparse_layer:10.1f}   (indexer included)")
    print(f"sparse is {dense_core / sparse_core:.1f}× faster on the attention core, "
          f"{dense_layer / sparse_layer:.1f}× on the whole layers")


if __name__ == "__main__":
    main()
