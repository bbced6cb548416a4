"""GLM-5.3-Flash (`glm5_next`) on CPU, on a generated checkpoint with its per-layer geometry (hidden 4096, 64 MLA heads
of 256 without RoPE, 64 KDA heads of 128, pools of 16, index_topk 2048, experts of 2048 with 8 per token, 4 mHC
streams) and fewer layers (K K K A: the 3:1 ratio) and experts (16).

    python benchmarks/glm5_next_bench.py [--dir DIR] [--contexts 1024 8192 32768] [--batches 1 16] [--json OUT]

Measures, the backends' engines loaded side by side and taking turns:
- decode: median ms per step and tokens/s at each context and batch, sparse and dense; decode contexts are written
  synthetically (random latents, pool keys and KDA states), as `dsaserve bench longctx` does;
- where a decode step's time goes: the KDA layers' attention, the indexed layer's attention, and the rest (MLP/MoE,
  mHC, norms, head), from module hooks on batch-1 steps; one KDA layer against the indexed (MLA) layer, and against
  GLM-5.2's MLA layer (with RoPE and its indexer) at the same hidden size, in a glm_moe_dsa checkpoint of two
  layers measured at each context before the Flash engines (through its modules, as glm5_next runs);
- prefill of 8K tokens (time to first token), with the KDA layers' and the indexed layer's share of it: dense, and
  the sparse engine twice, each time also with the delta rule in torch's chunked form instead of the native
  kda_delta (taking turns);
- the KDA state a request holds, and a prefix-cache hit's time to first token against a miss.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections import defaultdict

import torch

from dsaserve import LLM, SamplingParams
from dsaserve.attention import delta_rule
from dsaserve.bench.longctx import fill_synthetic_prefix
from dsaserve.demo.checkpoint_builder import build_checkpoint

K, A = "linear_attention", "indexed_attention"
GEOMETRY = dict(
    hidden_size=4096, num_attention_heads=64, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=256,
    v_head_dim=256, intermediate_size=12288, moe_intermediate_size=2048, n_routed_experts=16, num_experts_per_tok=8,
    n_shared_experts=1, index_topk=2048, index_head_dim=128, index_n_heads=32, index_kpool=16, hc_sinkhorn_iters=20,
    swiglu_limit=10.0, num_hidden_layers=4, layer_types=[K, K, K, A], indexer_types=["full"] * 4,
    mlp_layer_types=["dense", "sparse", "sparse", "sparse"], max_position_embeddings=65536,
    linear_attn_config={"head_dim": 128, "num_heads": 64, "short_conv_kernel_size": 4, "gate_lower_bound": -5.0},
)

# GLM-5.2's MLA layer (q_lora 2048, 64 heads of 192 + 64 RoPE, values of 256, its indexer 32 × 128) at the same
# hidden size, in a glm_moe_dsa checkpoint of two dense layers: what a KDA layer's decode step is compared with.
GLM52_AT_4096 = dict(
    hidden_size=4096, num_attention_heads=64, q_lora_rank=2048, kv_lora_rank=512, qk_nope_head_dim=192,
    qk_rope_head_dim=64, v_head_dim=256, intermediate_size=12288, num_hidden_layers=2, first_k_dense_replace=2,
    n_routed_experts=8, num_experts_per_tok=4, moe_intermediate_size=2048, index_topk=2048, index_head_dim=128,
    index_n_heads=32, indexer_types=["full", "full"], max_position_embeddings=65536,
)


def checkpoint(directory: str, model_type: str = "glm5_next", geometry: dict = GEOMETRY) -> str:
    if not os.path.isfile(os.path.join(directory, "config.json")):
        print(f"building the benchmark checkpoint in {directory} …", flush=True)
        build_checkpoint(directory, seed=0, dtype=torch.bfloat16, model_type=model_type, **geometry)
    return directory


class LayerClock:
    """Seconds spent in each layer's attention module (KDA or indexed) while open."""

    def __init__(self, model):
        self.seconds = defaultdict(float)
        self.hooks = []
        for i, layer in enumerate(model.model.layers):
            kind = "indexed" if getattr(layer, "attends", True) else "kda"  # (GLM-5.2's layers all attend)
            attn = layer.self_attn
            self.hooks.append(attn.register_forward_pre_hook(lambda m, a, i=i: setattr(m, "_t0", time.perf_counter())))
            self.hooks.append(attn.register_forward_hook(
                lambda m, a, o, key=(kind, i): self.seconds.__setitem__(key, self.seconds[key]
                                                                        + time.perf_counter() - m._t0)))

    def close(self):
        for h in self.hooks:
            h.remove()

    def total(self, kind: str) -> tuple[float, int]:
        """(seconds, layers) of one kind of layer."""
        picked = [s for (k, _), s in self.seconds.items() if k == kind]
        return sum(picked), len(picked)


def decode(llm: LLM, context: int, batch: int, steps: int, clock: bool = False) -> dict:
    engine = llm.engine
    g = torch.Generator().manual_seed(context + batch)
    params = SamplingParams(temperature=0, max_tokens=steps + 2, ignore_eos=True)
    for b in range(batch):
        ids = torch.randint(100, engine.config.vocab_size, (context,), generator=g).tolist()
        engine.add_prefilled_request(engine.make_request(f"r{b}", ids, params), context - 1,
                                     lambda cache, table, n: fill_synthetic_prefix(cache, table, n, g))
    engine.step()  # the last prompt tokens: the first decode-shaped step
    layers = LayerClock(engine.model) if clock else None
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    for b in range(batch):
        engine.abort_request(f"r{b}")
    step = statistics.median(times)
    out = {"ms_per_step": step * 1000, "tokens_per_s": batch / step}
    if layers is not None:
        layers.close()
        total = sum(times)
        (kda, n_kda), (indexed, n_indexed) = layers.total("kda"), layers.total("indexed")
        out.update(kda_share=kda / total, indexed_share=indexed / total,
                   kda_layer_ms=kda / max(n_kda, 1) / steps * 1000,
                   indexed_layer_ms=indexed / n_indexed / steps * 1000)  # per layer
    return out


