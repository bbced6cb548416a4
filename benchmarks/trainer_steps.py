"""The demo trainer's main phase for a few steps: each step's losses and seconds, on this checkout's code.

    python benchmarks/trainer_steps.py [--steps 24] [--dense-steps 12] [--copy-steps 0]

Run it on two checkouts (`git worktree add /tmp/before <commit>`, then `PYTHONPATH=/tmp/before python
benchmarks/trainer_steps.py`) to compare trainers: the batches and initial weights are the seed's, so the
losses should agree to bf16 noise and the seconds say which forward is faster. Copy batches are short; with
--copy-steps 0 the first steps draw the chat mix, up to 1.5K-token retrieval documents.
"""

from __future__ import annotations

import argparse
import random
import time

import torch

from dsaserve.config import ModelConfig
from dsaserve.demo.train import (
    ChatEncoder,
    TrainConfig,
    demo_tokenizer,
    learning_rate,
    model_config,
    sample_batch,
    train_step,
)
from dsaserve.demo.train_model import TrainableGlmMoeDsa


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--dense-steps", type=int, default=12)
    parser.add_argument("--copy-steps", type=int, default=0)
    args = parser.parse_args()
    tc = TrainConfig(steps=args.steps, dense_steps=args.dense_steps, warmup=10, copy_steps=args.copy_steps,
                     copy_share=0.0 if args.copy_steps == 0 else TrainConfig.copy_share)
    torch.manual_seed(tc.seed)
    torch.set_num_threads(tc.threads)
    rng, tok = random.Random(tc.seed), demo_tokenizer()
    raw = model_config(tok)
    model = TrainableGlmMoeDsa(ModelConfig.from_dict(raw), seed=tc.seed, shared_embedding=tc.shared_embedding)
    encoder, pad = ChatEncoder(tok), raw["pad_token_id"]
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=tc.lr, betas=(0.9, 0.95), weight_decay=0.01)
    seconds = []
    for step in range(tc.steps):
        kind, examples = sample_batch(rng, encoder, step, tc)
        started = time.perf_counter()
        parts, shape = train_step(model, optimizer, params, examples, pad, step >= tc.dense_steps, tc,
                                  learning_rate(step, tc))
        seconds.append(time.perf_counter() - started)
        losses = " ".join(f"{k} {v.item():.3f}" for k, v in parts.items())
        print(f"step {step:3d} {kind:9s} {shape[0]:3d}x{shape[1]:<5d} {losses} {seconds[-1]:.2f} s", flush=True)
    print(f"median {sorted(seconds)[len(seconds) // 2]:.3f} s/step, total {sum(seconds):.1f} s")


if __name__ == "__main__":
    main()
