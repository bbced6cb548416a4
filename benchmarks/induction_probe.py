"""How fast does a model learn content-based induction (find the earlier copy of this token, say what followed)?

    python benchmarks/induction_probe.py --model demo [--steps 1100] [--layers 2] [--overrides '{"kv_lora_rank": 256}']
                                         [--shared-embedding] [--attention-losses previous,lookup]
                                         [--lookup-layer 5]
    python benchmarks/induction_probe.py --model vanilla [--steps 1100]

The demo model cannot look codes up in documents, and that lookup is an induction step. This probe
isolates it: each batch is 16 rows of a random 32-token segment, a random gap of 0-32 random tokens
(the same within a batch, new each step, so no fixed-offset head solves it) and the segment again;
the loss covers the repeated segment only. `demo` is the demo trainer's forward
(dsaserve/demo/train_model.py) with the demo geometry cut to `--layers` dense layers; `vanilla` is
torch's pre-norm TransformerEncoder of the same width, heads and depth with learned absolute positions.
`--shared-embedding` gives the demo's embedding rows one common direction at initialization (the
lookup recipe's); `--attention-losses` adds the trainer's losses on the
previous-token head and on the lookup head (here: from each token of the repeat to the token after
its first copy). Prints the loss and the next-token accuracy on the repeated segment every 100 steps.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn


class Vanilla(nn.Module):
    def __init__(self, vocab: int, width: int, heads: int, ffn: int, layers: int):
        super().__init__()
        self.embed, self.position = nn.Embedding(vocab, width), nn.Embedding(128, width)
        layer = nn.TransformerEncoderLayer(width, heads, ffn, 0.0, batch_first=True, norm_first=True)
        self.layers = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(width, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        s = ids.shape[1]
        h = self.embed(ids) + self.position(torch.arange(s))
        return self.head(self.layers(h, mask=nn.Transformer.generate_square_subsequent_mask(s), is_causal=True))


def build(kind: str, layers: int, overrides: dict, shared_embedding: bool = False):
    from dsaserve.config import ModelConfig
    from dsaserve.demo.train import demo_tokenizer, model_config
    from dsaserve.demo.train_model import TrainableGlmMoeDsa

    cut = dict(num_hidden_layers=layers, first_k_dense_replace=layers,
               indexer_types=["full" if i % 2 == 0 else "shared" for i in range(layers)])
    raw = model_config(demo_tokenizer(), **{**cut, **overrides})
    if kind == "vanilla":
        return Vanilla(raw["vocab_size"], raw["hidden_size"], raw["num_attention_heads"], raw["intermediate_size"],
                       layers), raw["vocab_size"]
    model = TrainableGlmMoeDsa(ModelConfig.from_dict(raw), seed=0, include_mtp=False, shared_embedding=shared_embedding)
    return model, raw["vocab_size"]


def main() -> None:
    from dsaserve.demo.train import attention_losses, watched_heads

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=("demo", "vanilla"), default="demo")
    parser.add_argument("--steps", type=int, default=1100)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--overrides", default="{}", help="demo config fields to change (JSON)")
    parser.add_argument("--shared-embedding", action="store_true", help="demo: embedding rows share one direction")
    parser.add_argument("--attention-losses", default="", help="demo: comma-separated, of previous,lookup")
    parser.add_argument("--lookup-layer", type=int, default=None,
                        help="demo: the lookup head's layer (default: the trainer's)")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    model, vocab = build(args.model, args.layers, json.loads(args.overrides), args.shared_embedding)
    supervised = set(filter(None, args.attention_losses.split(",")))
    heads = watched_heads(model.cfg) if args.model == "demo" else None
    if args.lookup_layer is not None:
        heads = replace(heads, lookup=(f"model.layers.{args.lookup_layer}.self_attn", heads.lookup[1]))
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-3, betas=(0.9, 0.95), weight_decay=0.01)
    started = time.monotonic()
    for step in range(args.steps):
        segment = torch.randint(20, min(vocab, 1400), (16, 32))
        gap = int(torch.randint(0, 33, ()).item())
        ids = torch.cat([segment, torch.randint(20, min(vocab, 1400), (16, gap)), segment], dim=1)
        if args.model == "vanilla":
            logits = model(ids)
        else:
            out = model(ids, sparse=False, watch_heads=heads.all() if supervised else None)
            logits = out.logits
        logits = logits[:, 32 + gap:-1]
        loss = F.cross_entropy(logits.reshape(-1, vocab), ids[:, 33 + gap:].reshape(-1))
        total = loss
        if supervised:
            query = torch.arange(32 + gap, 63 + gap)  # predicts segment[i + 1], which first sat at i + 1
            pointers = torch.stack([torch.arange(16).repeat_interleave(31), query.repeat(16),
                                    (query - 31 - gap).repeat(16)], dim=1)
            extra = attention_losses(out, heads, torch.ones_like(ids, dtype=torch.bool), pointers)
            total = total + sum(extra[{"previous": "previous", "lookup": "pointer"}[kind]] for kind in supervised)
        optimizer.zero_grad()
        total.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        if step % 100 == 0 or step == args.steps - 1:
            accuracy = (logits.argmax(-1) == ids[:, 33 + gap:]).float().mean().item()
            print(f"step {step:5d} loss {loss.item():.3f} accuracy {accuracy:.3f} ({time.monotonic() - started:.0f} s)",
                  flush=True)


if __name__ == "__main__":
    main()
