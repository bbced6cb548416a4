"""The cpu_isa option: one body family chosen at load (the best the CPU has, or the one asked for), refused with
what the CPU lacks, visible in the startup summary and doctor; and a bf16 checkpoint on a CPU without bf16
instructions (cpu_isa 'avx2' stands for one here) computed in fp32 with its weights kept in bf16, giving the
tokens of its fp32-widened twin."""

import subprocess
import sys

import pytest
import torch
from conftest import native_bodies

from dsaserve import LLM, SamplingParams
from dsaserve.native import torch_ops
from dsaserve.quantization.quantized_weight import QuantizedWeight

needs_avx2 = pytest.mark.skipif("avx2" not in native_bodies(), reason="the AVX2 bodies do not run here (no C++ "
                                                                       "compiler, or a CPU without AVX2)")
BASE = dict(block_size=16, progress=False, max_model_len=512, max_num_batched_tokens=64)
GREEDY = SamplingParams(temperature=0, max_tokens=96, ignore_eos=True, logprobs=1)
PROMPTS = [list(range(40 + 9 * i, 117 + 9 * i)) for i in range(3)]


def generate(llm):
    outs = llm.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY, use_tqdm=False)
    return ([o.outputs[0].token_ids for o in outs],
            [[p[t].logprob for p, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)] for o in outs])


@pytest.fixture
def default_isa():
    yield
    torch_ops.configure("auto", "auto")


def test_a_cpu_isa_without_bodies_is_refused_naming_the_choices(tiny_checkpoint):
    with pytest.raises(ValueError, match="cpu_isa='avx1024' is not one of auto, amx, avx512_bf16, avx512, avx2, none"):
        LLM(tiny_checkpoint, cpu_isa="avx1024", **BASE)


@pytest.mark.skipif(not torch_ops.load(), reason="the native operators cannot be built here")
def test_a_family_the_cpu_lacks_is_refused_naming_what_it_lacks(default_isa):
    have = list(torch.ops.dsaserve.cpu_isas())
    if "avx512" not in have:
        with pytest.raises(ValueError, match=r"cpu_isa='avx512': this CPU lacks AVX-512 \(avx512f"):
            torch_ops.configure("auto", "avx512")
    elif "avx512_bf16" not in have:
        with pytest.raises(ValueError, match="cpu_isa='avx512_bf16': this CPU lacks AVX-512 BF16"):
            torch_ops.configure("auto", "avx512_bf16")
    elif not torch.ops.dsaserve.amx_available():
        with pytest.raises(ValueError, match="cpu_isa='amx': this CPU lacks AMX-BF16"):
            torch_ops.configure("auto", "amx")
    else:
        pytest.skip("this CPU has every family (AMX included): nothing to refuse")
    assert torch_ops.cpu_kernels() == native_bodies()[0]  # the refusal left the process's choice as it was


@needs_avx2
@pytest.mark.parametrize("family, summary", [("avx2", "AVX2 (chosen by cpu_isa)"),
                                             ("avx512", "AVX-512 without BF16 (chosen by cpu_isa)")])
def test_the_choice_is_what_runs_and_what_the_summary_says(default_isa, family, summary):
    if family not in native_bodies():
        pytest.skip(f"this CPU does not run the {family} family")
    torch_ops.configure("auto", family)
    assert torch_ops.cpu_kernels() == family and torch.ops.dsaserve.cpu_kernels() == family
    assert all(torch_ops.runs(name) for name in ("packed_products", "decode_plan", "index_scores_int8",
                                                 "index_scores_f32"))
    assert torch_ops.summary().startswith(summary)
    torch_ops.configure("auto", "auto")
    assert torch_ops.cpu_kernels() == native_bodies()[0]


@pytest.mark.skipif(not torch_ops.load(), reason="the native operators cannot be built here")
def test_cpu_isa_none_runs_no_body_as_a_cpu_without_avx2_would(tiny_checkpoint, default_isa, monkeypatch):
    """cpu_isa 'none' stands for a CPU no body fits: no operator runs natively, the AMX tiles are off, the summary
    says it was chosen, and int8 weights then go through torch's products (the native ones would raise)."""
    llm = LLM(tiny_checkpoint, cpu_isa="none", quantization="int8", **BASE)
    assert torch_ops.cpu_kernels() == "none" and torch.ops.dsaserve.cpu_kernels() == "none"
    assert not any(torch_ops.runs(name) for bodies in torch_ops.BODIES.values() for name in bodies)
    assert torch_ops.summary().startswith("none (chosen by cpu_isa)")
    assert torch.ops.dsaserve.amx_mode() == "off"

    class NotHere:
        def __call__(self, *args):
            raise AssertionError("a native weight product ran under cpu_isa 'none'")

        def __getattr__(self, name):
            return self

    for product in ("quant_linear", "dequantize_t", "moe_experts", "gated_mlp"):
        monkeypatch.setattr(torch.ops.dsaserve, product, NotHere(), raising=False)
    tokens, _ = generate(llm)
    assert all(len(t) == GREEDY.max_tokens for t in tokens)


@needs_avx2
def test_doctor_prints_the_chosen_family(tmp_path):
    from conftest import REFERENCE_CONFIG

    (tmp_path / "config.json").write_text(open(REFERENCE_CONFIG).read())
    out = subprocess.run([sys.executable, "-m", "dsaserve", "doctor", str(tmp_path), "--cpu-isa", "avx2"],
                         capture_output=True, text=True, timeout=120)
    assert "native kernels: AVX2 (chosen by cpu_isa)" in out.stdout, out.stdout + out.stderr
    assert "weight products: native AVX2 kernels for up to 16 rows" in out.stdout


@needs_avx2
def test_a_bf16_checkpoint_keeps_its_bytes_and_its_tokens_computing_in_fp32(make_checkpoint, default_isa):
    """dtype auto under cpu_isa 'avx2' (a CPU without bf16 instructions): fp32 activations, every projection packed
    in bf16 (not widened to fp32: half the bytes), and the greedy tokens of the same checkpoint widened to fp32 in
    torch, logprobs within 1e-4."""
    path = make_checkpoint("bf16-weights", seed=3, dtype=torch.bfloat16)
    kept = LLM(path, cpu_isa="avx2", **BASE)
    assert kept.engine.dtype == torch.float32
    packed = [m for m in kept.engine.model.modules() if isinstance(m, QuantizedWeight)]
    assert packed and {m.kind for m in packed} == {"bf16"}
    ours = generate(kept)
    widened = LLM(path, dtype="float32", native_kernels="off", **BASE)
    assert not any(isinstance(m, QuantizedWeight) for m in widened.engine.model.modules())
    theirs = generate(widened)
    assert ours[0] == theirs[0]
    assert max(abs(a - b) for x, y in zip(ours[1], theirs[1]) for a, b in zip(x, y)) < 1e-4
