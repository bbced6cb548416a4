"""A decode step through its plan (model/decode_plan.py: the layers' native pieces, bound once) gives what the
modules give (enforce_eager): the same functions with the same arguments in the same order, so the same tokens and
log-probabilities, bit for bit; and the plan's order is the layer's forward, read from it."""

import gc
import json
import weakref
from pathlib import Path

import pytest
import torch
from conftest import NO_BODY, native_bodies

from dsaserve import LLM, SamplingParams
from dsaserve.attention.dense import DenseAttention
from dsaserve.attention.sparse import SparseAttention
from dsaserve.model.decode_plan import DecodePlan
from dsaserve.model.glm_moe_dsa import DecoderLayer
from dsaserve.native import index_scores as native_scores
from dsaserve.native import torch_ops

needs_kernels = pytest.mark.skipif(torch_ops.cpu_kernels() != "avx512_bf16", reason="the packed-weight kernels need "
                                   "AVX-512 BF16 and the operators built: layers run through their modules here")


def plan_cases() -> list:
    """(cpu_isa, dtype) of each body family this host runs a plan in: AVX-512 BF16 in bf16; AVX2 in bf16 and with
    dtype auto (fp32 activations, the bf16 weights kept packed: what a CPU without bf16 instructions computes in);
    AVX-512 without BF16 with dtype auto."""
    bodies = native_bodies()
    cases = [("avx512_bf16", "bfloat16")] if "avx512_bf16" in bodies else []
    cases += [("avx2", "bfloat16"), ("avx2", "auto")] if "avx2" in bodies else []
    cases += [("avx512", "auto")] if "avx512" in bodies else []  # (the AVX2 family, its products 512 bits wide)
    return [pytest.param(c, id=f"{c[0]}-{c[1]}") for c in cases] or [NO_BODY]


@pytest.fixture(params=plan_cases())
def plan_case(request):
    """The body family (cpu_isa) and dtype a plan runs in, chosen before the test asks what runs; the default after."""
    torch_ops.configure("auto", request.param[0])
    yield request.param
    torch_ops.configure("auto", "auto")


def generate(path, quantization, prompts, attention_backend="sparse", indexer_cache_dtype="auto",
             enforce_eager=False, case=("auto", "bfloat16")):
    cpu_isa, dtype = case
    llm = LLM(path, dtype=dtype, block_size=16, max_model_len=256, progress=False, quantization=quantization,
              attention_backend=attention_backend, indexer_cache_dtype=indexer_cache_dtype,
              enforce_eager=enforce_eager, cpu_isa=cpu_isa)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=3)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs)
            for o in llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)]


class CountedCalls:
    """A plan's native object with its run calls counted per step (a step starts at piece 0)."""

    def __init__(self, native, steps: list[int]):
        self.native, self.steps = native, steps

    def run(self, start, *args):
        if start == 0:
            self.steps.append(0)
        self.steps[-1] += 1
        return self.native.run(start, *args)

    def __getattr__(self, name):
        return getattr(self.native, name)


def count_native_calls(monkeypatch) -> tuple[list[int], list[DecodePlan]]:
    """Per decode step through a plan, its native run calls; and the plans built."""
    steps, plans, real_init = [], [], DecodePlan.__init__

    def init(self, *args):
        real_init(self, *args)
        self.native = CountedCalls(self.native, steps)
        plans.append(self)

    monkeypatch.setattr(DecodePlan, "__init__", init)
    return steps, plans


