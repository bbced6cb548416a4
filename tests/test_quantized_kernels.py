"""The packed-weight kernels (native/quant_linear.cpp's AVX-512 BF16 body, quant_linear_avx2.cpp's AVX2 one)
against dequantize-then-matmul in fp32, for every kind, on shapes that exercise a partial last row block, an odd
column count, partial scale groups and a column offset inside the FP8 blocks; the packing round trip; and the torch
fallback. Tests taking the `body` fixture run once per body this host can execute (an AVX-512 BF16 host runs the
AVX2 body too); where none can (no compiler, no AVX2) they are skipped, saying so."""

import pytest
import torch
from conftest import native_bodies

from dsaserve.demo.checkpoint_builder import quantize_fp8
from dsaserve.native import torch_ops
from dsaserve.quantization import formats
from dsaserve.quantization.fp8_blocks import fp8_row_scales
from dsaserve.quantization.quantized_weight import Fp8Slice, PackedMatrix, QuantizedWeight

KINDS = ("bf16", "fp8", "int8", "int4")
# rows not a multiple of 16, columns odd or past one scale group, a slice starting 64 columns into its block
SHAPES = [(37, 301, 0), (16, 128, 0), (5, 45, 0), (33, 200, 64), (70, 388, 0)]


def int8_activations_here(kind: str) -> bool:
    """Whether `kind` ("int4", "int8") weights meet bf16 activations rounded to int8 under the body family now
    configured: the VNNI path (AVX-512 BF16 family) or the AVX2 families' int4 path (vpmaddubsw, or vpdpbusd in the
    avx512 family where the CPU has VNNI)."""
    return kind in ("int4", "int8") and getattr(torch.ops.dsaserve, f"{kind}_bf16_path")() in (
        "avx512_vnni", "avx512_int8", "avx2_int8")


def int8_activation_cases() -> list:
    """(kind, body family) of every int8-activation path this host runs (the VNNI ones need AVX-512 VNNI and VBMI;
    the AVX2 family's is int4's alone), as parameters; none here: one skipped case saying why."""
    cases = []
    for family in native_bodies():
        torch_ops.configure("auto", family)
        cases += [pytest.param(kind, family, id=f"{kind}-{family}") for kind in ("int4", "int8")
                  if int8_activations_here(kind)]
    torch_ops.configure("auto", "auto")
    return cases or [pytest.param(None, None, marks=pytest.mark.skip(
        reason=f"no int8-activation path here (this CPU's families: {native_bodies()})"))]


def activation_group(kind: str, k: int) -> int:
    """The int8 paths' activation groups: int4's weight scale groups; 128 columns for int8 (one scale per row)."""
    return formats.group_of(kind, k) if kind == "int4" else 128


