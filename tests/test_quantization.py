"""Quantized weights in the model: a quantized checkpoint against its dequantized twin (the same weights
as floats) over 1,024 greedy tokens, an FP8 checkpoint kept as shipped against the old dequantize-at-load
path, what is packed and what is not, the bytes it holds, and the flag's errors."""

import pytest
import torch

import dsaserve.quantization.apply as apply
from dsaserve import LLM, SamplingParams
from dsaserve.config import ModelConfig
from dsaserve.model import load_model
from dsaserve.model.weight_bytes import resident_bytes
from dsaserve.quantization.formats import QUANTIZATION_MODES
from dsaserve.quantization.int8_rows import Int8Rows
from dsaserve.quantization.packed import is_packed
from dsaserve.quantization.quantized_weight import ROWS, QuantizedWeight

# 40-token steps: the prompts' first chunks need no logits at all (lm_head gets no rows).
BASE = dict(dtype="float32", block_size=16, progress=False, max_model_len=512, max_num_batched_tokens=40)
GREEDY = SamplingParams(temperature=0, max_tokens=256, ignore_eos=True, logprobs=1)
PROMPTS = [list(range(40 + 9 * i, 117 + 9 * i)) for i in range(4)]  # 4 × 256 = 1,024 generated tokens


def generate(llm):
    outs = llm.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY, use_tqdm=False)
    return ([o.outputs[0].token_ids for o in outs],
            [[p[t].logprob for p, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)] for o in outs])


def float_llm(path, monkeypatch, **kwargs):
    """The same checkpoint with float weights and torch's matmuls (the kernels switched off)."""
    with monkeypatch.context() as m:
        m.setattr(apply, "kernels_here", lambda device: False)
        return LLM(path, **{**BASE, **kwargs})


def twin_of(quantized: LLM, path, monkeypatch) -> LLM:
    """A float model holding exactly the quantized model's weights, dequantized from its buffers in torch, and
    keeping its indexer keys as the quantized one does (auto gives FP8 weights 8-bit keys)."""
    keys = getattr(next(iter(quantized.engine.kv_cache.indexer.values())), "kind", "auto")  # pooled keys: one kind
    twin = float_llm(path, monkeypatch, indexer_cache_dtype=keys)
    params = dict(twin.engine.model.named_parameters())
    with torch.no_grad():
        for name, module in quantized.engine.model.named_modules():
            if isinstance(module, Int8Rows):
                params[name].copy_(module.qweight.float() * module.scale)
            if isinstance(module, QuantizedWeight):
                target = params[name]
                for e in range(target.shape[0]) if target.dim() == 3 else [None]:
                    weight = module.matrix(e).dequantize(torch.float32)  # torch's unpacking, either layout
                    if name.endswith(".w_uk"):  # packed as its transpose
                        weight = weight.T
                    (target if e is None else target[e]).copy_(weight)
    return twin


def assert_same_outputs(ours, theirs):
    assert ours[0] == theirs[0]
    diff = max(abs(a - b) for x, y in zip(ours[1], theirs[1]) for a, b in zip(x, y))
    assert diff < 1e-4, f"logprobs differ by {diff:.2e}"


@pytest.mark.parametrize("mode", QUANTIZATION_MODES)
def test_quantized_model_equals_its_dequantized_twin(tiny_checkpoint, monkeypatch, mode, body):
    """Per body family this host runs (cpu_isa): the AVX2 body's int16 activations included."""
    llm = LLM(tiny_checkpoint, quantization=mode, cpu_isa=body, **BASE)
    packed = [m for m in llm.engine.model.modules() if isinstance(m, QuantizedWeight)]
    assert packed and all(m.kind == mode for m in packed)
    assert_same_outputs(generate(llm), generate(twin_of(llm, tiny_checkpoint, monkeypatch)))


def test_without_a_native_body_int8_weights_keep_torchs_row_layout(tiny_checkpoint, monkeypatch):
    """No native body (native_kernels off): int8 weights whose width torch's int8 matmul takes are [N, K] with a
    scale per row, multiplied by it (bf16 activations and scales) up to 16 rows and by dequantized slabs beyond; the
    model stays near its dequantized twin (fp32 activations throughout)."""
    llm = LLM(tiny_checkpoint, quantization="int8", native_kernels="off", **BASE)
    rows = [m for m in llm.engine.model.modules() if isinstance(m, QuantizedWeight) and m.in_features % 64 == 0]
    assert len(rows) > 10 and all(m.layout == ROWS and m.qweight.shape[-2:] == (m.out_features, m.in_features)
                                  and m.scale.shape[-2:] == (m.out_features, 1) for m in rows)
    ours, theirs = generate(llm), generate(twin_of(llm, tiny_checkpoint, monkeypatch))
    # bf16 rounding moves this small random model's greedy path off its twin's after 7 to 33 of 256 tokens
    assert [tokens[:4] for tokens in ours[0]] == [tokens[:4] for tokens in theirs[0]]
    diff = max(abs(a - b) for x, y in zip(ours[1], theirs[1]) for a, b in zip(x[:4], y[:4]))
    assert diff < 0.05, f"logprobs differ by {diff:.2e}"


