"""Trained against random selections, on the same geometry: how much 64 neighbouring queries' top-k
overlap, and what that does to sparse against dense prefill and decode, in one run.

    python benchmarks/demo_selections.py [--context 8192] [--prefill-lens 4096,8192,16000]
                                         [--decode-lens 8192,16000] [--windows 64] [--unions-only]
                                         [--output-json F]

The random twin has the trained demo's config.json and tokenizer and random weights
(`random_weights`, as the test fixtures). Both read the same synthetic document (the text the
trained model learned on). Union size: for windows of 64 consecutive queries (or `--windows`: 4 is the
Triton path's tile at 8 heads, triton_ops/union_rows.py) ending at 4K, 5K, 6K, 7K and 8K, the number of
distinct rows in their selections, per full layer, averaged. Then (unless `--unions-only`)
`dsaserve bench longctx`'s measurement runs for both models with document prompts, in the same
process one after the other (within a model, the dense and sparse engines take turns at every point).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile

import torch

from dsaserve import LLM, SamplingParams
from dsaserve.bench.longctx import document_ids, run
from dsaserve.config import ModelConfig
from dsaserve.demo import demo_model_dir
from dsaserve.demo.checkpoint_builder import random_weights, save_checkpoint
from dsaserve.engine_args import EngineArgs


def random_twin(trained: str, target: str, seed: int = 0) -> str:
    with open(os.path.join(trained, "config.json")) as f:
        raw = json.load(f)
    cfg = ModelConfig.from_dict(raw)
    save_checkpoint(target, raw, random_weights(cfg, seed=seed, include_mtp=True), dtype=torch.bfloat16)
    for name in os.listdir(trained):
        if not name.endswith(".safetensors") and name != "config.json":
            shutil.copy(os.path.join(trained, name), target)
    return target


def selections(model: str, ids: list[int]) -> dict[int, torch.Tensor]:
    """Each full layer's top-k rows for every prompt position, over the chunks of one prefill."""
    llm = LLM(model, max_model_len=len(ids) + 64, progress=False, enable_prefix_caching=False)
    chunks: dict[int, list[torch.Tensor]] = {}
    hooks = [layer.self_attn.indexer.register_forward_hook(
        lambda module, args, out, i=i: chunks.setdefault(i, []).append(out.clone()))
        for i, layer in enumerate(llm.engine.model.model.layers) if layer.self_attn.indexer is not None]
    llm.generate(prompt_token_ids=[ids], sampling_params=SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    for h in hooks:
        h.remove()
    return {i: torch.cat(parts)[: len(ids)] for i, parts in chunks.items()}


def mean_union(topk: dict[int, torch.Tensor], ends: list[int], window_rows: int) -> float:
    sizes = []
    for rows in topk.values():
        for end in ends:
            window = rows[end - window_rows : end]
            sizes.append(torch.unique(window[window >= 0]).numel())
    return statistics.mean(sizes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--context", type=int, default=8192)
    parser.add_argument("--prefill-lens", default="4096,8192,16000")
    parser.add_argument("--decode-lens", default="8192,16000")
    parser.add_argument("--windows", default="64", help="queries per window, comma-separated")
    parser.add_argument("--unions-only", action="store_true", help="skip the prefill and decode timings")
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args()
    windows = [int(w) for w in args.windows.split(",") if w]
    trained = demo_model_dir()
    twin = random_twin(trained, tempfile.mkdtemp(prefix="demo-random-twin-"))
    models = {"trained": trained, "random": twin}
    tok = LLM(trained, progress=False).tokenizer
    ids = document_ids(tok, args.context, seed=5)
    ends = [n for n in range(4096, args.context + 1, 1024)]
    results = {"index_topk": ModelConfig.from_pretrained(trained).index_topk}
    for name, path in models.items():
        topk = selections(path, ids)
        for w in windows:
            union = results.setdefault(f"union_of_{w}_queries", {})
            union[name] = mean_union(topk, ends, w)
            print(f"{name:8s} union of {w} neighbouring queries' top-{results['index_topk']}, at 4-"
                  f"{args.context // 1024}K visible: {union[name]:.0f} rows ({union[name] / results['index_topk']:.2f}"
                  f" × the width, {union[name] / (w * results['index_topk']):.2f} of the rows read per query)",
                  flush=True)
    if not args.unions_only:
        timings(models, args, results)
    shutil.rmtree(twin, ignore_errors=True)
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(results, f, indent=1)


def timings(models: dict[str, str], args, results: dict) -> None:
    """bench longctx's prefill and decode measurements for each model, dense and sparse."""
    lens = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    for name, path in models.items():
        longest = max(lens(args.prefill_lens) + lens(args.decode_lens)) + 64
        engine_args = EngineArgs(model=path,
                                 max_model_len=min(longest, ModelConfig.from_pretrained(path).max_position_embeddings))
        results[name] = run(engine_args, ["dense", "sparse"], lens(args.decode_lens), lens(args.prefill_lens), 8,
                            prompt_source="document")
    print("\nprefill time to first token, s (dense / sparse = speedup):")
    for n in lens(args.prefill_lens):
        cells = [f"{name} {results[name]['prefill_ttft_s']['dense'][n]:6.2f} / "
                 f"{results[name]['prefill_ttft_s']['sparse'][n]:6.2f} = "
                 f"{results[name]['prefill_ttft_s']['dense'][n] / results[name]['prefill_ttft_s']['sparse'][n]:4.2f}x"
                 for name in models]
        print(f"  {n:6d}: " + "   ".join(cells))
    print("decode ms/token on a synthetic cache (dense / sparse):")
    for n in lens(args.decode_lens):
        cells = [f"{name} {results[name]['decode_ms_per_token']['dense'][n]:6.1f} / "
                 f"{results[name]['decode_ms_per_token']['sparse'][n]:6.1f}" for name in models]
        print(f"  {n:6d}: " + "   ".join(cells))


if __name__ == "__main__":
    main()