def int8_activations(x: torch.Tensor, group: int, levels: int = 127) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The VNNI path's activations (levels 127; the AVX2 body's int16 ones: 32767): per row and scale group,
    round(x * levels / absmax) (to nearest even, in fp32) with scale absmax / levels. Returns (q [M, K] as floats,
    scale [M, G], each column's group)."""
    xf = x.float()
    columns = torch.arange(x.shape[1]) // group
    amax = torch.zeros(x.shape[0], int(columns[-1]) + 1).scatter_reduce(1, columns.expand_as(xf), xf.abs(), "amax")
    inv = torch.where(amax > 1e-30, torch.tensor(float(levels)) / amax, torch.zeros(()))
    return torch.round(xf * inv[:, columns]), amax / levels, columns


def activation_rounding_bound(x: torch.Tensor, weight: torch.Tensor, group: int, levels: int = 127) -> torch.Tensor:
    """[M, N]: sum over k of |weight[n, k]| times half the activation's step in k's group."""
    _, scale, columns = int8_activations(x, group, levels)
    return (scale[:, columns] / 2) @ weight.abs().T * (1 + 1e-5)


def int16_rounding(body: str, kind: str, x: torch.Tensor, weight: torch.Tensor):
    """What the AVX2 body's int16 activations (per row and 128 columns) may add to an int8 or int4 product."""
    if body in torch_ops.AVX2_FAMILY and kind in ("int8", "int4") and not (
            x.dtype == torch.bfloat16 and int8_activations_here(kind)):
        return activation_rounding_bound(x, weight, 128, 32767)
    return 0


def stored(kind: str, n: int, k: int, col_offset: int, seed: int = 0):
    """(q, scale) of a random [n, k] weight in `kind`'s unpacked form."""
    g = torch.Generator().manual_seed(seed)
    if kind == "fp8":  # a slice of a wider FP8 tensor, with that tensor's block scales
        full = torch.randn(n, k + col_offset, generator=g)
        q, scale_inv = quantize_fp8(full)
        return q[:, col_offset:].contiguous().view(torch.uint8), fp8_row_scales(
            scale_inv, (0, n), (col_offset, col_offset + k), (n, k + col_offset), (128, 128))
    w = torch.randn(n, k, generator=g)
    if kind == "bf16":
        return w.bfloat16(), torch.ones(n, 1)
    return formats.quantize_int8(w) if kind == "int8" else formats.quantize_int4(w)


def matrix(kind, n, k, col_offset):
    q, scale = stored(kind, n, k, col_offset if kind == "fp8" else 0)
    offset = col_offset if kind == "fp8" else 0
    packed_q, packed_s = formats.pack(kind, q, scale)
    return PackedMatrix(kind, packed_q, packed_s, n, k, offset), formats.dequantize_reference(kind, q, scale, offset)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("n, k, col_offset", SHAPES)
def test_kernel_equals_dequantize_then_matmul(kind, n, k, col_offset, body):
    m, weight = matrix(kind, n, k, col_offset)
    args = (formats.KINDS[kind], formats.group_of(kind, k), m.col_offset, n, k)
    for rows in (1, 2, 5, 8, 11, 16):
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
        expected = x @ weight.T
        # fp32 activations: exact products, only the summation order differs (AVX2 int8, int4: int16 activations)
        y = torch.ops.dsaserve.quant_linear(x, m.qweight, m.scale, *args)
        bound = 1e-5 * expected.abs().max() + 1e-6 + int16_rounding(body, kind, x, weight)
        assert ((y - expected).abs() <= bound).all()
        # bf16 activations: the same products of bf16 values, then the output rounded to bf16 (int4 and int8 on
        # the int8-activation paths: the activations rounded to int8 first, off by at most half a step each)
        xb = x.bfloat16()
        yb = torch.ops.dsaserve.quant_linear(xb, m.qweight, m.scale, *args)
        exact = xb.float() @ weight.T
        assert yb.dtype == torch.bfloat16
        on_int8 = int8_activations_here(kind)
        rounding = activation_rounding_bound(xb, weight, activation_group(kind, k)) if on_int8 else 0
        rounding = rounding + int16_rounding(body, kind, xb, weight)
        assert ((yb.float() - exact).abs() <= exact.abs() * 2**-8 + 1e-3 * exact.abs().max() + rounding).all()


@pytest.mark.skipif("avx512" not in native_bodies(), reason="this CPU does not run the avx512 family")
@pytest.mark.parametrize("kind", KINDS)
def test_the_avx512_family_gives_the_avx2_bodys_bits(kind):
    """The avx512 family's products (a block's 16 rows in one 512-bit register) give the AVX2 body's bits, lane for
    lane: every kind, partial row blocks, odd columns, several scale groups, an FP8 slice inside its blocks, 1 to 16
    rows (four per sweep and a remainder), fp32 and bf16 activations, one weight and stacked ones."""
    results = {}
    try:
        for family in ("avx2", "avx512"):
            torch_ops.configure("auto", family)
            results[family] = []
            for n, k, col_offset in SHAPES:
                m, _ = matrix(kind, n, k, col_offset)
                args = (formats.KINDS[kind], formats.group_of(kind, k), m.col_offset, n, k)
                for rows in (1, 2, 3, 5, 16):
                    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)) * 3
                    for dtype in (torch.float32, torch.bfloat16):
                        results[family].append(torch.ops.dsaserve.quant_linear(x.to(dtype), m.qweight, m.scale, *args))
                stacked_q, stacked_s = torch.stack([m.qweight, m.qweight.flip(0)]), torch.stack([m.scale, m.scale])
                x = torch.randn(2, 3, k, generator=torch.Generator().manual_seed(k))
                results[family].append(torch.ops.dsaserve.quant_linear(x, stacked_q, stacked_s, *args))
    finally:
        torch_ops.configure("auto", "auto")
    assert len(results["avx2"]) == len(results["avx512"])
    for wide, narrow in zip(results["avx512"], results["avx2"]):
        assert torch.equal(wide.view(torch.int16) if wide.dtype == torch.bfloat16 else wide,
                           narrow.view(torch.int16) if narrow.dtype == torch.bfloat16 else narrow)


@pytest.mark.parametrize("kind", KINDS)
def test_more_than_eight_rows_sweep_spans_of_blocks_with_the_bits_of_eight(kind, body):
    """More than 8 activation rows are swept 8 at a time over spans of row blocks that stay in L2 (32-256 KiB
    blocks here: spans of 2-4 blocks, several per thread, the last one short): each row's result has the bits of a
    call with at most 8 rows, which sweeps the whole range once (fp32 and bf16 activations, the VNNI paths
    included)."""
    n, k = 16 * 9 + 5, 8192
    m, _ = matrix(kind, n, k, 0)
    args = (formats.KINDS[kind], formats.group_of(kind, k), 0, n, k)
    x = torch.randn(16, k, generator=torch.Generator().manual_seed(9))
    for dtype in (torch.float32, torch.bfloat16):
        xd = x.to(dtype)
        for rows in (11, 16):
            whole = torch.ops.dsaserve.quant_linear(xd[:rows], m.qweight, m.scale, *args)
            parts = torch.cat([torch.ops.dsaserve.quant_linear(xd[r:min(r + 8, rows)], m.qweight, m.scale, *args)
                               for r in range(0, rows, 8)])
            assert torch.equal(whole.view(torch.int16) if dtype == torch.bfloat16 else whole,
                               parts.view(torch.int16) if dtype == torch.bfloat16 else parts), (dtype, rows)


@pytest.fixture
def family_of_case(request):
    """Configures the body family of an int8_activation_cases() case, back to the default after."""
    torch_ops.configure("auto", request.param or "auto")
    yield request.param
    torch_ops.configure("auto", "auto")


