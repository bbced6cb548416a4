"""The command line: doctor on a config-only directory and on checkpoints, generate, the demo model."""

import os
import re
import shutil
import subprocess
import sys

import pytest
from conftest import REFERENCE_CONFIG
from safetensors.torch import load_file, save_file

from dsaserve import LLM, SamplingParams
from dsaserve.demo import RANDOM_DEMO_VERSION
from dsaserve.native import index_scores as native_scores


def run(*args, env=None):
    return subprocess.run([sys.executable, "-m", "dsaserve", *args], capture_output=True, text=True, env=env,
                          timeout=300)


def test_doctor_on_config_only_glm52(tmp_path):
    shutil.copy(REFERENCE_CONFIG, tmp_path / "config.json")
    result = run("doctor", str(tmp_path))
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "FFFSSSFSSSF" in out and "21 full / 57 shared, from indexer_types" in out
    assert "WARNING: index_topk_pattern is null" in out
    assert '--hf-overrides \'{"index_topk_pattern": "FFFSSS' in out
    assert "weights: none in this directory" in out
    assert "743.38B params" in out  # GLM-5.2 without its MTP layer
    # latent 78 × 576 × 2 B + indexer keys on 21 full layers × 128 × 2 B
    assert "latent: 78 layers × 576 × 2 B = 87.8 KiB" in out
    assert "indexer keys: 21 full layers × 128 × 2 B = 5.2 KiB" in out
    assert "KV cache per token (bfloat16): 93.0 KiB" in out
    assert "triton kernels: off here (no CUDA device" in out  # which kernels the default runs, and how to change it
    # What a CUDA engine would capture: the default batch sizes × context buckets up to the config's longest context.
    assert ("CUDA graphs: on CUDA with the Triton kernels, decode batch sizes 1,2,4,8,16,32,64,128,256 "
            "(--cuda-graph-sizes; the default for --max-num-seqs 256) × contexts up to 4096,16384,65536,262144,"
            "1048576 tokens (max_model_len 1048576): 45 graphs") in out
    # Each form's resident size and, beside it, the peak the load expects (resident + the threads' scratch).
    for form, resident in (("bf16, float", 1.4 * 1024), ("fp8", 714.3), ("int8", 693.4), ("int4", 368.6)):
        line = next(x for x in out.splitlines() if x.strip().startswith(form + " "))
        peak = re.search(r"peak while loading ([\d.]+) (GiB|TiB)", line)
        assert peak, line
        assert float(peak[1]) * (1024 if peak[2] == "TiB" else 1) >= resident, line


def test_doctor_on_config_only_deepseek_v32(tmp_path):
    """tests/data/deepseek-v3.2-config.json (DeepSeek-V3.2's published config.json; its fields equal the
    transformers defaults): every layer runs its indexer, so every layer also caches indexer keys, in int8 (the
    checkpoint is FP8, and indexer_cache_dtype auto keeps 8-bit keys for FP8 weights)."""
    shutil.copy(os.path.join(os.path.dirname(REFERENCE_CONFIG), "deepseek-v3.2-config.json"),
                tmp_path / "config.json")
    result = run("doctor", str(tmp_path))
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "F" * 61 in out and "61 full / 0 shared, from deepseek_v32 (every layer runs its indexer)" in out
    assert "to pin this schedule" not in out  # no IndexShare to pin
    assert "index_topk 2048, indexer 64 heads × 128" in out
    assert "rope: yarn, theta 10000, factor 40" in out
    assert "671.88B params" in out  # DeepSeek-V3's 671B without its MTP layer
    assert "latent: 61 layers × 576 × 2 B = 68.6 KiB" in out
    assert "indexer keys: 61 full layers × (128 × 1 B + a 2 B scale: int8 keys, as FP8 weights get by default) = " \
        "7.7 KiB" in out
    assert "KV cache per token (bfloat16): 76.4 KiB" in out
    if native_scores.fits_int8(64, 128):  # where an int8 scoring body runs, doctor names why the keys are int8
        assert "int8 key caches (auto's choice for this FP8 checkpoint)" in out


def test_doctor_on_config_only_glm53(tmp_path):
    """tests/data/glm-5.3-config.json: GLM-5.2's config grown by one MoE layer to the published 753B (same 1M
    context, same per-layer geometry); its schedule comes from its own indexer_types."""
    shutil.copy(os.path.join(os.path.dirname(REFERENCE_CONFIG), "glm-5.3-config.json"), tmp_path / "config.json")
    result = run("doctor", str(tmp_path))
    assert result.returncode == 0, result.stderr
    assert "22 full / 57 shared, from indexer_types" in result.stdout
    assert "753.25B params" in result.stdout


