"""Self-distil the demo model's MTP layer on the target's own outputs, for measuring speculative decoding.

    python benchmarks/mtp_distill.py --out /tmp/demo-mtp [--minutes 5] [--sequences 384] [--length 128]

A random-weight MTP layer drafts tokens the target almost never accepts, so acceptance and speed-ups mean
nothing until the layer is trained. This script: (1) samples sequences from the target (the demo model),
half greedy and half at temperature 1, from random prompts; (2) runs the target over them (transformers,
the numerical oracle) to record, per position p, its hidden state after the final norm and its next-token
distribution; (3) trains the MTP layer, with the target frozen, so that from (h_p, t_{p+1}) it predicts the
target's distribution for position p + 2 (KL to the target's softmax); (4) writes a copy of the checkpoint
whose MTP tensors are the trained ones. The training forward is transformers' decoder layer, run as a
one-layer model whose final norm is shared_head.norm and whose lm_head is the target's
(dsaserve/demo/mtp_block.py).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time

import torch
from safetensors.torch import load_file, save_file

from dsaserve import LLM, SamplingParams
from dsaserve.demo import demo_model_dir
from dsaserve.demo.mtp_block import OWN, write_mtp_block_checkpoint


def sample_sequences(model_dir: str, count: int, length: int, seed: int) -> list[list[int]]:
    llm = LLM(model_dir, dtype="float32", progress=False, max_num_seqs=64)
    g = torch.Generator().manual_seed(seed)
    vocab = llm.engine.config.vocab_size
    prompts = [{"prompt_token_ids": torch.randint(10, min(vocab, 590), (16,), generator=g).tolist()}
               for _ in range(count)]
    params = [SamplingParams(max_tokens=length - 16, temperature=0 if i % 2 == 0 else 1.0, seed=seed + i,
                             ignore_eos=True)
              for i in range(count)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [p["prompt_token_ids"] + o.outputs[0].token_ids for p, o in zip(prompts, outs)]


def load_hf(model_dir: str):
    from transformers import GlmMoeDsaForCausalLM

    return GlmMoeDsaForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")


def target_signals(model_dir: str, sequences: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """(hidden after the final norm [S, L, H], next-token log-probabilities [S, L, V]) of the target."""
    target = load_hf(model_dir).eval()
    captured = {}
    target.model.norm.register_forward_hook(
        lambda m, a, out: captured.__setitem__("h", out[0] if isinstance(out, tuple) else out))
    hidden, logprobs = [], []
    with torch.no_grad():
        for i in range(0, len(sequences), 16):
            batch = torch.tensor(sequences[i : i + 16])
            logprobs.append(target(batch).logits.float().log_softmax(-1))
            hidden.append(captured["h"].float())
    return torch.cat(hidden), torch.cat(logprobs)


def rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def train(block, own: dict, sequences, hidden, logprobs, minutes: float, seed: int) -> tuple[list[float], dict]:
    torch.manual_seed(seed)
    eps = block.config.rms_norm_eps
    own = {k: torch.nn.Parameter(v) for k, v in own.items()}
    block.model.embed_tokens.weight.requires_grad_(False)
    block.lm_head.weight.requires_grad_(False)
    params = [p for p in block.parameters() if p.requires_grad] + list(own.values())
    optimizer = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.0)
    tokens = torch.tensor(sequences)
    deadline, losses, step = time.monotonic() + minutes * 60, [], 0
    block.train()
    while time.monotonic() < deadline:
        pick = torch.randint(0, len(sequences), (16,))
        t, h, target = tokens[pick], hidden[pick], logprobs[pick]
        embeds = block.model.embed_tokens(t[:, 1:]).clone()
        embeds[:, 0] = 0  # the row at position 0
        x = torch.cat([rms(embeds, own["enorm"], eps), rms(h[:, :-1], own["hnorm"], eps)], -1) @ own["eh_proj"].T
        out = block(inputs_embeds=x).logits.float().log_softmax(-1)  # row p predicts position p + 2
        loss = torch.nn.functional.kl_div(out[:, :-1], target[:, 1:-1], log_target=True, reduction="batchmean")
        loss = loss / (t.shape[1] - 2)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(float(loss))
        step += 1
        if step % 50 == 0:
            print(f"step {step}: KL {sum(losses[-50:]) / 50:.4f}", flush=True)
    return losses, {k: v.detach() for k, v in own.items()}


def write_checkpoint(source: str, out: str, block, own: dict) -> None:
    with open(os.path.join(source, "config.json")) as f:
        layer = json.load(f)["num_hidden_layers"]
    shutil.copytree(source, out, dirs_exist_ok=True)
    path = os.path.join(out, "model.safetensors")
    weights = load_file(path)
    prefix = f"model.layers.{layer}."
    trained = block.state_dict()
    for name in list(weights):
        if not name.startswith(prefix):
            continue
        rest = name[len(prefix):]
        if rest.split(".")[0] in OWN:
            value = own[rest.split(".")[0]]
        elif rest == "shared_head.norm.weight":
            value = trained["model.norm.weight"]
        else:
            value = block_tensor(trained, rest)
        weights[name] = value.to(weights[name].dtype).contiguous()
    save_file(weights, path)


def block_tensor(state: dict, rest: str) -> torch.Tensor:
    """A checkpoint tensor of the block from transformers' state dict, whose routed experts are fused
    (gate_up_proj [E, 2I, H] with gate first, down_proj [E, H, I])."""
    parts = rest.split(".")
    if parts[:2] == ["mlp", "experts"] and parts[2].isdigit():
        expert, kind = int(parts[2]), parts[3]
        if kind == "down_proj":
            return state["model.layers.0.mlp.experts.down_proj"][expert]
        gate_up = state["model.layers.0.mlp.experts.gate_up_proj"][expert]
        half = gate_up.shape[0] // 2
        return gate_up[:half] if kind == "gate_proj" else gate_up[half:]
    return state["model.layers.0." + rest]


def check_round_trip(source: str, block) -> None:
    """Before training, mapping the block back must give the checkpoint's own tensors."""
    with open(os.path.join(source, "config.json")) as f:
        prefix = f"model.layers.{json.load(f)['num_hidden_layers']}."
    weights, state = load_file(os.path.join(source, "model.safetensors")), block.state_dict()
    for name, value in weights.items():
        rest = name[len(prefix):]
        if name.startswith(prefix) and rest.split(".")[0] not in OWN and not rest.startswith("shared_head"):
            if not torch.equal(block_tensor(state, rest).to(value.dtype), value):
                raise RuntimeError(f"{name} does not map back to the checkpoint")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="where to write the checkpoint with the trained MTP layer")
    parser.add_argument("--model", default=None, help="the target (default: the built-in demo model)")
    parser.add_argument("--minutes", type=float, default=5.0)
    parser.add_argument("--sequences", type=int, default=384)
    parser.add_argument("--length", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    source = args.model or demo_model_dir()
    start = time.monotonic()
    sequences = sample_sequences(source, args.sequences, args.length, args.seed)
    hidden, logprobs = target_signals(source, sequences)
    print(f"{len(sequences)} sequences of {args.length} tokens sampled and scored in {time.monotonic() - start:.0f}s")
    work = args.out + ".block"
    own = write_mtp_block_checkpoint(source, work)
    block = load_hf(work)
    check_round_trip(source, block)
    losses, own = train(block, own, sequences, hidden, logprobs, args.minutes, args.seed)
    write_checkpoint(source, args.out, block, own)
    shutil.rmtree(work, ignore_errors=True)
    print(f"trained {len(losses)} steps: KL {losses[0]:.3f} → {sum(losses[-20:]) / 20:.3f}; wrote {args.out}")


if __name__ == "__main__":
    main()
