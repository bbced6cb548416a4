"""The MTP block of a checkpoint as layer 0 of a one-layer checkpoint, for the transformers reference.

Its final norm is the MTP layer's shared_head.norm and its lm_head the target's, so running it on
inputs_embeds = eh_proj(cat[enorm(embed(t)), hnorm(h)]) gives the MTP layer's logits with the reference's
own attention, indexer and MoE. Used to check the draft step (tests) and to train it (benchmarks).
"""

from __future__ import annotations

import json
import os
import shutil

import torch
from safetensors.torch import load_file, save_file

OWN = ("enorm", "hnorm", "eh_proj")  # the MTP layer's tensors outside its decoder block


def write_mtp_block_checkpoint(checkpoint: str, target_dir: str) -> dict[str, torch.Tensor]:
    """Write the one-layer checkpoint into target_dir; returns the MTP layer's own weights (fp32)."""
    with open(os.path.join(checkpoint, "config.json")) as f:
        config = json.load(f)
    prefix = f"model.layers.{config['num_hidden_layers']}."
    weights = load_file(os.path.join(checkpoint, "model.safetensors"))
    block = {k.replace(prefix, "model.layers.0."): v for k, v in weights.items()
             if k.startswith(prefix) and not any(part in k for part in OWN + ("shared_head",))}
    block["model.embed_tokens.weight"] = weights["model.embed_tokens.weight"]
    block["model.norm.weight"] = weights[prefix + "shared_head.norm.weight"]
    block["lm_head.weight"] = weights["lm_head.weight"]
    os.makedirs(target_dir, exist_ok=True)
    for name in os.listdir(checkpoint):
        if not name.endswith(".safetensors") and name != "config.json":
            shutil.copy(os.path.join(checkpoint, name), target_dir)
    config.update(num_hidden_layers=1, indexer_types=["full"], first_k_dense_replace=0, num_nextn_predict_layers=0)
    config.pop("mlp_layer_types", None)
    with open(os.path.join(target_dir, "config.json"), "w") as f:
        json.dump(config, f)
    save_file(block, os.path.join(target_dir, "model.safetensors"))
    return {k: weights[prefix + f"{k}.weight"].float().clone() for k in OWN}
