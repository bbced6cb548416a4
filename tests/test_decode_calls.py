"""A decoder layer's few-token step through its gathered native calls (model/decode_calls.py) gives what its
modules give: the same calls with the same arguments, so the same tokens and log-probabilities, bit for bit."""

import json
from pathlib import Path

import pytest
import torch

import dsaserve.model.decode_calls as decode_calls
import dsaserve.model.glm_moe_dsa as glm_moe_dsa
from dsaserve import LLM, SamplingParams
from dsaserve.attention.dense import DenseAttention
from dsaserve.attention.sparse import SparseAttention
from dsaserve.model.indexer import Indexer
from dsaserve.native import index_scores as native_scores
from dsaserve.native import torch_ops

needs_kernels = pytest.mark.skipif(torch_ops.cpu_kernels() != "avx512_bf16", reason="the packed-weight kernels need "
                                   "AVX-512 BF16 and the operators built: layers run through their modules here")


def generate(path, quantization, prompts, attention_backend="sparse", indexer_cache_dtype="auto"):
    llm = LLM(path, dtype="bfloat16", block_size=16, max_model_len=256, progress=False, quantization=quantization,
              attention_backend=attention_backend, indexer_cache_dtype=indexer_cache_dtype)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=3)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs)
            for o in llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)]


def count_native_calls(monkeypatch) -> list[int]:
    """Per run_layers call (a decode step through the gathered calls), its decode_layers calls, appended as they run."""
    steps, real_run_layers, real_op = [], decode_calls.run_layers, torch.ops.dsaserve.decode_layers

    def run_layers(*a):
        steps.append(0)
        return real_run_layers(*a)

    class CountedOp:
        def default(self, *a):
            steps[-1] += 1
            return real_op.default(*a)

    monkeypatch.setattr(decode_calls, "run_layers", run_layers)
    monkeypatch.setattr(torch.ops.dsaserve, "decode_layers", CountedOp())
    return steps


PROMPTS = {"past index_topk": (70, 41), "within index_topk": (4, 3), "one past, one within": (70, 3)}


@needs_kernels
@pytest.mark.parametrize("quantization, indexer_keys", [(None, "auto"), ("int4", "auto"), ("int8", "auto"),
                                                         ("fp8", "auto"), (None, "int8")])
@pytest.mark.parametrize("lengths", PROMPTS)
def test_gathered_calls_give_the_modules_tokens_and_logprobs(make_checkpoint, monkeypatch, quantization, indexer_keys,
                                                             lengths):
    """A dense first layer, MoE layers with a shared expert, full and shared attention layers; two requests
    decoding together: both past index_topk (16, so full layers score and select), both within it (every
    position attended), or one of each (the backend's own calls attend, as no single kernel call does). Indexer
    keys in bf16, or in int8 (written in the in half too where the int8 kernel's layout holds them)."""
    if indexer_keys == "int8" and not native_scores.fits_int8(8, 32):
        pytest.skip("no int8 index-scores kernel here (needs AVX-512 VNNI): int8 keys stay plain, written by modules")
    path = make_checkpoint("bf16", seed=0, dtype=torch.bfloat16)
    prompts = [torch.randint(3, 200, (n,), generator=torch.Generator().manual_seed(n)).tolist()
               for n in PROMPTS[lengths]]
    config = json.loads((Path(path) / "config.json").read_text())
    steps, one_call, keys_in_call = count_native_calls(monkeypatch), [], []
    decode_slots = SparseAttention.decode_slots
    monkeypatch.setattr(SparseAttention, "decode_slots", lambda self, meta, topk: one_call.append(
        (slots := decode_slots(self, meta, topk)) is not None) or slots)
    key_groups = decode_calls._key_groups
    monkeypatch.setattr(decode_calls, "_key_groups", lambda *a: (g := key_groups(*a))[0] is not None
                        and keys_in_call.append(g[1] is not None) or g)
    gathered = generate(path, quantization, prompts, indexer_cache_dtype=indexer_keys)
    assert keys_in_call and all(keys_in_call) == (indexer_keys == "int8")  # written in the in half, int8 or bf16
    # Decode steps attend in the out halves (prompt rows never), but where the two requests need different rows;
    # the slots are chosen once per step (within index_topk), or in the call with each full layer's selection (past
    # it: the backend is never asked).
    layers = config["num_hidden_layers"]
    assert not any(one_call) if lengths == "one past, one within" else sum(one_call) == (
        9 if lengths == "within index_topk" else 0)
    # One native call per step where every request is within index_topk (every position selected) or past it (the
    # call selects), a call per layer where the backend attends.
    calls = {"within index_topk": 1, "past index_topk": 1, "one past, one within": layers}[lengths]
    assert steps[-9:] == [calls] * 9
    monkeypatch.setattr(glm_moe_dsa, "DECODE_CALLS", False)
    steps.clear()
    assert generate(path, quantization, prompts, indexer_cache_dtype=indexer_keys) == gathered and not any(steps)