def test_doctor_on_config_only_glm53_flash(tmp_path):
    """tests/data/glm-5.3-flash-config.json (glm5_next, transformers' defaults): layer kinds, the schedule over the
    indexed layers, NoPE, KV per token on the 11 indexed layers and the KDA state per request."""
    shutil.copy(os.path.join(os.path.dirname(REFERENCE_CONFIG), "glm-5.3-flash-config.json"), tmp_path / "config.json")
    result = run("doctor", str(tmp_path))
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "layer kinds: " + "KKKA" * 11 + "K (34 KDA / 11 indexed attention, from layer_types)" in out
    assert "11 full / 0 shared, from indexer_types" in out
    assert "scored in pools of 16 tokens (128 pools kept" in out
    assert "rope: none (NoPE attention: qk_rope_head_dim 0)" in out
    assert "313.33B params" in out  # "about 310B"
    assert "latent: 11 layers × 512 × 2 B = 11.0 KiB" in out
    assert "indexer keys: 11 full layers × (2 × 128 + 128 / 16) × 2 B = 5.7 KiB" in out
    assert "KDA state per request (fp32, the same at any context length): 145.6 MiB" in out
    assert "graphs captured at start-up in one memory pool; verify steps run eagerly (they keep the KDA state" in out
    assert "prefix-cache snapshots: 145.6 MiB each, one every 512 tokens" in out
    for form in ("bf16, float     583.7 GiB", "fp8             301.1 GiB", "int8            292.4 GiB",
                 "int4            155.5 GiB"):
        assert form in out


def test_doctor_per_rank_plan_on_glm53_flash(tmp_path):
    """TP=8 with expert parallelism on GLM-5.3-Flash: KDA and MLA heads split, whole experts placed, the KDA state
    split by heads (145.6 MiB / 8); decode context parallelism refused by name."""
    shutil.copy(os.path.join(os.path.dirname(REFERENCE_CONFIG), "glm-5.3-flash-config.json"), tmp_path / "config.json")
    result = run("doctor", str(tmp_path), "--tensor-parallel-size", "8", "--enable-expert-parallel")
    assert result.returncode == 0, result.stderr
    assert "heads 56-63, vocab rows 135520-154879, experts 252-287" in result.stdout
    assert "KDA state per request per rank: 18.2 MiB (its heads are split: 1/8 of the state)" in result.stdout
    refused = run("doctor", str(tmp_path), "--tensor-parallel-size", "8", "--decode-context-parallel-size", "2")
    assert refused.returncode != 0
    assert "decode_context_parallel_size=2: GLM-5.3-Flash does not split its context" in refused.stderr


def test_doctor_checks_tensors_against_schedule(tiny_checkpoint, tmp_path):
    good = run("doctor", tiny_checkpoint)
    assert good.returncode == 0
    assert "indexer weights on all 2 full layers and on none of the 2 shared layers" in good.stdout
    bad = tmp_path / "bad"
    shutil.copytree(tiny_checkpoint, bad)
    file = bad / "model.safetensors"
    tensors = load_file(str(file))
    for name in [n for n in tensors if n.startswith("model.layers.1.self_attn.indexer.")]:
        tensors[name.replace("layers.1.", "layers.2.")] = tensors.pop(name)
    save_file(tensors, str(file))
    result = run("doctor", str(bad))
    assert result.returncode == 1
    assert "full layers without indexer weights: [1]" in result.stdout
    assert "shared layers carrying indexer weights: [2]" in result.stdout


