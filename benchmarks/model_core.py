"""Model-core benchmark: dsaserve vs transformers `generate` on the same ~215M-parameter checkpoint.

    python benchmarks/model_core.py [--out docs/model_core.json]

Builds (once) a bf16 checkpoint with GLM-5.2 per-head geometry (kv_lora_rank 512, rope 64, nope 192,
v 256, indexer 32×128, index_topk 2048, schedule FFFSSSFS), then measures, each side in its own
process so load time and peak memory are its own: load time, peak RSS, decode ms/token at batch 1,
and output tokens/s at batch 16 (128 prompt + 128 output tokens, greedy, eos ignored).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

BENCH_CONFIG = dict(
    vocab_size=16384, hidden_size=1024, intermediate_size=2816, moe_intermediate_size=384,
    num_hidden_layers=8, num_attention_heads=16, q_lora_rank=512, kv_lora_rank=512,
    qk_nope_head_dim=192, qk_rope_head_dim=64, v_head_dim=256, n_routed_experts=8, num_experts_per_tok=4,
    n_shared_experts=1, first_k_dense_replace=1, index_topk=2048, index_head_dim=128, index_n_heads=32,
    indexer_types=["full", "full", "full", "shared", "shared", "shared", "full", "shared"],
    max_position_embeddings=65536,
)
# The same widths in DeepSeek-V3.2's layout and per-head geometry (nope 128, v 128, indexer 64×128): every layer
# runs its own indexer; 8 experts in 4 groups, the best 2 groups chosen.
V32_BENCH_CONFIG = dict({k: v for k, v in BENCH_CONFIG.items() if k != "indexer_types"}, model_type="deepseek_v32",
                        qk_nope_head_dim=128, v_head_dim=128, index_n_heads=64, n_group=4, topk_group=2)
PROMPT, OUTPUT, BATCH = 128, 128, 16


def checkpoint_dir(model_type: str = "glm_moe_dsa") -> str:
    """The benchmark checkpoint of a family, built once (bf16) under $DSASERVE_BENCH_DIR (/tmp/dsaserve-bench)."""
    import torch

    from dsaserve.demo.checkpoint_builder import build_checkpoint

    name, config = {"glm_moe_dsa": ("glm52-geometry-215m", BENCH_CONFIG),
                    "deepseek_v32": ("v32-geometry", V32_BENCH_CONFIG)}[model_type]
    path = os.path.join(os.environ.get("DSASERVE_BENCH_DIR", "/tmp/dsaserve-bench"), name)
    if not os.path.isfile(os.path.join(path, "model.safetensors")):
        build_checkpoint(path, seed=0, dtype=torch.bfloat16, **config)
    return path


def prompts(n: int) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(0)
    return torch.randint(100, BENCH_CONFIG["vocab_size"], (n, PROMPT), generator=g).tolist()


def peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def run_dsaserve(path: str) -> dict:
    from dsaserve import LLM, SamplingParams

    start = time.perf_counter()
    # 256 MiB holds 16 × 256 tokens many times over (10 KiB per token); the default would allocate 1 GiB.
    llm = LLM(path, progress=False, max_model_len=4096, kv_cache_memory="256MiB")
    load_s = time.perf_counter() - start
    load_rss = peak_rss_gib()
    engine = llm.engine

    def one_request_ms_per_token() -> float:
        engine.add_request("latency", prompts(1)[0], SamplingParams(temperature=0, max_tokens=OUTPUT, ignore_eos=True))
        engine.step()  # prefill (+ first token)
        start = time.perf_counter()
        steps = 0
        while engine.has_unfinished_requests():
            engine.step()
            steps += 1
        return (time.perf_counter() - start) / steps * 1000

    one_request_ms_per_token()  # warm-up
    ms = one_request_ms_per_token()
    params = SamplingParams(temperature=0, max_tokens=OUTPUT, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompt_token_ids=prompts(BATCH), sampling_params=params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    assert all(len(o.outputs[0].token_ids) == OUTPUT for o in outs)
    return {"name": "dsaserve", "dtype": str(engine.dtype).removeprefix("torch."), "load_s": load_s,
            "load_peak_rss_gib": load_rss, "decode_ms_per_token_b1": ms,
            "output_tok_s_b16": BATCH * OUTPUT / elapsed, "peak_rss_gib": peak_rss_gib()}


def run_reference(path: str) -> dict:
    import torch
    from transformers import GlmMoeDsaForCausalLM

    start = time.perf_counter()
    # The sdpa path fails in generate with a cache in this transformers version; eager is its working path.
    model = GlmMoeDsaForCausalLM.from_pretrained(path, dtype=torch.bfloat16, attn_implementation="eager").eval()
    load_s = time.perf_counter() - start
    load_rss = peak_rss_gib()

    def generate(ids: list[list[int]], n: int) -> float:
        start = time.perf_counter()
        with torch.no_grad():
            out = model.generate(torch.tensor(ids), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                 eos_token_id=None, pad_token_id=0)
        assert out.shape[1] == PROMPT + n
        return time.perf_counter() - start

    generate(prompts(1), 4)  # warm-up
    ms = (generate(prompts(1), OUTPUT) - generate(prompts(1), 1)) / (OUTPUT - 1) * 1000
    elapsed = generate(prompts(BATCH), OUTPUT)
    return {"name": "transformers", "dtype": "bfloat16", "load_s": load_s, "load_peak_rss_gib": load_rss,
            "decode_ms_per_token_b1": ms, "output_tok_s_b16": BATCH * OUTPUT / elapsed, "peak_rss_gib": peak_rss_gib()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--side", choices=["dsaserve", "transformers"], help="run one side (used internally)")
    parser.add_argument("--out", default=None, help="also write the results as JSON")
    parser.add_argument("--build-only", choices=["glm_moe_dsa", "deepseek_v32"],
                        help="build that family's benchmark checkpoint (if missing), print its path and stop")
    args = parser.parse_args()
    if args.build_only:
        print(checkpoint_dir(args.build_only))
        return
    import torch

    torch.set_num_threads(os.cpu_count() or 1)
    path = checkpoint_dir()
    if args.side:
        result = run_dsaserve(path) if args.side == "dsaserve" else run_reference(path)
        print(json.dumps(result))
        return
    results = []
    for side in ("dsaserve", "transformers"):
        proc = subprocess.run([sys.executable, __file__, "--side", side], capture_output=True, text=True, check=True)
        results.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    ours, ref = results
    print(f"checkpoint: {path} (bf16, {PROMPT} prompt + {OUTPUT} output tokens, greedy)")
    print(f"{'':14}{'dtype':>10}{'load s':>9}{'load RSS GiB':>14}{'ms/token b1':>13}{'tok/s b16':>11}{'peak GiB':>10}")
    for r in results:
        print(f"{r['name']:14}{r['dtype']:>10}{r['load_s']:>9.2f}{r['load_peak_rss_gib']:>14.2f}"
              f"{r['decode_ms_per_token_b1']:>13.1f}{r['output_tok_s_b16']:>11.1f}{r['peak_rss_gib']:>10.2f}")
    print(f"dsaserve / transformers: batch-1 decode "
          f"{ref['decode_ms_per_token_b1'] / ours['decode_ms_per_token_b1']:.2f}× faster, "
          f"batch-16 throughput {ours['output_tok_s_b16'] / ref['output_tok_s_b16']:.2f}×")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
