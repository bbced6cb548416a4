"""Chained MTP training: the demo's MTP layer learns the draft steps it runs after the first.

The main training teaches the MTP layer one step, from the target's hidden state h_0. In a draft round,
steps 2…N feed the layer its own output instead (`dsaserve/model/mtp.py`), an input it never saw, so
later drafts were accepted far less often (92%, 66%, 44% by position). This phase freezes the target,
runs the layer the way a round does, and distils the target into every step:

    step 1, base position j: row at position j, input (h_0[j], t[j+1]), keys of step-1 rows ≤ j
    step k: row at position j+k-1, input (step k-1's output, t[j+k]), keys of step-1 rows ≤ j and of
            the same base's rows of steps 2…k (the draft entries a round writes at j+1…j+k-1)

and step k's logits learn the target's next-token distribution at position j+k (KL), where that token is
an assistant token. Attention is dense here; at ≤ 64 keys (the demo's index_topk) that is also what
serving does, and IndexShare's later steps see the first step's selection plus the drafted positions.

The training loop is `train_chain` in dsaserve/demo/train.py (the last phase of `build-demo --train`):

    python -m dsaserve.demo.train --mtp-chain CHECKPOINT_DIR [--steps 300]   # rewrites the MTP tensors in place
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from dsaserve.config import ModelConfig
from dsaserve.demo.train_model import TrainableGlmMoeDsa, TrainingPass


@dataclass
class ChainConfig:
    seed: int = 4321
    steps: int = 300
    draft_steps: int = 3  # the reference deployment's N
    lr: float = 5e-4
    warmup: int = 20
    tokens_per_step: int = 2048
    threads: int = 2


def chain_logits(model: TrainableGlmMoeDsa, ids: torch.Tensor, h0: torch.Tensor, pad: int, steps: int
                 ) -> list[torch.Tensor]:
    """The MTP layer's logits [B, S, vocab] at each draft step 1…steps, for every base position: the serving
    layer (model/mtp.py) run once per step over a TrainingPass that sees the earlier steps' rows."""
    net = model.net
    b, s = ids.shape
    earlier: list[torch.Tensor] = []
    prev, out = h0.reshape(b * s, -1), []
    for k in range(1, steps + 1):
        fed = torch.cat([ids[:, k:], torch.full((b, k), pad, dtype=ids.dtype)], dim=1)  # t[j + k]
        # (the embedding at position 0 is zero, as serving has it: step 1 only)
        batch = TrainingPass.of(fed, sparse=False, first_position=k - 1, index=False, earlier=list(earlier))
        prev, _ = net.mtp(net.model.embed_tokens, net.rotary, batch, prev, None, None)
        earlier += batch.rows
        out.append(net.mtp.logits(net.lm_head, prev).view(b, s, -1))
    return out


def chain_loss(model: TrainableGlmMoeDsa, ids: torch.Tensor, target: torch.Tensor, pad: int, steps: int
               ) -> list[torch.Tensor]:
    """Per draft step, KL(target ‖ MTP) over base positions whose drafted token is an assistant token."""
    with torch.no_grad():
        reference = model(ids, sparse=True, with_mtp=False)
    logprobs = reference.logits.float().log_softmax(-1)
    losses = []
    for k, logits in enumerate(chain_logits(model, ids, reference.final_hidden.detach(), pad, steps), start=1):
        s = ids.shape[1] - k - 1  # base j drafts token j + k + 1, which the target predicts at j + k
        if s <= 0:
            losses.append(torch.zeros(()))
            continue
        mask = target[:, k + 1:]
        teacher = logprobs[:, k:k + s][mask]
        student = logits[:, :s][mask].float().log_softmax(-1)
        losses.append(F.kl_div(student, teacher, log_target=True, reduction="batchmean"))
    return losses


def mtp_parameters(model: TrainableGlmMoeDsa) -> list[torch.nn.Parameter]:
    """The MTP layer's trainable tensors; the target's are frozen."""
    chosen = []
    for name, param in model.net.named_parameters():
        param.requires_grad_(name.startswith("mtp.") and not name.endswith("e_score_correction_bias"))
        if param.requires_grad:
            chosen.append(param)
    return chosen


def load_trainable(checkpoint: str, seed: int) -> tuple[TrainableGlmMoeDsa, dict]:
    with open(os.path.join(checkpoint, "config.json")) as f:
        raw = json.load(f)
    model = TrainableGlmMoeDsa(ModelConfig.from_dict(raw), seed=seed)
    state = load_file(os.path.join(checkpoint, "model.safetensors"))
    load = model.net.weight_loader()
    for name in model.names:
        load(name, state[name].float())
    return model, raw