@pytest.mark.parametrize("kind, family_of_case", int8_activation_cases(), indirect=["family_of_case"])
@pytest.mark.parametrize("n, k", [(37, 301), (16, 128), (5, 45), (70, 388), (33, 1031)])
def test_int8_activation_paths_are_exact_in_their_int8_activations(kind, family_of_case, n, k):
    """int4 and int8 weights by bf16 activations on an int8-activation path (VNNI; the AVX2 families' int4) equal,
    up to the bf16 output's rounding, the exact products of the int8-rounded activations (int8_activations) and
    the integer weights, activation group by group, each scaled by its weight scale: partial last row blocks and
    chunks, odd column counts, several groups, single and batched weights."""
    q, scale = stored(kind, n, k, 0)
    packed_q, packed_s = formats.pack(kind, q, scale)
    args = (formats.KINDS[kind], formats.group_of(kind, k), 0, n, k)
    g = torch.Generator().manual_seed(k)
    for rows in (1, 2, 5, 8, 11, 16):
        x = (torch.randn(rows, k, generator=g) * torch.rand(rows, 1, generator=g) * 4).bfloat16()
        y = torch.ops.dsaserve.quant_linear(x, packed_q, packed_s, *args)
        xq, xs, columns = int8_activations(x, activation_group(kind, k))
        expected = torch.zeros(rows, n, dtype=torch.float64)
        for group in range(xs.shape[1]):
            inside = columns == group
            weight_group = int(inside.nonzero()[0]) // args[1]  # an activation group lies within one weight group
            integer = xq[:, inside].double() @ q[:, inside].double().T
            expected += integer * xs[:, group, None].double() * scale[None, :, weight_group].double()
        assert ((y.double() - expected).abs() <= expected.abs() * 2**-8 + 1e-5 * expected.abs().max()).all(), rows
    # stacked weights (one per attention head), each with its own rows
    other_q, other_s = formats.pack(kind, *stored(kind, n, k, 0, seed=1))
    heads, scales = torch.stack([packed_q, other_q]), torch.stack([packed_s, other_s])
    x = torch.randn(2, 3, k, generator=g).bfloat16()
    batched = torch.ops.dsaserve.quant_linear(x, heads, scales, *args)
    for b in range(2):
        assert torch.equal(batched[b], torch.ops.dsaserve.quant_linear(x[b], heads[b], scales[b], *args))


def int4_paths_of(family: str) -> str:
    torch_ops.configure("auto", family)
    try:
        return torch.ops.dsaserve.int4_bf16_path()
    finally:
        torch_ops.configure("auto", "auto")


@pytest.mark.skipif(not ("avx512_bf16" in native_bodies() and int4_paths_of("avx512_bf16") == "avx512_vnni"
                         and "avx2" in native_bodies()),
                    reason="needs a CPU running both the AVX-512 VNNI int4 path and the AVX2 body")
def test_the_avx2_int4_int8_products_are_the_vnni_paths_bits():
    """int4 weights by bf16 activations: the AVX2 families' path (vpmaddubsw; the avx512 family's blocks by vpdpbusd
    where the CPU has AVX-512 VNNI) rounds the activations as the VNNI path does and sums the same integers in the
    same float steps, so its outputs are the VNNI path's bits: partial row blocks, odd columns and an odd last column
    pair, several groups, 1-16 rows, activations near a group's largest (the int8 bytes at +-127), a non-finite row,
    stacked weights."""
    results = {}
    try:
        for family in ("avx512_bf16", "avx2", *(["avx512"] if "avx512" in native_bodies() else [])):
            torch_ops.configure("auto", family)
            results[family] = []
            for n, k in [(37, 301), (16, 128), (5, 45), (70, 388), (33, 1031), (21, 2)]:
                packed = formats.pack("int4", *stored("int4", n, k, 0, seed=n))
                args = (formats.KINDS["int4"], formats.group_of("int4", k), 0, n, k)
                g = torch.Generator().manual_seed(k)
                for rows in (1, 2, 3, 5, 16):
                    x = torch.randn(rows, k, generator=g) * torch.rand(rows, 1, generator=g) * 4
                    x[:, ::7] = x[:, ::7].sign() * 9  # the groups' largest, each rounded to +-127
                    if rows == 3:
                        x[1, -1] = float("nan")
                    results[family].append(torch.ops.dsaserve.quant_linear(x.bfloat16(), *packed, *args))
                stacked = torch.stack([packed[0], packed[0].flip(0)]), torch.stack([packed[1], packed[1]])
                x = torch.randn(2, 3, k, generator=g).bfloat16()
                results[family].append(torch.ops.dsaserve.quant_linear(x, *stacked, *args))
    finally:
        torch_ops.configure("auto", "auto")
    for family in results:
        for ours, vnni in zip(results[family], results["avx512_bf16"]):
            assert torch.equal(ours.view(torch.int16), vnni.view(torch.int16)), family


@pytest.mark.parametrize("kind, family_of_case", int8_activation_cases(), indirect=["family_of_case"])
def test_int8_activation_paths_keep_a_non_finite_row_to_itself(kind, family_of_case):
    """A row holding NaN or infinity gives NaN outputs (the engine then ends that request alone); the other
    rows' outputs are what they are without it."""
    n, k = 40, 300
    q, scale = stored(kind, n, k, 0)
    packed = formats.pack(kind, q, scale)
    args = (formats.KINDS[kind], formats.group_of(kind, k), 0, n, k)
    x = torch.randn(4, k).bfloat16()
    clean = torch.ops.dsaserve.quant_linear(x, *packed, *args)
    x[1, 7], x[2, 200] = float("nan"), float("inf")
    y = torch.ops.dsaserve.quant_linear(x, *packed, *args)
    assert y[1:3].isnan().all() and torch.equal(y[[0, 3]], clean[[0, 3]])