def prefill(llm: LLM, ids: list[int]) -> dict:
    """Time to first token of a fresh prompt and the attention layers' shares of it."""
    layers = LayerClock(llm.engine.model)
    seconds = ttft(llm, ids)[0]
    layers.close()
    return {"seconds": seconds, "tokens_per_s": len(ids) / seconds, "kda_share": layers.total("kda")[0] / seconds,
            "indexed_share": layers.total("indexed")[0] / seconds}


def ttft(llm: LLM, ids: list[int]) -> tuple[float, int]:
    start = time.perf_counter()
    out = llm.generate(prompt_token_ids=ids, sampling_params=SamplingParams(max_tokens=1, temperature=0),
                       use_tqdm=False)[0]
    return time.perf_counter() - start, out.metrics["num_prefix_hit_tokens"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", default="/tmp/dsaserve-bench/glm5-next-flash-geometry")
    p.add_argument("--glm52-dir", default="/tmp/dsaserve-bench/glm52-mla-hidden-4096")
    p.add_argument("--contexts", type=int, nargs="+", default=[1024, 8192, 32768])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--prefill", type=int, default=8192)
    p.add_argument("--shared-prefix", type=int, default=4096)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    path = checkpoint(args.dir)
    longest = max(args.contexts)
    common = dict(dtype="bfloat16", block_size=64, max_model_len=longest + 64, max_num_seqs=max(args.batches),
                  progress=False)
    memory = f"{max(args.batches) * (longest + 128) * 2048 // 2**20 + 512}MiB"
    llms = {backend: LLM(path, attention_backend=backend, kv_cache_memory=memory, enable_prefix_caching=False,
                         **common)  # (decode contexts are written synthetically: not the prompts' own)
            for backend in ("sparse", "dense")}
    sparse = llms["sparse"].engine
    results = {"cpu": cpu_name(), "threads": torch.get_num_threads(), "geometry": GEOMETRY,
               "state_bytes_per_request": sparse.kv_layout.state_bytes_per_request,
               "kv_bytes_per_token": sparse.kv_layout.bytes_per_token, "decode": []}
    print(f"KDA state per request: {results['state_bytes_per_request'] / 2**20:.1f} MiB; "
          f"KV per token: {results['kv_bytes_per_token']} B", flush=True)
    # enforce_eager: through its modules, as glm5_next runs (a decode plan would run the layers without their hooks)
    glm52 = LLM(checkpoint(args.glm52_dir, "glm_moe_dsa", GLM52_AT_4096), kv_cache_memory=memory, **common,
                enable_prefix_caching=False, enforce_eager=True)
    for context in args.contexts:
        # one KDA layer against GLM-5.2's MLA layer at the same hidden size, at batch 1, taking turns
        results.setdefault("glm52_mla_layer_ms", {})[context] = decode(glm52, context, 1, args.steps,
                                                                      clock=True)["indexed_layer_ms"]
        print(f"GLM-5.2 MLA layer at hidden 4096, context {context}: "
              f"{results['glm52_mla_layer_ms'][context]:.2f} ms", flush=True)
        for batch in args.batches:
            for backend, llm in llms.items():  # the backends take turns at each point
                row = {"backend": backend, "context": context, "batch": batch,
                       **decode(llm, context, batch, args.steps, clock=batch == 1)}
                results["decode"].append(row)
                print(json.dumps(row), flush=True)
    g = torch.Generator().manual_seed(1)
    vocab = sparse.config.vocab_size
    ids = torch.randint(100, vocab, (args.prefill,), generator=g).tolist()
    for llm in llms.values():  # a short prefill first: first-touch costs stay out of the timed ones
        ttft(llm, ids[:512])
    results["prefill"] = {"dense": prefill(llms["dense"], ids)}
    native = delta_rule.over_rows
    for turn in (1, 2):  # the sparse engine's prefill with the native delta rule and with torch's, taking turns
        results["prefill"][f"sparse, round {turn}"] = prefill(llms["sparse"], ids)
        delta_rule.over_rows = delta_rule.chunked
        try:
            results["prefill"][f"sparse, delta rule in torch, round {turn}"] = prefill(llms["sparse"], ids)
        finally:
            delta_rule.over_rows = native
    print("prefill", results["prefill"], flush=True)
    del llms, sparse, glm52
    cached = LLM(path, kv_cache_memory=memory, state_snapshots=8, state_snapshot_interval=512, **common)
    shared = torch.randint(100, vocab, (args.shared_prefix,), generator=g).tolist()
    miss = ttft(cached, shared + torch.randint(100, vocab, (64,), generator=g).tolist())
    hit = ttft(cached, shared + torch.randint(100, vocab, (64,), generator=g).tolist())
    results["prefix_cache"] = {"miss_s": miss[0], "hit_s": hit[0], "hit_tokens": hit[1],
                               "prompt": args.shared_prefix + 64}
    print("prefix cache", results["prefix_cache"], flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


def cpu_name() -> str:
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return "unknown"


if __name__ == "__main__":
    main()
