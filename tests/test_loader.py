"""Strict checkpoint loading: sharded, FP8 block-scaled, and the errors for broken checkpoints."""

import json
import math
import os
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from dsaserve.config import ModelConfig
from dsaserve.demo.checkpoint_builder import quantize_fp8, random_weights
from dsaserve.device import resolve_dtype
from dsaserve.model import load_model
from dsaserve.model.checkpoint_layout import checkpoint_shapes
from dsaserve.model.loader import CheckpointError, dequantize_fp8, fp8_params

CPU = torch.device("cpu")


def model_tensor(model, name: str) -> torch.Tensor:
    """The loaded value of checkpoint tensor `name`, undoing the load-time fusing and splitting."""
    params = dict(model.named_parameters())
    if m := re.match(r"(.*\.mlp)\.experts\.(\d+)\.(gate|up|down)_proj\.weight$", name):
        moe, e, kind = m.group(1), int(m.group(2)), m.group(3)
        if kind == "down":
            return params[f"{moe}.experts_down"][e]
        gate_up = params[f"{moe}.experts_gate_up"][e]
        half = gate_up.shape[0] // 2
        return gate_up[:half] if kind == "gate" else gate_up[half:]
    if m := re.match(r"(.*)\.(gate|up)_proj\.weight$", name):
        gate_up = params[f"{m.group(1)}.gate_up_proj"]
        half = gate_up.shape[0] // 2
        return gate_up[:half] if m.group(2) == "gate" else gate_up[half:]
    if m := re.match(r"(.*\.self_attn)\.kv_b_proj\.weight$", name):
        w_uk, w_uv = params[f"{m.group(1)}.w_uk"], params[f"{m.group(1)}.w_uv"]
        return torch.cat([w_uk, w_uv], dim=1).reshape(-1, w_uk.shape[-1])
    return params[name]


def load(path, dtype=torch.float32):
    cfg = ModelConfig.from_pretrained(path)
    return cfg, load_model(cfg, path, dtype, CPU, progress=False)


def test_every_checkpoint_tensor_lands_in_the_model_and_every_parameter_is_covered(tiny_checkpoint):
    cfg, model = load(tiny_checkpoint)
    original = random_weights(cfg, seed=0)
    for name in checkpoint_shapes(cfg):
        assert torch.equal(model_tensor(model, name), original[name].float()), name
    # Same number of elements on both sides: no parameter is left uninitialized.
    assert sum(p.numel() for p in model.parameters()) == sum(t.numel() for t in original.values())


