"""What a batch-1 decode step costs besides streaming weights, and what the decode plan saves.

    python benchmarks/step_overhead.py [--quantization int4|int8|fp8|none] [--checkpoint DIR]

By default builds (once) a checkpoint with benchmarks/model_core.py's layers, heads, indexer and experts but
hidden 256 and every projection a few hundred KB, so a step's time is nearly all fixed costs: Python,
operator dispatch, the threads' fork and join (--checkpoint takes another, e.g. the benchmark model).
Reports the median decode step (128-token prompt) through the decode plan (model/decode_plan.py: the layers'
native pieces in one call) and through the modules, the same engine alternating step by step; then one shared MoE
layer three ways, taking turns: through its modules, through a plan of that layer alone, and as its native operators
called directly with slots made beforehand (all three checked to give the same bits).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))

TINY_WIDTHS = dict(vocab_size=2048, hidden_size=256, intermediate_size=256, moe_intermediate_size=128,
                   q_lora_rank=128, kv_lora_rank=128, qk_nope_head_dim=64, qk_rope_head_dim=64, v_head_dim=64)


def checkpoint() -> str:
    from model_core import BENCH_CONFIG

    from dsaserve.demo.checkpoint_builder import build_checkpoint

    path = os.path.join(os.environ.get("DSASERVE_BENCH_DIR", "/tmp/dsaserve-bench"), "glm52-structure-tiny")
    if not os.path.isfile(os.path.join(path, "model.safetensors")):
        build_checkpoint(path, seed=0, dtype=torch.bfloat16, **dict(BENCH_CONFIG, **TINY_WIDTHS))
    return path


def direct_layer(model, layer: int, x, cos, sin, meta, cache):
    """Layer `layer` (shared attention, MoE) as its native operators called one after another."""
    from dsaserve.quantization.packed_experts import routed_expert_args
    from dsaserve.quantization.quantized_weight import packed_args

    block = model.model.layers[layer]
    attn = block.self_attn
    ops = torch.ops.dsaserve
    norm, post = block.input_layernorm, block.post_attention_layernorm
    q = attn.query_binding()
    latents, output = attn.latents_binding(), attn.output_binding()
    mlp = block.mlp
    route = mlp.gate.binding().native_args
    experts, expert_tail = routed_expert_args(mlp.experts_gate_up, mlp.experts_down, mlp.shared_experts)
    rows = cache.view(-1, cache.shape[-1])
    slots = next(v for k, v in meta.derived.items() if k[0] == "causal rows").slots.contiguous()
    kv_args = (latents.kv.qweight, latents.kv.scale, *latents.kv.args)

    def run():
        h = ops.rms_norm.default(x, norm.weight, norm.eps)
        query, _ = ops.mla_query.default(h, *packed_args(q.q_a), q.q_norm, q.q_eps, *packed_args(q.q_b),
                                         *packed_args(q.w_uk), cos, sin, q.interleaved, q.heads, q.nope, q.rope)
        kv = ops.quant_linear.default(h, *kv_args)
        ops.write_latent_rows.default(kv, latents.norm, latents.eps, cos, sin, attn.rope_interleave, rows,
                                      meta.slot_mapping)
        wide = query.new_empty(query.shape[0], query.shape[1], rows.shape[1])
        out = wide[..., : attn.kv_lora_rank]
        ops.attend_selected_rows.default(query, rows, slots, attn.scale, out)
        y = ops.mla_output.default(out, *output.native_args)
        h2, x2 = ops.add_rms_norm.default(y, x, post.weight, post.eps)
        weights, ids = ops.moe_route.default(h2, *route)
        moe = torch.empty_like(h2)
        ops.moe_experts.default(h2, *experts, ids, weights, moe, *expert_tail)
        return x2 + moe

    return run


def through_modules(model, on: bool) -> None:
    """Whether the model (GlmMoeDsaModel) steps through its modules (its decode plan set aside) or its plan."""
    cache = model.__dict__.setdefault("_prepared_calls", {})
    if on:
        cache.setdefault("set aside", cache["decode plan"])
        cache["decode plan"] = None
    elif "set aside" in cache:
        cache["decode plan"] = cache.pop("set aside")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quantization", default="int4")
    parser.add_argument("--checkpoint", default=None)
    args = parser.parse_args()
    from dsaserve.engine.llm_engine import LLMEngine
    from dsaserve.engine_args import EngineArgs
    from dsaserve.model.decode_plan import DecodePlan
    from dsaserve.sampling_params import SamplingParams

    quantization = None if args.quantization == "none" else args.quantization
    engine = LLMEngine(EngineArgs(model=args.checkpoint or checkpoint(), kv_cache_memory="256MiB", max_model_len=4096,
                                  progress=False, quantization=quantization))
    model = engine.executor.driver.runner.model
    seen = {}
    forward_hidden = model.forward_hidden
    model.forward_hidden = lambda meta, kv, ic: seen.update(args=(meta, kv, ic)) or forward_hidden(meta, kv, ic)
    prompt = torch.randint(10, 2000, (128,), generator=torch.Generator().manual_seed(0)).tolist()
    engine.add_request("decode", prompt, SamplingParams(temperature=0, max_tokens=400, ignore_eos=True))
    for _ in range(10):
        engine.step()
    assert model.model.__dict__["_prepared_calls"]["decode plan"] is not None, "no decode plan here (not packed?)"
    steps = {"decode plan": [], "modules": []}
    for _ in range(150):
        for name in steps:
            through_modules(model.model, name == "modules")
            start = time.perf_counter()
            engine.step()
            steps[name].append((time.perf_counter() - start) * 1e3)
    through_modules(model.model, False)
    for name, t in steps.items():
        quartiles = statistics.quantiles(t)
        print(f"decode step, batch 1, {name}: median {statistics.median(t):.2f} ms (quartiles {quartiles[0]:.2f}–"
              f"{quartiles[2]:.2f})")
    meta, kv, ic = seen["args"]
    layer = next(i for i, t in enumerate(model.config.indexer_types) if t == "shared")
    with torch.inference_mode():
        x = model.model.embed_tokens(meta.input_ids, model.model.norm.weight.dtype)
        cos, sin = model.rotary.cos_sin(meta.positions, x.dtype, max(meta.seq_lens_host))
        _, topk = model.model.layers[layer - 1](x, cos, sin, meta, kv[layer - 1], ic.get(layer - 1), None)
        block = model.model.layers[layer]
        plan = DecodePlan.build([block])

        def modules():
            return block(x, cos, sin, meta, kv[layer], None, topk)[0]

        ways = {"through the modules": modules,
                "a plan of the layer": lambda: plan.run(x, cos, sin, meta, [kv[layer]], {}, topk)[0],
                "operators called directly": direct_layer(model, layer, x, cos, sin, meta, kv[layer])}
        first = modules()
        assert all(torch.equal(first, way()) for way in ways.values())
        times = {name: [] for name in ways}
        for _ in range(500):
            for name, way in ways.items():
                start = time.perf_counter()
                way()
                times[name].append((time.perf_counter() - start) * 1e6)
    for name, t in times.items():
        print(f"layer {layer} (shared attention, MoE) {name}: median {statistics.median(t):.1f} µs")


if __name__ == "__main__":
    main()
