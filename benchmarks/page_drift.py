"""How far page-sparse attention moves log-probabilities away from token top-k (the trained semantics).

    python benchmarks/page_drift.py

A generated checkpoint (random weights, schedule FFSS, index_topk 64) and random 1,024-token prompts.
For every prompt position, the log-probability of the actual next token (prompt_logprobs) under
`sparse` (token top-k), `page` (pages of 16 ranked by their best visible token; budget 4 pages = the
same 64 tokens, and 8 pages = twice as many) and `dense`. Reports mean and max |Δ| against sparse.
"""

from __future__ import annotations

import os
import tempfile

import torch

from dsaserve import LLM, SamplingParams
from dsaserve.demo.checkpoint_builder import build_checkpoint

PROMPTS, LENGTH, TOPK, BLOCK = 4, 1024, 64, 16


def prompt_logprobs(path: str, prompts, **engine_args) -> torch.Tensor:
    llm = LLM(path, dtype="float32", block_size=BLOCK, max_model_len=2048, progress=False,
              enable_prefix_caching=False, **engine_args)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=SamplingParams(max_tokens=1, prompt_logprobs=0),
                        use_tqdm=False)
    values = []
    for prompt, out in zip(prompts, outs):
        for token, entry in zip(prompt[1:], out.prompt_logprobs[1:]):
            values.append(entry[token].logprob)
    return torch.tensor(values).view(len(prompts), -1)


def main() -> None:
    torch.set_num_threads(os.cpu_count() or 1)
    path = build_checkpoint(tempfile.mkdtemp(prefix="page-drift-"), seed=3, index_topk=TOPK, hidden_size=256,
                            num_attention_heads=8, max_position_embeddings=4096)
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(30, 600, (PROMPTS, LENGTH), generator=g).tolist()
    sparse = prompt_logprobs(path, prompts)
    beyond = slice(TOPK, None)  # positions that see more than index_topk tokens
    print(f"|Δ log-prob| of the next prompt token vs sparse, positions {TOPK}..{LENGTH - 1} of {PROMPTS} prompts:")
    for label, args in (("page, 4 pages (64 tokens)", dict(attention_backend="page", page_budget=4)),
                        ("page, 8 pages (128 tokens)", dict(attention_backend="page", page_budget=8)),
                        ("dense", dict(attention_backend="dense"))):
        other = prompt_logprobs(path, prompts, **args)
        diff = (other - sparse)[:, beyond].abs()
        print(f"  {label:<28} mean {diff.mean():.4f}  p99 {diff.flatten().quantile(0.99):.4f}  max {diff.max():.4f}")


if __name__ == "__main__":
    main()
