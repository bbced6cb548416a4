"""A decoder layer's few-token step through its gathered native calls (model/decode_calls.py) gives what its
modules give: the same calls with the same arguments, so the same tokens and log-probabilities, bit for bit."""

import pytest
import torch

import dsaserve.model.decode_calls as decode_calls
import dsaserve.model.glm_moe_dsa as glm_moe_dsa
from dsaserve import LLM, SamplingParams
from dsaserve.native import torch_ops

needs_kernels = pytest.mark.skipif(torch_ops.cpu_kernels() != "avx512_bf16", reason="the packed-weight kernels need "
                                   "AVX-512 BF16 and the operators built: layers run through their modules here")


def generate(path, quantization, prompts):
    llm = LLM(path, dtype="bfloat16", block_size=16, max_model_len=256, progress=False, quantization=quantization)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=3)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs)
            for o in llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)]


@needs_kernels
@pytest.mark.parametrize("quantization", [None, "int4", "int8", "fp8"])
def test_gathered_calls_give_the_modules_tokens_and_logprobs(make_checkpoint, monkeypatch, quantization):
    """A dense first layer, MoE layers with a shared expert, full and shared attention layers; two requests
    decoding together past index_topk (16), so full layers score and select."""
    path = make_checkpoint("bf16", seed=0, dtype=torch.bfloat16)
    prompts = [torch.randint(3, 200, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (70, 41)]
    ran = []
    real = decode_calls.run_layer
    monkeypatch.setattr(decode_calls, "run_layer", lambda layer, *a: ran.append(layer.mlp.__class__.__name__)
                        or real(layer, *a))
    gathered = generate(path, quantization, prompts)
    assert {"GatedMLP", "MoE"} <= set(ran)  # both kinds of layer took their gathered calls
    monkeypatch.setattr(glm_moe_dsa, "DECODE_CALLS", False)
    ran.clear()
    assert generate(path, quantization, prompts) == gathered and not ran


@needs_kernels
def test_layers_whose_weights_are_not_packed_run_through_their_modules(make_checkpoint, monkeypatch):
    path = make_checkpoint("bf16", seed=0, dtype=torch.bfloat16)
    llm = LLM(path, dtype="float32", block_size=16, max_model_len=256, progress=False)  # fp32: torch's products
    llm.generate(prompt_token_ids=[[5, 6, 7]], sampling_params=SamplingParams(max_tokens=2), use_tqdm=False)
    layers = llm.engine.executor.driver.runner.model.model.layers
    assert all(layer.__dict__["_prepared_calls"]["decode calls"] is None for layer in layers)