def test_generate_prints_the_completion(tiny_checkpoint):
    result = run("generate", tiny_checkpoint, "--prompt", "hello there", "--max-tokens", "6", "--dtype", "float32",
                 "--ignore-eos", "--block-size", "16", "--max-model-len", "256")
    assert result.returncode == 0, result.stderr
    llm = LLM(tiny_checkpoint, dtype="float32", block_size=16, max_model_len=256, progress=False)
    expected = llm.generate("hello there", SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    assert result.stdout.rstrip("\n") == expected[0].outputs[0].text


def test_generate_reports_bad_arguments(tiny_checkpoint):
    result = run("generate", tiny_checkpoint, "--hf-overrides", "{not json", "--prompt", "x")
    assert result.returncode == 2 and "--hf-overrides" in result.stderr and "Traceback" not in result.stderr


def test_demo_model_generates_without_a_checkpoint():
    result = run("generate", "--prompt",
                 "[gMASK]<sop><|user|>\nRepeat after me: pine river lotus comet<|assistant|></think>",
                 "--max-tokens", "12")
    assert result.returncode == 0, result.stderr
    assert result.stdout == "pine river lotus comet\n"
    assert "indexer schedule from indexer_types: FFSFSS" in result.stderr


def test_random_demo_is_built_once_into_the_cache(tmp_path):
    env = dict(os.environ, DSASERVE_CACHE=str(tmp_path))
    code = "from dsaserve.demo import random_demo_dir; print(random_demo_dir())"
    first = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert first.stdout.strip() == str(tmp_path / f"demo-random-v{RANDOM_DEMO_VERSION}")
    assert os.path.isfile(tmp_path / f"demo-random-v{RANDOM_DEMO_VERSION}" / "tokenizer.json")


@pytest.mark.parametrize("flags", [[], ["--random"]], ids=["shipped", "random"])
def test_demo_checkpoint_loads_unchanged_in_the_reference(tmp_path, flags):
    import torch
    from reference import dsaserve_forward, load_reference, reference_forward

    path = str(tmp_path / "demo")
    assert run("build-demo", path, *flags).returncode == 0
    ref = load_reference(path)
    ids = LLM(path, progress=False).tokenizer.encode("[gMASK]<sop><|user|>\nHello<|assistant|>")
    assert ids[0] == 2  # GLM special tokens are single tokens
    ours, expected = dsaserve_forward(path, ids), reference_forward(ref, ids)
    assert torch.allclose(ours.logprobs, expected.logprobs, atol=1e-4)


def test_bench_throughput_and_latency_report(tiny_checkpoint, tmp_path):
    import json

    common = [tiny_checkpoint, "--dtype", "float32", "--block-size", "16", "--max-model-len", "256",
              "--input-len", "20", "--output-len", "5"]
    result = run("bench", "throughput", *common, "--num-prompts", "3", "--output-json", str(tmp_path / "t.json"))
    assert result.returncode == 0, result.stderr
    data = json.loads((tmp_path / "t.json").read_text())
    assert data["num_prompts"] == 3 and data["output_tokens_per_s"] > 0 and "requests_per_s" in result.stdout
    result = run("bench", "latency", *common, "--num-iters", "2", "--output-json", str(tmp_path / "l.json"))
    assert result.returncode == 0, result.stderr
    data = json.loads((tmp_path / "l.json").read_text())
    assert data["iters"] == 2 and data["ttft_ms_mean"] > 0 and data["tpot_ms_mean"] > 0


def test_engine_options_are_the_same_flags_everywhere():
    import dataclasses

    from dsaserve.cli import build_parser
    from dsaserve.engine_args import NOT_ON_CLI, EngineArgs

    parser = build_parser()
    for command in (["serve"], ["generate"], ["bench", "throughput"], ["bench", "latency"]):
        args = EngineArgs.from_cli_args(parser.parse_args(command + [
            "/ckpt", "--max-num-seqs", "3", "--no-enable-prefix-caching", "--kv-cache-memory", "2GiB",
            "--hf-overrides", '{"index_topk": 8}', "--attention-backend", "dense"]))
        assert args.model == "/ckpt" and args.max_num_seqs == 3 and args.enable_prefix_caching is False
        assert args.kv_cache_bytes == 2 << 30 and args.hf_overrides == '{"index_topk": 8}'
        assert args.attention_backend == "dense" and args.enable_chunked_prefill is True
        defaults = EngineArgs.from_cli_args(parser.parse_args(command))
        for field in dataclasses.fields(EngineArgs):
            if field.name not in NOT_ON_CLI:
                assert getattr(defaults, field.name) == field.default, (command, field.name)
    longctx = EngineArgs.from_cli_args(parser.parse_args(["bench", "longctx", "--block-size", "16"]))
    assert longctx.block_size == 16  # the backend and prefix caching are the benchmark's own choice


def test_engine_args_name_the_bad_value():
    from dsaserve.engine_args import EngineArgs

    for kwargs, field in (({"max_num_seqs": 0}, "max_num_seqs"), ({"kv_cache_memory": "lots"}, "kv_cache_memory"),
                          ({"tensor_parallel_size": 0}, "tensor_parallel_size"),
                          ({"tensor_parallel_size": 2, "decode_context_parallel_size": 3},
                           "decode_context_parallel_size"),
                          ({"page_budget": 0}, "page_budget")):
        try:
            EngineArgs(**kwargs)
        except ValueError as e:
            assert field in str(e)
        else:
            raise AssertionError(f"{kwargs} was accepted")


def test_bench_longctx_prefills_demo_documents(tiny_checkpoint):
    """--prompt-source document: the prefill prompt is the demo's synthetic document, cut to length."""
    from dsaserve.bench.longctx import document_ids
    from dsaserve.tokenizer import Tokenizer

    tok = Tokenizer(tiny_checkpoint)
    ids = document_ids(tok, 300, seed=1)
    assert len(ids) == 300 and "The code for" in tok.decode(ids)
    result = run("bench", "longctx", tiny_checkpoint, "--backends", "dense,sparse", "--decode-lens", "",
                 "--prefill-lens", "96", "--prompt-source", "document", "--dtype", "float32")
    assert result.returncode == 0, result.stderr
    assert "prefill time to first token" in result.stdout and "sparse" in result.stdout
    assert "decode ms/token" not in result.stdout  # no decode lengths asked for: no empty section