def test_sharded_checkpoint_loads_like_single_file(make_checkpoint):
    single = make_checkpoint("single", seed=5)
    sharded = make_checkpoint("sharded", seed=5, shards=3)
    assert len([f for f in os.listdir(sharded) if f.endswith(".safetensors")]) == 3
    _, a = load(single)
    _, b = load(sharded)
    for (name, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(p, q), name


@pytest.mark.parametrize("model_type", ["glm_moe_dsa", "deepseek_v32"])
def test_fp8_block_scaled_checkpoint_dequantizes_within_fp8_error(make_checkpoint, model_type):
    # hidden 192 and intermediate 320 make partial 128-blocks in both directions
    dims = dict(hidden_size=192, intermediate_size=320, moe_intermediate_size=136, model_type=model_type)
    bf16 = make_checkpoint(f"fp8_source_{model_type}", seed=7, dtype=torch.bfloat16, **dims)
    fp8 = make_checkpoint(f"fp8_{model_type}", seed=7, dtype=torch.bfloat16, fp8=True, **dims)
    with open(os.path.join(fp8, "config.json")) as f:
        assert json.load(f)["quantization_config"]["weight_block_size"] == [128, 128]
    stored = load_file(os.path.join(fp8, "model.safetensors"))
    assert stored["model.layers.0.mlp.gate_proj.weight"].dtype == torch.float8_e4m3fn
    assert stored["model.layers.0.mlp.gate_proj.weight_scale_inv"].shape == (3, 2)
    assert stored["model.layers.0.self_attn.indexer.weights_proj.weight"].dtype == torch.bfloat16

    cfg, exact = load(bf16)
    _, dequant = load(fp8)
    checked = 0
    for name in checkpoint_shapes(cfg):
        a, b = model_tensor(exact, name), model_tensor(dequant, name)
        if name + "_scale_inv" not in stored:
            assert torch.equal(a, b), name
            continue
        # e4m3 keeps 3 mantissa bits: relative error ≤ 2^-4, plus the subnormal step of the block
        block_max = a.abs().max()
        assert ((a - b).abs() <= a.abs() * 2**-4 + block_max * 2**-9).all(), name
        checked += 1
    assert checked > 20


def test_dequantize_derives_the_tile_from_the_scale_grid():
    w = torch.randn(576, 300)
    q, scale = quantize_fp8(w)
    assert scale.shape == (5, 3)  # 576 rows → 4 full blocks and a partial one
    back = dequantize_fp8(q, scale, (128, 128), "w")
    assert ((back - w).abs() <= w.abs() * 2**-4 + w.abs().max() * 2**-9).all()
    with pytest.raises(CheckpointError, match="w: a scale grid"):
        dequantize_fp8(q, torch.ones(5, 301), (128, 128), "w")  # more column blocks than columns


def copy_checkpoint(src, dst) -> str:
    shutil.copytree(src, dst)
    return str(dst)


def rewrite_tensors(path, edit) -> None:
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    edit(tensors)
    save_file(tensors, file)


def test_missing_indexer_weight_on_full_layer_is_listed(tiny_checkpoint, tmp_path):
    path = copy_checkpoint(tiny_checkpoint, tmp_path / "ck")
    rewrite_tensors(path, lambda t: t.pop("model.layers.1.self_attn.indexer.wk.weight"))
    with pytest.raises(CheckpointError, match=r"missing tensors \(1\): model.layers.1.self_attn.indexer.wk.weight"):
        load(path)


def test_indexer_weight_on_shared_layer_is_unexpected(tiny_checkpoint, tmp_path):
    path = copy_checkpoint(tiny_checkpoint, tmp_path / "ck")

    def add(t):
        t["model.layers.2.self_attn.indexer.wk.weight"] = t["model.layers.1.self_attn.indexer.wk.weight"].clone()

    rewrite_tensors(path, add)
    with pytest.raises(CheckpointError, match=r"unexpected tensors \(1\): model.layers.2.self_attn.indexer.wk.weight"):
        load(path)


def test_wrong_shape_names_the_tensor(tiny_checkpoint, tmp_path):
    path = copy_checkpoint(tiny_checkpoint, tmp_path / "ck")
    rewrite_tensors(path, lambda t: t.__setitem__("model.norm.weight", torch.ones(3)))
    with pytest.raises(CheckpointError, match=r"model.norm.weight: \(3,\)"):
        load(path)


def test_truncated_file_is_named(tiny_checkpoint, tmp_path):
    path = copy_checkpoint(tiny_checkpoint, tmp_path / "ck")
    file = os.path.join(path, "model.safetensors")
    data = open(file, "rb").read()
    with open(file, "wb") as f:
        f.write(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"model.safetensors is truncated or corrupt"):
        load(path)


def test_corrupt_header_is_named(tiny_checkpoint, tmp_path):
    path = copy_checkpoint(tiny_checkpoint, tmp_path / "ck")
    with open(os.path.join(path, "model.safetensors"), "r+b") as f:
        f.seek(8)
        f.write(b"#garbage#")
    with pytest.raises(CheckpointError, match="model.safetensors is truncated or corrupt"):
        load(path)


def test_index_naming_a_missing_shard(make_checkpoint, tmp_path):
    path = copy_checkpoint(make_checkpoint("sharded", seed=5, shards=3), tmp_path / "ck")
    os.remove(os.path.join(path, "model-00002-of-00003.safetensors"))
    with pytest.raises(CheckpointError, match="model-00002-of-00003.safetensors"):
        load(path)


def test_mtp_layer_is_ignored_unless_asked(make_checkpoint):
    path = make_checkpoint("with_mtp", seed=0, include_mtp=True)
    names = load_file(os.path.join(path, "model.safetensors")).keys()
    assert any(n.startswith("model.layers.4.") for n in names)
    cfg, model = load(path)
    assert len(model.model.layers) == cfg.num_hidden_layers == 4


def test_dtype_cast_and_fp32_router(make_checkpoint):
    path = make_checkpoint("bf16", seed=0, dtype=torch.bfloat16)
    cfg, model = load(path, dtype=torch.float32)
    assert model.model.layers[1].self_attn.q_b_proj.weight.dtype == torch.float32
    cfg, model = load(path, dtype=torch.bfloat16)
    assert model.model.layers[1].self_attn.q_b_proj.weight.dtype == torch.bfloat16
    assert model.model.layers[1].mlp.gate.weight.dtype == torch.float32
    assert model.model.layers[1].mlp.gate.e_score_correction_bias.dtype == torch.float32
    assert model.model.layers[0].self_attn.indexer.weights_proj.weight.dtype == torch.float32


def test_auto_dtype_is_the_checkpoints_where_fast(monkeypatch):
    import dsaserve.device as device

    assert resolve_dtype("auto", "float32", CPU) == torch.float32
    monkeypatch.setattr(device, "cpu_supports_bf16", lambda: False)
    assert resolve_dtype("auto", "bfloat16", CPU) == torch.float32
    monkeypatch.setattr(device, "cpu_supports_bf16", lambda: True)
    assert resolve_dtype("auto", "bfloat16", CPU) == torch.bfloat16
    assert resolve_dtype("bf16", "float32", CPU) == torch.bfloat16
    with pytest.raises(ValueError, match="dtype='int4'"):
        resolve_dtype("int4", "bfloat16", CPU)


def test_reference_loads_the_builders_checkpoint_unchanged(tiny_checkpoint):
    from reference import load_reference

    ref = load_reference(tiny_checkpoint)
    cfg = ModelConfig.from_pretrained(tiny_checkpoint)
    original = random_weights(cfg, seed=0)
    gate_up = ref.model.layers[1].mlp.experts.gate_up_proj[3]
    inter = cfg.moe_intermediate_size
    assert torch.equal(gate_up[:inter], original["model.layers.1.mlp.experts.3.gate_proj.weight"])
    assert ref.model.layers[2].self_attn.indexer is None


class _Inline:
    """ThreadPoolExecutor stand-in that runs each job at once on the calling thread (where a dispatch mode sees it)."""

    def __init__(self, max_workers=None):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def submit(self, fn, *args):
        from concurrent.futures import Future

        future = Future()
        future.set_result(fn(*args))
        return future


@pytest.mark.parametrize("quantization", ["int4", "int8", "fp8"])
def test_loading_streams_rows_and_never_widens_a_whole_tensor(make_checkpoint, monkeypatch, quantization):
    """With the loader's scratch capped, no float32 tensor made while loading an FP8 checkpoint is larger than a
    chunk of rows (128 rows of the widest tensor, padded to its groups): a whole embedding, head or projection
    converted at once fails this."""
    from torch.utils._python_dispatch import TorchDispatchMode

    import dsaserve.model.loader as loader

    dims = dict(hidden_size=192, intermediate_size=320, moe_intermediate_size=136, vocab_size=4096)
    path = make_checkpoint("fp8_vocab4096", seed=7, dtype=torch.bfloat16, fp8=True, **dims)
    cfg = ModelConfig.from_pretrained(path)
    largest = max(math.prod(s) for s in checkpoint_shapes(cfg).values())
    cap = 128 * 512  # 128 rows × the widest tensor's columns (320), padded to whole groups of 128
    assert largest > 2 * cap  # (else the test could not tell)

    class LargestFloat(TorchDispatchMode):
        numel = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(t, torch.Tensor) and t.dtype == torch.float32:
                    LargestFloat.numel = max(LargestFloat.numel, t.numel())
            return out

    original = loader.load_checkpoint

    def watched(*args, **kwargs):
        with LargestFloat():
            return original(*args, **kwargs)

    monkeypatch.setattr(loader, "SCRATCH_PER_THREAD", 64 << 10)  # one 128-row chunk at a time here
    monkeypatch.setattr(loader, "ThreadPoolExecutor", _Inline)
    monkeypatch.setattr("dsaserve.model.load_checkpoint", watched)
    llm_model = load_model(cfg, path, torch.bfloat16, CPU, progress=False,
                           weight_forms=quantization)
    assert 0 < LargestFloat.numel <= cap, f"a float32 tensor of {LargestFloat.numel} elements was made while loading"
    assert llm_model is not None


def test_fp8_kept_as_shipped_is_packed_straight_from_the_mapped_file(make_checkpoint, monkeypatch):
    """Zero copy where the form is the file's: every chunk of an FP8 projection kept as fp8 reaches its packed place
    as a view of the memory-mapped file (its bytes read once, by the packing), not as a copy read beforehand.
    (kv_b_proj is cut per head and W_UK transposed: those pieces are copies by nature.)"""
    from dsaserve.quantization.fp8_blocks import Fp8Slice
    from dsaserve.quantization.quantized_weight import QuantizedWeight

    path = make_checkpoint("fp8_vocab4096", seed=7, dtype=torch.bfloat16, fp8=True, hidden_size=192,
                           intermediate_size=320, moe_intermediate_size=136, vocab_size=4096)
    files = {os.path.getsize(os.path.join(path, f)) for f in os.listdir(path) if f.endswith(".safetensors")}
    chunks = []
    load_rows = QuantizedWeight.load_rows

    def watched(self, first, source, expert=None, name="weight"):
        if isinstance(source, Fp8Slice) and ".kv_b_proj." not in name:
            chunks.append((name, source.weight.untyped_storage().nbytes()))
        return load_rows(self, first, source, expert, name)

    monkeypatch.setattr(QuantizedWeight, "load_rows", watched)
    cfg = ModelConfig.from_pretrained(path)
    shipped = fp8_params(cfg, path)
    load_model(cfg, path, torch.bfloat16, CPU, progress=False,
               weight_forms=lambda name: "fp8" if name in shipped else None)
    assert len(chunks) > 20
    copied = [chunk for chunk in chunks if chunk[1] not in files]
    assert not copied, f"{len(copied)} of {len(chunks)} FP8 chunks were copies, not the mapped file: {copied[:3]}"


@pytest.mark.parametrize("model", ["glm_moe_dsa, FP8", "glm5_next, bf16"])
@pytest.mark.parametrize("form", ["fp8", "int8", "int4", "bf16"])
def test_loading_writes_every_byte_of_the_packed_weights(make_checkpoint, monkeypatch, form, model):
    """Packed weights are not zeroed before loading, so the load must write all of their bytes, the padding rows
    and columns and the blocks two tensors share included: loads into buffers filled with 0x00 and with 0xFF first
    end equal. A GLM-5.2-layout FP8 checkpoint, and a GLM-5.3-Flash one (KDA's projections)."""
    import dsaserve.model as model_package
    from dsaserve.quantization.packed import is_packed

    if model.startswith("glm5_next"):
        path = make_checkpoint("glm5_next", seed=0, model_type="glm5_next")
    else:
        path = make_checkpoint("fp8_vocab4096", seed=7, dtype=torch.bfloat16, fp8=True, hidden_size=192,
                               intermediate_size=320, moe_intermediate_size=136, vocab_size=4096)
    cfg = ModelConfig.from_pretrained(path)
    original = model_package.load_checkpoint

    def load(fill: int):
        def filled_first(model, *args, **kwargs):
            for module in model.modules():
                if is_packed(module):
                    module.qweight.view(torch.uint8).fill_(fill)
                    module.scale.view(torch.uint8).fill_(fill)
            return original(model, *args, **kwargs)

        monkeypatch.setattr(model_package, "load_checkpoint", filled_first)
        model = load_model(cfg, path, torch.bfloat16, CPU, progress=False, weight_forms=form)
        return {name: t for name, t in model.state_dict().items() if name.endswith((".qweight", ".scale"))}

    zeros, ones = load(0x00), load(0xFF)
    assert len(zeros) > 20 and zeros.keys() == ones.keys()
    unwritten = [name for name in zeros if not torch.equal(zeros[name].view(torch.uint8), ones[name].view(torch.uint8))]
    assert not unwritten, f"bytes of {unwritten[:3]} were never written by the load"


def test_a_load_the_machine_cannot_hold_is_refused_with_the_forms_that_fit(tiny_checkpoint, monkeypatch):
    import dsaserve.model as model_package
    from dsaserve.model.load_memory import LoadMemoryError
    from dsaserve.model.weight_bytes import resident_bytes

    cfg = ModelConfig.from_pretrained(tiny_checkpoint)
    scratch = 64 << 20  # one loading thread's
    int4 = resident_bytes(cfg, "int4", torch.float32)
    monkeypatch.setattr(model_package, "available_memory", lambda: scratch + int4 + 1)
    with pytest.raises(LoadMemoryError, match=r"loading needs about .* MiB \(weights .* MiB, plus 64 MiB of "
                                              r"conversion scratch\) but .* MiB is available; options that fit: "
                                              r"--quantization int4 \("):
        load_model(cfg, tiny_checkpoint, torch.float32, CPU, progress=False, scratch_budget=scratch)
    monkeypatch.setattr(model_package, "available_memory", lambda: 1 << 40)
    load_model(cfg, tiny_checkpoint, torch.float32, CPU, progress=False, scratch_budget=scratch)


@pytest.mark.skipif(not __import__("dsaserve.native.torch_ops", fromlist=["load"]).load(),
                    reason="the native operators did not build here")
@pytest.mark.parametrize("rows, cols, full", [((0, 576), (0, 301), (576, 301)), ((128, 430), (64, 250), (576, 301)),
                                              ((256, 384), (0, 7168), (384, 7168))])
def test_the_native_fp8_dequantization_is_torchs(monkeypatch, rows, cols, full):
    """The loader's table-per-byte FP8 conversion gives torch's values exactly, for parts of a tensor that start
    and end inside its tiles (a 576-row weight's last tile is partial) and for special bytes (NaN, subnormals)."""
    from dsaserve.native import torch_ops

    w, scale = quantize_fp8(torch.randn(full) * 100)
    w.view(torch.uint8)[0, :8] = torch.tensor([0x7F, 0xFF, 0x01, 0x81, 0x00, 0x80, 0x7E, 0x08], dtype=torch.uint8)
    part = w[rows[0]:rows[1], cols[0]:cols[1]]
    native = dequantize_fp8(part, scale, (128, 128), "w", full, (rows[0], cols[0]))
    monkeypatch.setattr(torch_ops, "load", lambda: False)
    reference = dequantize_fp8(part, scale, (128, 128), "w", full, (rows[0], cols[0]))
    assert torch.equal(native.isnan(), reference.isnan())
    assert torch.equal(native.nan_to_num(), reference.nan_to_num())


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_the_native_chunk_quantization_is_torchs(body, monkeypatch, kind):
    """The loader's native int8/int4 quantization of a chunk gives torch's (q, scales) bit for bit, from an FP8 part
    that starts and ends inside its tiles (subnormal bytes, and every byte but NaN, included), from bf16 and from fp32
    rows; per body."""
    from dsaserve.native import torch_ops
    from dsaserve.quantization import formats
    from dsaserve.quantization.fp8_blocks import Fp8Slice

    full = (576, 301)
    w, scale = quantize_fp8(torch.randn(full) * 100)
    subnormals = torch.tensor([0x00, 0x80, 0x01, 0x81, 0x02, 0x83, 0x07, 0x86], dtype=torch.uint8)
    w.view(torch.uint8)[130] = subnormals[torch.randint(0, 8, (301,))]  # a row of them alone: its scale is theirs
    every = torch.tensor([b for b in range(256) if b & 0x7F != 0x7F], dtype=torch.uint8)  # each byte but NaN
    w.view(torch.uint8)[131] = every[torch.arange(301) % len(every)]
    sources = [Fp8Slice(w[128:430, 64:250].contiguous(), scale, full, (128, 64), (128, 128), "w"),
               torch.randn(37, 259).to(torch.bfloat16), torch.randn(37, 259) * 3]
    native = [formats.quantize(kind, s) for s in sources]
    monkeypatch.setattr(torch_ops, "load", lambda: False)
    for (q, s), source in zip(native, sources):
        reference_q, reference_s = formats.quantize(kind, source)
        assert torch.equal(q, reference_q) and torch.equal(s, reference_s)


@pytest.mark.parametrize("kind", ["bf16", "fp8", "int8", "int4"])
def test_the_native_packing_writes_what_pack_makes(body, kind):
    """pack_into writes pack's blocks and scales in place (rows past the last and the column past an odd width
    padded as pack pads them) and leaves the blocks beside them alone."""
    from dsaserve.quantization import formats

    n, k = 37, 259
    q = {"bf16": torch.randn(n, k).to(torch.bfloat16), "fp8": torch.randint(0, 256, (n, k), dtype=torch.uint8),
         "int8": torch.randint(-127, 128, (n, k), dtype=torch.int8),
         "int4": torch.randint(-8, 8, (n, k), dtype=torch.int8)}[kind]
    scale = torch.rand(n, formats.scale_columns(kind, k)) + 0.5
    packed_q, packed_s = formats.pack(kind, q, scale)
    qshape, qdtype, sshape = formats.packed_shapes(kind, n + 16, k)  # one more block after these rows
    qweight, scales = torch.full(qshape, 3, dtype=qdtype), torch.full(sshape, 3.0)
    formats.pack_into(kind, q, scale, qweight[:3], scales[:3])
    assert torch.equal(qweight[:3].view(torch.uint8), packed_q.view(torch.uint8))
    assert torch.equal(scales[:3], packed_s)
    assert (qweight[3] == 3).all() and (scales[3] == 3).all()
