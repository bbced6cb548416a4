"""The built-in demo model: a small glm_moe_dsa checkpoint trained on synthetic chats, shipped in the package.

It was trained by `dsaserve build-demo --train` (dsaserve/demo/train.py: 48 minutes on 2 CPU cores, then
4 minutes in which its MTP layer learns the later draft steps, dsaserve/demo/mtp_chain.py, and about 15 in
which the trunk trains on short chats): it looks codes up in documents of about 1K tokens with its sparse
attention, greets, thinks in `<think>` before answering, repeats word lists and reverses or sorts about half
of them, gets most small sums right, and calls a declared weather or time tool in GLM's format for the city
asked. It does not answer follow-up questions in a conversation, nor retrieve from documents longer than it
was trained on (docs/benchmarks.md). The random-weight builder
remains for tests and for comparing selections against untrained weights.
"""

from __future__ import annotations

import os
import shutil
import tempfile

import torch

from dsaserve.demo.checkpoint_builder import build_checkpoint

TRAINED_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "trained")

RANDOM_DEMO_VERSION = 3
RANDOM_DEMO_CONFIG = dict(
    hidden_size=256, intermediate_size=512, moe_intermediate_size=128, num_hidden_layers=6,
    num_attention_heads=4, q_lora_rank=128, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16,
    v_head_dim=32, n_routed_experts=16, num_experts_per_tok=4, first_k_dense_replace=1,
    index_topk=64, index_head_dim=32, index_n_heads=4,
    indexer_types=["full", "full", "shared", "shared", "full", "shared"], max_position_embeddings=8192,
    index_share_for_mtp_iteration=True,  # as GLM-5.2
)


def random_demo_config(model_type: str = "glm_moe_dsa") -> dict:
    """The random demo's geometry in a family's layout: DeepSeek-V3.2 runs an indexer on every layer and routes
    within groups of experts (4 groups of 4, the best 2 groups chosen); GLM-5.3-Flash takes its builder's hybrid
    layout without RoPE."""
    if model_type == "glm_moe_dsa":
        return dict(RANDOM_DEMO_CONFIG)
    if model_type == "glm5_next":  # its builder's hybrid layout (layer kinds, pools, mHC); NoPE attention
        config = {k: v for k, v in RANDOM_DEMO_CONFIG.items() if k not in ("indexer_types", "first_k_dense_replace")}
        return dict(config, model_type=model_type, qk_rope_head_dim=0)
    glm_only = ("indexer_types", "index_share_for_mtp_iteration")
    config = {k: v for k, v in RANDOM_DEMO_CONFIG.items() if k not in glm_only}
    return dict(config, model_type=model_type, n_group=4, topk_group=2)


def demo_model_dir() -> str:
    """The trained demo checkpoint shipped with the package (no download, no training at start)."""
    if not os.path.isfile(os.path.join(TRAINED_DIR, "model.safetensors")):
        raise FileNotFoundError(
            f"the trained demo checkpoint is missing from {TRAINED_DIR}; reinstall dsaserve, or rebuild it with "
            f"`dsaserve build-demo --train {TRAINED_DIR}` (about 66 minutes on 2 CPU cores)")
    return TRAINED_DIR


def demo_cache_root() -> str:
    return os.environ.get("DSASERVE_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "dsaserve")


def random_demo_dir() -> str:
    """A random-weight checkpoint of the earlier demo geometry, built once into a cache dir (a second or two)."""
    target = os.path.join(demo_cache_root(), f"demo-random-v{RANDOM_DEMO_VERSION}")
    if os.path.isfile(os.path.join(target, "model.safetensors")):
        return target
    os.makedirs(demo_cache_root(), exist_ok=True)
    tmp = tempfile.mkdtemp(dir=demo_cache_root(), prefix=".demo-")
    build_checkpoint(tmp, seed=1234, dtype=torch.bfloat16, include_mtp=True, **RANDOM_DEMO_CONFIG)
    try:
        os.rename(tmp, target)
    except OSError:  # built concurrently by another process: keep theirs
        shutil.rmtree(tmp, ignore_errors=True)
    return target