@needs_kernels
@pytest.mark.parametrize("indexer_keys", ["auto", pytest.param("int8", marks=pytest.mark.skipif(
    not native_scores.fits_int8(8, 32), reason="no int8 index-scores kernel here (needs AVX-512 VNNI)"))])
def test_a_step_past_index_topk_selects_in_its_call_as_python_selects_between_runs(make_checkpoint, monkeypatch,
                                                                                  indexer_keys):
    """Every request past index_topk: the step is one call that makes each full layer's selection itself; with the
    selections made in Python between runs of layers instead (one call per full layer, then one), the same tokens
    and log-probabilities."""
    path = make_checkpoint("bf16", seed=0, dtype=torch.bfloat16)
    prompts = [torch.randint(3, 200, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (70, 41)]
    full = json.loads((Path(path) / "config.json").read_text())["indexer_types"].count("full")
    steps = count_native_calls(monkeypatch)
    in_call = generate(path, None, prompts, indexer_cache_dtype=indexer_keys)
    assert steps[-9:] == [1] * 9
    monkeypatch.setattr(decode_calls, "_selection_in_call", lambda *a: None)
    steps.clear()
    assert generate(path, None, prompts, indexer_cache_dtype=indexer_keys) == in_call
    assert steps[-9:] == [full + 1] * 9


@needs_kernels
def test_dense_attention_decodes_in_one_call_with_the_modules_bits(make_checkpoint, monkeypatch):
    path = make_checkpoint("bf16", seed=0, dtype=torch.bfloat16)
    prompts = [torch.randint(3, 200, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (70, 3)]
    one_call = []
    decode_slots = DenseAttention.decode_slots
    monkeypatch.setattr(DenseAttention, "decode_slots", lambda self, meta, topk: one_call.append(
        (slots := decode_slots(self, meta, topk)) is not None) or slots)
    gathered = generate(path, "int4", prompts, "dense")
    assert sum(one_call) >= 9  # (two requests of any lengths: every row over its whole context)
    monkeypatch.setattr(glm_moe_dsa, "DECODE_CALLS", False)
    assert generate(path, "int4", prompts, "dense") == gathered


@needs_kernels
def test_layers_whose_weights_are_not_packed_run_through_their_modules(make_checkpoint, monkeypatch):
    path = make_checkpoint("bf16", seed=0, dtype=torch.bfloat16)
    llm = LLM(path, dtype="float32", block_size=16, max_model_len=256, progress=False)  # fp32: torch's products
    llm.generate(prompt_token_ids=[[5, 6, 7]], sampling_params=SamplingParams(max_tokens=2), use_tqdm=False)
    layers = llm.engine.executor.driver.runner.model.model.layers
    assert all(layer.__dict__["_prepared_calls"]["decode calls"] is None for layer in layers)


@needs_kernels
def test_bound_layers_are_released_with_their_model(make_checkpoint):
    """A layer's weights bound to a native handle stay referenced there until the model goes; a released handle
    is refused by name, not read."""
    import gc

    path = make_checkpoint("bf16", seed=0, dtype=torch.bfloat16)
    llm = LLM(path, dtype="bfloat16", block_size=16, max_model_len=256, progress=False, quantization="int4")
    llm.generate(prompt_token_ids=[[5, 6, 7]], sampling_params=SamplingParams(max_tokens=3), use_tqdm=False)
    layers = llm.engine.executor.driver.runner.model.model.layers
    handles = [layer.__dict__["_prepared_calls"]["decode calls"].bound.handle for layer in layers]
    assert len(set(handles)) == len(layers) and set(handles) <= set(torch_ops.BOUND_LAYER_SHAPES)
    x = torch.zeros(1, 8, dtype=torch.bfloat16)
    del llm, layers
    gc.collect()
    assert not set(handles) & set(torch_ops.BOUND_LAYER_SHAPES)
    with pytest.raises(RuntimeError, match=f"no bound layer {handles[0]}"):
        torch.ops.dsaserve.decode_layers.default([handles[0]], x, x, x, [x], x, [None], [])
