"""The built-in demo model: a small random-weight GLM-MoE-DSA checkpoint, built once into a cache dir.

Its weights are random, so its text is gibberish; it exists so a new user sees the whole path work
(tokenizer, chat template, indexer schedule, sparse attention, MoE, paged cache) without a download.
"""

from __future__ import annotations

import os
import shutil
import tempfile

import torch

from dsaserve.demo.checkpoint_builder import build_checkpoint

DEMO_VERSION = 3
DEMO_CONFIG = dict(
    hidden_size=256, intermediate_size=512, moe_intermediate_size=128, num_hidden_layers=6,
    num_attention_heads=4, q_lora_rank=128, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16,
    v_head_dim=32, n_routed_experts=16, num_experts_per_tok=4, first_k_dense_replace=1,
    index_topk=64, index_head_dim=32, index_n_heads=4,
    indexer_types=["full", "full", "shared", "shared", "full", "shared"], max_position_embeddings=8192,
    index_share_for_mtp_iteration=True,  # as GLM-5.2
)


def demo_cache_root() -> str:
    base = os.environ.get("DSASERVE_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "dsaserve")
    return base


def demo_model_dir() -> str:
    """Path of the demo checkpoint, building it on first use (a second or two)."""
    target = os.path.join(demo_cache_root(), f"demo-v{DEMO_VERSION}")
    if os.path.isfile(os.path.join(target, "model.safetensors")):
        return target
    os.makedirs(demo_cache_root(), exist_ok=True)
    tmp = tempfile.mkdtemp(dir=demo_cache_root(), prefix=".demo-")
    build_checkpoint(tmp, seed=1234, dtype=torch.bfloat16, include_mtp=True, **DEMO_CONFIG)
    try:
        os.rename(tmp, target)
    except OSError:  # built concurrently by another process: keep theirs
        shutil.rmtree(tmp, ignore_errors=True)
    return target