@pytest.mark.parametrize("kind", KINDS)
def test_transposed_dequantization_is_exact(kind, body):
    for n, k, col_offset in SHAPES:
        m, weight = matrix(kind, n, k, col_offset)
        args = (formats.KINDS[kind], formats.group_of(kind, k), m.col_offset, n, k)
        assert torch.equal(torch.ops.dsaserve.dequantize_t(m.qweight, m.scale, *args, torch.float32), weight.T)


@pytest.mark.parametrize("kind", KINDS)
def test_packing_round_trips(kind):
    for n, k, col_offset in SHAPES:
        q, scale = stored(kind, n, k, col_offset if kind == "fp8" else 0)
        back_q, back_s = formats.unpack(kind, *formats.pack(kind, q, scale), n, k)
        assert torch.equal(back_q, q) and torch.equal(back_s, scale.float())


def test_fp8_as_shipped_dequantizes_bit_for_bit_like_the_loader():
    """An FP8 checkpoint tensor kept in FP8 reproduces exactly the loader's dequantization (the kernel
    multiplies the same fp32 values), also for a rank's slice that starts inside a block."""
    from dsaserve.model.loader import dequantize_fp8

    full = torch.randn(300, 520)
    q, scale_inv = quantize_fp8(full)
    for rows, cols in (((0, 300), (0, 520)), ((100, 260), (200, 520))):
        piece = q[rows[0]:rows[1], cols[0]:cols[1]]
        source = Fp8Slice(piece, scale_inv, (300, 520), (rows[0], cols[0]), (128, 128), "w")
        weight = QuantizedWeight("fp8", piece.shape[0], piece.shape[1], col_offset=source.col_offset)
        weight.qweight.zero_()
        weight.scale.zero_()
        weight.load_rows(0, source)
        loader = dequantize_fp8(piece, scale_inv, (128, 128), "w", (300, 520), (rows[0], cols[0]))
        assert torch.equal(weight.matrix().dequantize(), loader)


def test_fp8_kernel_decodes_every_finite_e4m3_byte(body):
    """Every finite e4m3 byte (both zeros and the subnormals included, which the kernel decodes apart from the
    normal numbers) gives the loader's value: in the transposed dequantization, and in the product, where one-hot
    activation rows pick the weight's columns out exactly."""
    codes = torch.tensor([b for b in range(256) if b & 0x7F != 0x7F], dtype=torch.uint8)  # 0x7F, 0xFF: NaN
    q = torch.stack([codes.roll(3 * r) for r in range(16)])  # each byte in every row lane
    n, k = q.shape
    scale = torch.full((n, formats.scale_columns("fp8", k)), 0.75)
    packed_q, packed_s = formats.pack("fp8", q, scale)
    weight = formats.dequantize_reference("fp8", q, scale, 0)
    args = (formats.KINDS["fp8"], formats.group_of("fp8", k), 0, n, k)
    assert torch.equal(torch.ops.dsaserve.dequantize_t(packed_q, packed_s, *args, torch.float32), weight.T)
    for first in range(0, k, 16):
        columns = torch.arange(first, min(first + 16, k))
        one_hot = torch.zeros(len(columns), k)
        one_hot[torch.arange(len(columns)), columns] = 1
        y = torch.ops.dsaserve.quant_linear(one_hot, packed_q, packed_s, *args)
        assert torch.equal(y, weight[:, columns].T)
        # bf16 activations take the other decode where the CPU has VBMI (table lookups); the products are exact
        # in bf16 too (4 significant bits times 0.75)
        y = torch.ops.dsaserve.quant_linear(one_hot.bfloat16(), packed_q, packed_s, *args)
        assert torch.equal(y.float(), weight[:, columns].T)