def prompts_of(lengths) -> list[list[int]]:
    return [torch.randint(3, 200, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in lengths]


PROMPTS = {"past index_topk": (70, 41), "within index_topk": (4, 3), "one past, one within": (70, 3)}


@pytest.mark.parametrize("quantization, indexer_keys", [(None, "auto"), ("int4", "auto"), ("int8", "auto"),
                                                         ("fp8", "model"), (None, "int8")])
@pytest.mark.parametrize("lengths", PROMPTS)
def test_the_plan_gives_the_modules_tokens_and_logprobs(make_checkpoint, monkeypatch, quantization, indexer_keys,
                                                        lengths, plan_case):
    """A dense first layer, MoE layers with a shared expert, full and shared attention layers; two requests
    decoding together: both past index_topk (16, so full layers score and select), both within it (every
    position attended), or one of each (the backend's own calls attend, as no single kernel call does). Indexer
    keys in bf16, or in int8 (written by the plan's keys pieces too where the int8 kernel's layout holds them); in
    fp32 on the AVX2 body, fp32 keys (written and scored in place by the plan too)."""
    if indexer_keys == "int8" and not native_scores.fits_int8(8, 32):
        pytest.skip("no int8 index-scores kernel here (needs AVX-512 VNNI): int8 keys stay plain, written by modules")
    path = make_checkpoint("bf16", seed=0, dtype=torch.bfloat16)
    config = json.loads((Path(path) / "config.json").read_text())
    steps, plans = count_native_calls(monkeypatch)
    one_call = []
    decode_slots = SparseAttention.decode_slots
    monkeypatch.setattr(SparseAttention, "decode_slots", lambda self, meta, topk: one_call.append(
        (slots := decode_slots(self, meta, topk)) is not None) or slots)
    planned = generate(path, quantization, prompts_of(PROMPTS[lengths]), indexer_cache_dtype=indexer_keys,
                       case=plan_case)
    plan = plans[0]
    assert len(plan.keys_bound) == config["indexer_types"].count("full")  # every full layer writes its keys
    # One native call per step where every request is within index_topk (every position selected, the slots chosen
    # once) or past it (the call selects; the backend is never asked); where the two requests need different rows,
    # a call up to each full layer's selection and to each layer's attention, which the backend makes.
    layers, full = config["num_hidden_layers"], config["indexer_types"].count("full")
    calls = {"within index_topk": 1, "past index_topk": 1, "one past, one within": 1 + full + layers}[lengths]
    assert steps[-9:] == [calls] * 9
    assert not any(one_call) if lengths == "one past, one within" else sum(one_call) == (
        9 if lengths == "within index_topk" else 0)
    steps.clear()
    assert generate(path, quantization, prompts_of(PROMPTS[lengths]), indexer_cache_dtype=indexer_keys,
                    enforce_eager=True, case=plan_case) == planned
    assert not steps  # enforce_eager: no plan, every step through the modules


@pytest.mark.parametrize("indexer_keys", ["auto", "int8"])
def test_a_step_past_index_topk_selects_in_its_call_as_python_selects_between_calls(make_checkpoint, monkeypatch,
                                                                                   indexer_keys, plan_case):
    """Every request past index_topk: the step is one call that makes each full layer's selection itself; with the
    selections made in Python between calls instead (one call up to each full layer's selection, then one), the
    same tokens and log-probabilities."""
    if indexer_keys == "int8" and not native_scores.fits_int8(8, 32):
        pytest.skip("no int8 index-scores kernel here (needs AVX-512 VNNI)")
    path = make_checkpoint("bf16", seed=0, dtype=torch.bfloat16)
    full = json.loads((Path(path) / "config.json").read_text())["indexer_types"].count("full")
    steps, _ = count_native_calls(monkeypatch)
    in_call = generate(path, None, prompts_of((70, 41)), indexer_cache_dtype=indexer_keys, case=plan_case)
    assert steps[-9:] == [1] * 9
    monkeypatch.setattr(DecodePlan, "_selection_in_call", lambda *a: None)
    steps.clear()
    assert generate(path, None, prompts_of((70, 41)), indexer_cache_dtype=indexer_keys, case=plan_case) == in_call
    assert steps[-9:] == [full + 1] * 9


@needs_kernels
@pytest.mark.parametrize("lengths", ["past index_topk", "within index_topk"])
def test_keys_without_a_native_form_are_written_by_the_indexer_between_calls(make_checkpoint, monkeypatch, lengths):
    """Where a full layer's keys have no native piece (here: its binding refused), the plan stops at each full
    layer's selection and the indexer writes the keys and selects in Python: one call up to each selection, then
    one; the same tokens and log-probabilities as the modules."""
    from dsaserve.model.indexer import Indexer

    path = make_checkpoint("bf16", seed=0, dtype=torch.bfloat16)
    full = json.loads((Path(path) / "config.json").read_text())["indexer_types"].count("full")
    monkeypatch.setattr(Indexer, "keys_binding", lambda self: None)
    steps, plans = count_native_calls(monkeypatch)
    planned = generate(path, "int8", prompts_of(PROMPTS[lengths]))
    assert not plans[0].keys_bound and steps[-9:] == [full + 1] * 9
    assert generate(path, "int8", prompts_of(PROMPTS[lengths]), enforce_eager=True) == planned


def test_dense_attention_decodes_in_one_call_with_the_modules_bits(make_checkpoint, monkeypatch, plan_case):
    path = make_checkpoint("bf16", seed=0, dtype=torch.bfloat16)
    steps, plans = count_native_calls(monkeypatch)
    one_call = []
    decode_slots = DenseAttention.decode_slots
    monkeypatch.setattr(DenseAttention, "decode_slots", lambda self, meta, topk: one_call.append(
        (slots := decode_slots(self, meta, topk)) is not None) or slots)
    planned = generate(path, "int4", prompts_of((70, 3)), "dense", case=plan_case)
    assert sum(one_call) >= 9 and steps[-9:] == [1] * 9  # (two requests of any lengths: every row over its context)
    assert not plans[0].selects_at and not plans[0].keys_bound  # the dense backend: no indexer pieces
    assert generate(path, "int4", prompts_of((70, 3)), "dense", enforce_eager=True, case=plan_case) == planned


@needs_kernels
def test_the_plan_follows_the_layers_forward(make_checkpoint, monkeypatch):
    """The plan's order is DecoderLayer.forward's, read from it: a forward with one more norm (the MLP's input
    normalized twice) is planned with that norm, giving the tokens the changed modules give, not the old ones."""
    path = make_checkpoint("bf16", seed=0, dtype=torch.bfloat16)
    plain = generate(path, "int8", prompts_of((70, 41)))

    def with_a_second_norm(self, x, cos, sin, meta, kv_cache, indexer_cache, prev_topk, run_indexer=True):
        attn, topk = self.self_attn(self.input_layernorm(x), cos, sin, meta, kv_cache, indexer_cache, prev_topk,
                                    run_indexer)
        h, x = self.post_attention_layernorm(attn, residual=x)
        return x + self.mlp(self.post_attention_layernorm(h)), topk

    monkeypatch.setattr(DecoderLayer, "forward", with_a_second_norm)
    steps, plans = count_native_calls(monkeypatch)
    planned = generate(path, "int8", prompts_of((70, 41)))
    assert steps[-9:] == [1] * 9 and [p.kind for _, p in plans[0].pieces].count("rms_norm") == 2 * len(
        plans[0].layers)
    assert planned == generate(path, "int8", prompts_of((70, 41)), enforce_eager=True)
    assert [tokens for tokens, _ in planned] != [tokens for tokens, _ in plain]


@needs_kernels
def test_a_forward_with_an_operation_no_piece_stands_for_runs_through_its_modules(make_checkpoint, monkeypatch):
    path = make_checkpoint("bf16", seed=0, dtype=torch.bfloat16)

    def with_a_tanh(self, x, cos, sin, meta, kv_cache, indexer_cache, prev_topk, run_indexer=True):
        attn, topk = self.self_attn(self.input_layernorm(x), cos, sin, meta, kv_cache, indexer_cache, prev_topk,
                                    run_indexer)
        h, x = self.post_attention_layernorm(torch.tanh(attn), residual=x)
        return x + self.mlp(h), topk

    monkeypatch.setattr(DecoderLayer, "forward", with_a_tanh)
    steps, plans = count_native_calls(monkeypatch)
    llm = LLM(path, dtype="bfloat16", block_size=16, max_model_len=256, progress=False, quantization="int8")
    llm.generate(prompt_token_ids=[[5, 6, 7]], sampling_params=SamplingParams(max_tokens=3), use_tqdm=False)
    assert not plans and not steps
    assert llm.engine.executor.driver.runner.model.model.__dict__["_prepared_calls"]["decode plan"] is None


@needs_kernels
def test_layers_whose_weights_are_not_packed_have_no_plan(make_checkpoint):
    path = make_checkpoint("bf16", seed=0, dtype=torch.bfloat16)
    llm = LLM(path, dtype="float32", block_size=16, max_model_len=256, progress=False)  # fp32: torch's products
    llm.generate(prompt_token_ids=[[5, 6, 7]], sampling_params=SamplingParams(max_tokens=2), use_tqdm=False)
    assert llm.engine.executor.driver.runner.model.model.__dict__["_prepared_calls"]["decode plan"] is None


@needs_kernels
def test_a_plan_holds_its_weights_only_while_its_model_lives(make_checkpoint):
    """The native plan keeps references to the weights it binds; they go with the model (no registry outlives it)."""
    path = make_checkpoint("bf16", seed=0, dtype=torch.bfloat16)
    llm = LLM(path, dtype="bfloat16", block_size=16, max_model_len=256, progress=False, quantization="int4")
    llm.generate(prompt_token_ids=[[5, 6, 7]], sampling_params=SamplingParams(max_tokens=3), use_tqdm=False)
    model = llm.engine.executor.driver.runner.model
    plan = model.model.__dict__["_prepared_calls"]["decode plan"]
    assert plan is not None and plan.native.size() == len(plan.pieces)
    bound = weakref.ref(model.model.layers[0].input_layernorm.weight)
    del llm, model, plan
    gc.collect()
    assert bound() is None