def test_fp8_checkpoint_read_as_shipped_equals_dequantizing_it_at_load(make_checkpoint, monkeypatch):
    path = make_checkpoint("fp8-split", seed=0, fp8=True, intermediate_size=384, moe_intermediate_size=96)
    # Indexer keys in the model dtype on both sides: 8-bit keys (auto's choice for FP8 weights) round each query to
    # int8, which turns the two weight paths' last-bit differences into whole steps of a score.
    shipped = LLM(path, **BASE, indexer_cache_dtype="model")
    kinds = {m.kind for m in shipped.engine.model.modules() if isinstance(m, QuantizedWeight)}
    assert kinds == ({"fp8"} if apply.kernels_here(torch.device("cpu")) else set())
    assert_same_outputs(generate(shipped), generate(float_llm(path, monkeypatch, indexer_cache_dtype="model")))


def test_what_is_packed_and_what_stays(tiny_checkpoint):
    cfg = ModelConfig.from_pretrained(tiny_checkpoint)
    model = load_model(cfg, tiny_checkpoint, torch.float32, torch.device("cpu"), progress=False, weight_forms="int4")
    packed = {name for name, m in model.named_modules() if isinstance(m, QuantizedWeight)}
    attn, moe = "model.layers.1.self_attn", "model.layers.1.mlp"
    for name in (f"{attn}.q_a_proj.weight", f"{attn}.q_b_proj.weight", f"{attn}.kv_a_proj_with_mqa.weight",
                 f"{attn}.o_proj.weight", f"{attn}.indexer.wq_b.weight", f"{attn}.indexer.wk.weight",
                 f"{moe}.experts_gate_up", f"{moe}.experts_down", f"{moe}.shared_experts.gate_up_proj",
                 "model.layers.0.mlp.gate_up_proj", "model.layers.0.mlp.down_proj.weight", "lm_head.weight"):
        assert name in packed, name
    params = dict(model.named_parameters())
    assert f"{attn}.w_uk" in packed and f"{attn}.w_uv" in packed
    assert isinstance(model.model.embed_tokens.weight, Int8Rows)  # lookups: int8 rows, not packed
    for name in ("model.norm.weight", f"{moe}.gate.weight", f"{attn}.indexer.weights_proj.weight"):
        assert name in params, name


def test_resident_bytes_are_what_the_model_holds(tiny_checkpoint):
    """model/weight_bytes.py (what doctor prints) adds up to the loaded model's own buffers."""
    cfg = ModelConfig.from_pretrained(tiny_checkpoint)
    for form in ("bf16", "fp8", "int8", "int4"):
        model = load_model(cfg, tiny_checkpoint, torch.float32, torch.device("cpu"), progress=False, weight_forms=form)
        held = sum(m.nbytes() for m in model.modules() if is_packed(m))
        held += sum(p.numel() * p.element_size() for p in model.parameters())
        assert resident_bytes(cfg, form, torch.float32) == held, form


def test_glm52_bytes_per_parameter(tmp_path):
    """On GLM-5.2's shapes: FP8 and int8 hold ≤ 1.05 bytes per parameter, int4 ≤ 0.6 (scales included)."""
    from conftest import REFERENCE_CONFIG

    (tmp_path / "config.json").write_text(open(REFERENCE_CONFIG).read())
    cfg = ModelConfig.from_pretrained(str(tmp_path))
    params = resident_bytes(cfg, None, torch.float32) / 4
    per_param = {form: resident_bytes(cfg, form, torch.bfloat16) / params for form in ("fp8", "int8", "int4")}
    assert per_param["fp8"] <= 1.05 and per_param["int8"] <= 1.05 and per_param["int4"] <= 0.6, per_param


def test_doctor_prints_the_resident_bytes_of_each_form(tmp_path):
    import subprocess
    import sys

    from conftest import REFERENCE_CONFIG

    (tmp_path / "config.json").write_text(open(REFERENCE_CONFIG).read())
    out = subprocess.run([sys.executable, "-m", "dsaserve", "doctor", str(tmp_path)], capture_output=True, text=True,
                         timeout=120).stdout
    assert "resident weights by form" in out and "weight products: " in out
    assert "int4            368.6 GiB  0.532 bytes per parameter" in out
    assert "fp8             714.3 GiB  1.032 bytes per parameter" in out


def test_bad_quantization_is_refused_naming_the_flag(tiny_checkpoint):
    with pytest.raises(ValueError, match="quantization='int3'.*fp8, int8, int4"):
        LLM(tiny_checkpoint, quantization="int3", **BASE)