@pytest.mark.parametrize("kind", ("int8", "int4"))
def test_quantization_error_is_within_the_rounding_bound(kind):
    """Symmetric rounding: each weight is off by at most half a step of its row's (group's) scale."""
    w = torch.randn(40, 300)
    q, scale = formats.quantize_int8(w) if kind == "int8" else formats.quantize_int4(w)
    error = (formats.dequantize_reference(kind, q, scale) - w).abs()
    step = scale[:, torch.arange(300) // formats.group_of(kind, 300)]
    assert (error <= step / 2 + 1e-6).all()


def test_rows_loaded_in_pieces_equal_rows_loaded_at_once():
    """Fused weights load their parts at row offsets that split a 16-row block (gate rows, then up rows)."""
    w = torch.randn(40, 96)
    whole = QuantizedWeight("int8", 40, 96)
    parts = QuantizedWeight("int8", 40, 96)
    for t in (whole, parts):
        t.qweight.zero_()
        t.scale.zero_()
    whole.load_rows(0, w)
    parts.load_rows(0, w[:23])
    parts.load_rows(23, w[23:])
    assert torch.equal(whole.qweight, parts.qweight) and torch.equal(whole.scale, parts.scale)


def test_the_torch_fallback_matches_the_reference(monkeypatch):
    """Where the kernels do not run, the packed weight is dequantized in torch and multiplied there."""
    monkeypatch.setattr(torch_ops, "cpu_kernels", lambda: "none")
    m, weight = matrix("int4", 37, 301, 0)
    x = torch.randn(3, 301)
    assert torch.allclose(m.matmul(x), x @ weight.T, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", KINDS)
def test_the_torch_fallback_dequantizes_a_slab_of_rows_at_a_time(monkeypatch, kind):
    """A product without kernels never holds the whole weight in floats: with room for 16 rows, a 37-row weight is
    dequantized in three slabs (the last one partial), and the product is the whole one's."""
    from dsaserve.quantization import quantized_weight

    monkeypatch.setattr(torch_ops, "cpu_kernels", lambda: "none")
    monkeypatch.setattr(quantized_weight, "FALLBACK_SCRATCH", 16 * 301 * 4)
    m, weight = matrix(kind, 37, 301, 0)
    seen, slab = [], quantized_weight.PackedMatrix._torch_slab

    def counted(self, dtype, r0, r1):
        out = slab(self, dtype, r0, r1)  # [K, rows]
        seen.append(out.shape[1])
        return out

    monkeypatch.setattr(quantized_weight.PackedMatrix, "_torch_slab", counted)
    x = torch.randn(3, 301)
    assert torch.allclose(m.matmul(x), x @ weight.T, atol=1e-4, rtol=1e-4)
    assert seen == [16, 16, 5]


def test_without_a_body_int8_weights_are_kept_in_torchs_row_layout_and_multiplied_there(monkeypatch):
    """With no native body an int8 weight is [N, K] int8 and a scale per row, loaded a chunk of rows at a time. Up
    to 16 activation rows multiply by torch's int8 matmul, with activations and scales rounded to bf16 (its result
    is that rounding's, within bf16's precision); more rows by dequantized slabs (the exact product)."""
    monkeypatch.setattr(torch_ops, "cpu_kernels", lambda: "none")
    weight = torch.randn(37, 320)
    quantized = QuantizedWeight("int8", 37, 320)
    assert quantized.layout == "rows" and quantized.shape == (37, 320)
    assert quantized.qweight.shape == (37, 320) and quantized.scale.shape == (37, 1)
    assert QuantizedWeight("int8", 37, 301).layout == "blocks"  # a width torch's int8 matmul cannot take
    quantized.load_rows(0, weight[:20])
    quantized.load_rows(20, weight[20:])
    q, s = formats.quantize_int8(weight)
    assert torch.equal(quantized.qweight, q) and torch.equal(quantized.scale, s)
    x = torch.randn(3, 320)
    rounded = x.bfloat16().float() @ (q.float() * s.bfloat16().float()).T
    assert (quantized.matrix().matmul(x) - rounded).abs().max() <= 2**-8 * rounded.abs().max()
    rows = torch.randn(40, 320)
    assert torch.allclose(quantized.matrix().matmul(rows), rows @ (q.float() * s).T, atol=1e-4, rtol=1e-4)
    assert torch.equal(quantized.matrix().dequantize(), q.float() * s)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shared", ["float", "packed", "packed, twice as wide"])
@pytest.mark.parametrize("swiglu_limit", [None, 0.5])
def test_fused_routed_experts_give_the_per_expert_loops_bits(kind, dtype, shared, swiglu_limit, monkeypatch, body):
    """The one-call routed experts (decode, verification) against the per-expert loop of model/moe.py on
    the same packed weights: the same bits, with 5 of 8 experts on this rank (first one 2, as under expert
    parallelism; tokens routed to the others are skipped), a partial 16-row block in both products, odd
    column counts, and for fp8 a down projection whose columns start 64 into their FP8 blocks (TP). The shared
    expert as float weights (its own torch path first), packed like the experts (swept in their passes, same
    call), and packed with two experts' width (its own passes, same call). With a SwiGLU clamp (GLM-5.3-Flash) low
    enough that most gates and ups are clamped."""
    from types import SimpleNamespace

    from dsaserve.model import moe as moe_module

    hidden, inter, experts, first, local = 200, 72, 8, 2, 5
    n_shared = 2 if shared == "packed, twice as wide" else 1
    cfg = SimpleNamespace(hidden_size=hidden, moe_intermediate_size=inter, n_routed_experts=experts,
                          n_shared_experts=n_shared, num_experts_per_tok=3, n_group=1, topk_group=1,
                          norm_topk_prob=True, routed_scaling_factor=2.5)
    layer = moe_module.MoE(cfg, swiglu_limit=swiglu_limit)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in list(layer.named_parameters()):
            p.data = (torch.randn(p.shape, generator=g) * 0.2).to(torch.float32 if "gate." in name else dtype)
    gate_up = QuantizedWeight(kind, 2 * inter, hidden, experts=local)
    down = QuantizedWeight(kind, hidden, inter, experts=local, col_offset=64 if kind == "fp8" else 0)
    for e in range(local):
        gate_up.load_rows(0, torch.randn(2 * inter, hidden, generator=g) * 0.2, expert=e)
        down.load_rows(0, torch.randn(hidden, inter, generator=g) * 0.2, expert=e)
    del layer.experts_gate_up, layer.experts_down
    layer.experts_gate_up, layer.experts_down, layer.first_expert = gate_up, down, first
    if shared != "float":
        pack_gated_mlp(layer.shared_experts, kind, hidden, inter * n_shared, g)
    calls = []
    real = moe_module.add_routed_experts
    monkeypatch.setattr(moe_module, "add_routed_experts",
                        lambda *a: calls.append(len(a) >= 7 and a[6] is not None) or real(*a))
    for tokens in (1, 3, 9, 16):
        x = torch.randn(tokens, hidden, generator=g).to(dtype)
        fused = layer(x)
        monkeypatch.setattr(moe_module, "fused_applies", lambda *a: False)
        loop = layer(x)
        monkeypatch.setattr(moe_module, "fused_applies", real_fused_applies)
        assert torch.equal(fused, loop), (tokens, (fused.float() - loop.float()).abs().max())
    assert calls == [shared != "float"] * 4  # the shared expert in the same call where it is packed


from dsaserve.quantization.packed_experts import fused_applies as real_fused_applies  # noqa: E402


def pack_gated_mlp(mlp, kind: str, hidden: int, inter: int, g: torch.Generator) -> None:
    """Random packed weights of `kind` for a GatedMLP (fp8: its down projection's columns 64 into their blocks)."""
    gate_up = QuantizedWeight(kind, 2 * inter, hidden)
    down = QuantizedWeight(kind, hidden, inter, col_offset=64 if kind == "fp8" else 0)
    gate_up.load_rows(0, torch.randn(2 * inter, hidden, generator=g) * 0.2)
    down.load_rows(0, torch.randn(hidden, inter, generator=g) * 0.2)
    del mlp.gate_up_proj, mlp.down_proj.weight
    mlp.gate_up_proj, mlp.down_proj.weight = gate_up, down


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("swiglu_limit", [None, 0.5])
def test_one_call_gated_mlp_gives_the_three_calls_bits(kind, dtype, swiglu_limit, monkeypatch, body):
    """A gated MLP (the shared experts, a dense layer's MLP) in one native call against its two products with
    torch's SiLU and product between them: the same bits, for 1 to 16 rows, an odd hidden size (padded
    columns), an intermediate size past one scale group, and for fp8 a down projection whose columns start
    64 into their FP8 blocks (a tensor-parallel rank's share); with and without a SwiGLU clamp."""
    from dsaserve.model import layers

    hidden, inter = 201, 136
    mlp = layers.GatedMLP(hidden, inter, first_column=64 if kind == "fp8" else 0, swiglu_limit=swiglu_limit)
    g = torch.Generator().manual_seed(3)
    pack_gated_mlp(mlp, kind, hidden, inter, g)
    calls = []
    real = layers.gated_mlp
    monkeypatch.setattr(layers, "gated_mlp", lambda *a: calls.append(1) or real(*a))
    for tokens in (1, 3, 16):
        x = torch.randn(tokens, hidden, generator=g).to(dtype)
        with torch.inference_mode():
            fused = mlp(x)
            monkeypatch.setattr(layers, "fused_applies", lambda *a: False)
            three = mlp(x)
            monkeypatch.setattr(layers, "fused_applies", real_fused_applies)
        assert fused.shape == three.shape == x.shape and fused.dtype == dtype
        assert torch.equal(fused, three), (tokens, (fused.float() - three.float()).abs().max())
    assert len(calls) == 3


@pytest.mark.skipif(not torch_ops.load(), reason="dsaserve's torch operators could not be built here (needs a C++ "
                                                   "compiler)")
@pytest.mark.parametrize("groups", [(1, 1), (4, 2)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_router_operator_chooses_the_torch_operators_experts(groups, dtype, monkeypatch, body):
    """Per body family (its dot products: AVX-512 or the portable loop under AVX2), the one-call router against
    Router's torch operators: the same experts in the same order and weights
    within fp32 rounding (the dot products sum in another order), normalized and not, with group-limited
    routing (4 groups of 8, 2 kept), and a hidden size that is not a multiple of the vector width. Scores are
    spread apart so that no two candidates tie."""
    from types import SimpleNamespace

    from dsaserve.model import moe as moe_module
    from dsaserve.native import torch_ops as ops

    n_group, topk_group = groups
    hidden, experts = 203, 32
    for normalize in (True, False):
        cfg = SimpleNamespace(hidden_size=hidden, n_routed_experts=experts, num_experts_per_tok=6, n_group=n_group,
                              topk_group=topk_group, norm_topk_prob=normalize, routed_scaling_factor=2.5)
        router = moe_module.Router(cfg)
        g = torch.Generator().manual_seed(5)
        with torch.no_grad():
            router.weight.copy_(torch.randn(experts, hidden, generator=g) * 0.1)
            router.e_score_correction_bias.copy_(
                torch.linspace(-0.3, 0.3, experts)[torch.randperm(experts, generator=g)])
        x = (torch.randn(9, hidden, generator=g) * 2).to(dtype)
        calls = []
        real = torch.ops.dsaserve.moe_route.default
        monkeypatch.setattr(moe_module, "one_operator", lambda *a: calls.append(1) or True)
        with torch.inference_mode():
            weights, ids = router(x)
            monkeypatch.setattr(moe_module, "one_operator", lambda *a: False)
            ref_weights, ref_ids = router(x)
        assert calls == [1] and real is torch.ops.dsaserve.moe_route.default and ops.load()
        assert ids.dtype == torch.long and weights.dtype == torch.float32
        assert torch.equal(ids, ref_ids)
        assert torch.allclose(weights, ref_weights, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("kind", ["int4", "int8"])
def test_strided_per_head_activations_are_read_in_place(kind, body):
    """Per-head products take a strided view (one head's columns of a token, as MLA's q_nope is at decode)
    without a copy, and a copy where rows are not consecutive (several tokens): each head's result as its own
    product gives it, strided or not."""
    heads, n, k = 3, 40, 96
    weight = QuantizedWeight(kind, n, k, experts=heads)
    g = torch.Generator().manual_seed(9)
    for h in range(heads):
        weight.load_rows(0, torch.randn(n, k, generator=g), expert=h)
    for tokens in (1, 5):
        wide = torch.randn(tokens, heads, k + 32, generator=g).bfloat16()
        rows = wide[..., :k].transpose(0, 1)  # [heads, tokens, k], rows 128 + 32 apart, heads k + 32 apart
        assert not rows.is_contiguous()
        with torch.inference_mode():
            one_by_one = torch.stack([weight.matrix(h).matmul(rows[h]) for h in range(heads)])
            assert torch.equal(weight.batched_matmul(rows), one_by_one)
            assert torch.equal(weight.batched_matmul(rows.contiguous()), one_by_one)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_call_absorbed_query_gives_the_operators_bits(kind, dtype, monkeypatch, body):
    """MLA's absorbed query [q_nope · W_UK | rope(q_rope)] and q_resid from one native call against the
    products, norm, split, rotary embedding and concatenation it replaces: the same bits, for 1 to 16 tokens
    and both rotary pair orders."""
    from dsaserve.attention import SparseAttention
    from dsaserve.attention.indexer_selection import Selection
    from dsaserve.config import ModelConfig
    from dsaserve.demo.checkpoint_builder import small_config
    from dsaserve.model import mla as mla_module
    from dsaserve.prepared_calls import forget_prepared

    g = torch.Generator().manual_seed(10)
    for interleaved in (False, True):
        cfg = ModelConfig.from_dict(small_config(rope_interleave=interleaved, q_lora_rank=144))
        attn = mla_module.MLAAttention(cfg, 0, SparseAttention(), Selection(cfg.index_topk))
        heads, nope, rank = attn.num_heads, attn.nope_dim, attn.kv_lora_rank
        q_a = QuantizedWeight(kind, cfg.q_lora_rank, cfg.hidden_size)
        q_b = QuantizedWeight(kind, heads * cfg.qk_head_dim, cfg.q_lora_rank)
        w_uk = QuantizedWeight(kind, rank, nope, experts=heads)
        q_a.load_rows(0, torch.randn(cfg.q_lora_rank, cfg.hidden_size, generator=g) * 0.2)
        q_b.load_rows(0, torch.randn(heads * cfg.qk_head_dim, cfg.q_lora_rank, generator=g) * 0.2)
        for h in range(heads):
            w_uk.load_rows(0, torch.randn(rank, nope, generator=g) * 0.3, expert=h)
        del attn.q_a_proj.weight, attn.q_b_proj.weight, attn.w_uk
        attn.q_a_proj.weight, attn.q_b_proj.weight, attn.w_uk = q_a, q_b, w_uk
        attn.q_a_layernorm.weight.data = (torch.rand(cfg.q_lora_rank, generator=g) + 0.5).to(dtype)
        for tokens in (1, 3, 16):
            x = torch.randn(tokens, cfg.hidden_size, generator=g).to(dtype)
            half = cfg.qk_rope_head_dim // 2
            cos, sin = (torch.randn(tokens, half, generator=g).to(dtype),
                        torch.randn(tokens, half, generator=g).to(dtype))
            with torch.inference_mode():
                calls, real_op = [], torch.ops.dsaserve.mla_query
                monkeypatch.setattr(torch.ops.dsaserve, "mla_query", type("Counted", (), {
                    "default": staticmethod(lambda *a: calls.append(1) or real_op.default(*a))}))
                q_resid, query = attn.absorbed_query(x, cos, sin)
                assert calls == [1]  # the one native call
                monkeypatch.setattr(attn, "query_binding", lambda: None)  # the operators one by one
                forget_prepared(attn)
                ref_resid, ref_query = attn.absorbed_query(x, cos, sin)
                assert calls == [1]
                monkeypatch.undo()
                forget_prepared(attn)
            assert query.shape == (tokens, heads, rank + cfg.qk_rope_head_dim) and query.dtype == dtype
            assert torch.equal(q_resid, ref_resid) and torch.equal(query, ref_query), (interleaved, tokens)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_call_attention_output_gives_the_operators_bits(kind, dtype, body):
    """o_proj(attended latents · W_UVᵀ) from one native call against the per-head product, reshape and o_proj
    it replaces: the same bits, for 1 to 16 tokens, the latents a strided view as attention leaves them."""
    from dsaserve.attention import SparseAttention
    from dsaserve.attention.indexer_selection import Selection
    from dsaserve.config import ModelConfig
    from dsaserve.demo.checkpoint_builder import small_config
    from dsaserve.model import mla as mla_module

    g = torch.Generator().manual_seed(11)
    cfg = ModelConfig.from_dict(small_config())
    attn = mla_module.MLAAttention(cfg, 0, SparseAttention(), Selection(cfg.index_topk))
    heads, rank, v = attn.num_heads, attn.kv_lora_rank, attn.v_dim
    w_uv = QuantizedWeight(kind, v, rank, experts=heads)
    o_proj = QuantizedWeight(kind, cfg.hidden_size, heads * v)
    for h in range(heads):
        w_uv.load_rows(0, torch.randn(v, rank, generator=g) * 0.3, expert=h)
    o_proj.load_rows(0, torch.randn(cfg.hidden_size, heads * v, generator=g) * 0.2)
    del attn.w_uv, attn.o_proj.weight
    attn.w_uv, attn.o_proj.weight = w_uv, o_proj
    for tokens in (1, 3, 16):
        wide = torch.randn(tokens, heads, rank + cfg.qk_rope_head_dim, generator=g).to(dtype)
        latent = wide[..., :rank]
        with torch.inference_mode(), torch.profiler.profile() as prof:
            one_call = attn.attention_output(latent)
        assert any(e.name == "dsaserve::mla_output" for e in prof.events())
        with torch.inference_mode():
            two_products = attn.o_proj(mla_module.per_head(latent, attn.w_uv).reshape(tokens, -1))
        assert one_call.shape == (tokens, cfg.hidden_size) and one_call.dtype == dtype
        assert torch.equal(one_call, two_products), tokens


def test_gathered_operator_arguments_follow_the_modules_tensors(body):
    """MLA gathers its native calls' weight arguments once (prepared_calls.py); when its tensors are
    replaced (`_apply`, as .to() and to_empty() do) or a weight is swapped and `forget_prepared` is called, the
    next call reads the new tensors, and gives what they give."""
    from dsaserve.attention import SparseAttention
    from dsaserve.attention.indexer_selection import Selection
    from dsaserve.config import ModelConfig
    from dsaserve.demo.checkpoint_builder import small_config
    from dsaserve.model import mla as mla_module
    from dsaserve.prepared_calls import forget_prepared

    g = torch.Generator().manual_seed(12)
    cfg = ModelConfig.from_dict(small_config())
    attn = mla_module.MLAAttention(cfg, 0, SparseAttention(), Selection(cfg.index_topk))
    heads, rank, v = attn.num_heads, attn.kv_lora_rank, attn.v_dim

    def packed_w_uv(scale: float) -> QuantizedWeight:
        w_uv = QuantizedWeight("int8", v, rank, experts=heads)
        for h in range(heads):
            w_uv.load_rows(0, torch.randn(v, rank, generator=g) * scale, expert=h)
        return w_uv

    o_proj = QuantizedWeight("int8", cfg.hidden_size, heads * v)
    o_proj.load_rows(0, torch.randn(cfg.hidden_size, heads * v, generator=g) * 0.2)
    del attn.w_uv, attn.o_proj.weight
    attn.w_uv, attn.o_proj.weight = packed_w_uv(0.3), o_proj
    latent = torch.randn(2, heads, rank, generator=g)
    with torch.inference_mode():
        first = attn.attention_output(latent)
        gathered = attn.prepared("output", lambda: None).native_args
        assert gathered[0] is attn.w_uv.qweight
        attn._apply(lambda t: t.clone())  # new tensor objects, same values
        assert gathered[0] is not attn.w_uv.qweight
        assert torch.equal(attn.attention_output(latent), first)
        gathered = attn.prepared("output", lambda: None).native_args
        assert gathered[0] is attn.w_uv.qweight and gathered[3] is attn.o_proj.weight.qweight
        del attn.w_uv
        attn.w_uv = packed_w_uv(0.6)
        forget_prepared(attn)
        swapped = attn.attention_output(latent)
        expected = attn.o_proj(mla_module.per_head(latent, attn.w_uv).reshape(2, -1))
    assert torch.equal(swapped, expected) and not torch.equal(swapped, first)


@pytest.mark.skipif(not (torch_ops.cpu_kernels() == "avx512_bf16"
                         and torch.ops.dsaserve.fp8_bf16_path() == "avx512_vbmi"),
                    reason="the fp8 table decode needs AVX-512 VBMI besides the kernels' AVX-512 BF16 (this CPU's "
                           f"kernels: {torch_ops.cpu_kernels()})")
def test_fp8_table_decode_gives_the_bits_of_the_shift_decode():
    """fp8 by bf16 activations, 1 to 16 rows (single blocks, block pairs, a partial last block, an odd column pair):
    the VBMI table lookups and the shifts and masks (native_kernels 'avx512') give the same bf16 bits."""
    q, scale_inv = quantize_fp8(torch.randn(70, 390))
    q = q.view(torch.uint8)
    q[3, :40] = torch.arange(40, dtype=torch.uint8)  # zero and the subnormals among the bytes
    scale = fp8_row_scales(scale_inv, (0, 70), (0, 390), (70, 390), (128, 128))
    x = torch.randn(16, 390).bfloat16()
    n, k = q.shape
    packed = formats.pack("fp8", q, scale)
    args = (formats.KINDS["fp8"], formats.group_of("fp8", k), 0, n, k)
    results = {}
    try:
        for choice in ("auto", "avx512"):
            torch_ops.configure(choice)
            results[choice] = (torch.ops.dsaserve.fp8_bf16_path(),
                               [torch.ops.dsaserve.quant_linear(x[:m], *packed, *args) for m in range(1, 17)])
    finally:
        torch_ops.configure("auto")
    assert results["auto"][0] == "avx512_vbmi" and results["avx512"][0] == "avx512_bf16"
    for table, shifts in zip(results["auto"][1], results["avx512"][1]):
        assert torch.equal(table.view(torch.int16), shifts.view(torch.int16))
