"""QuantizedWeight: a weight [*, N, K] kept packed in 8 or 4 bits (or packed bf16) and multiplied in that form.

For a few activation rows (decode, draft verification) the native kernel reads the packed weight once
and converts it in registers; for many rows (prefill) the weight is dequantized, transposed, and the
torch GEMM does the work. Where no native body multiplies packed weights, int8 weights are kept in torch's row
layout instead (ROWS: [N, K] and a scale per row), which torch's int8 matmul reads: the blocks serve only the
kernels. Where the Triton kernels run (the CUDA path), every quantized form takes a row layout (FP8: [N, K] bytes and
a scale per row and 128-column block, as shipped; int8: as above; int4: two columns a byte, [N, ⌈K / 2⌉], and a
scale per row and 128 columns; triton_ops/weight_tiles.py) and triton_ops/quantized_linear.py multiplies it so.
Stacked experts share one QuantizedWeight with a leading expert dimension; `expert(e)` views one of them in place.
Loading writes rows from float tensors (quantizing them) or, for FP8 checkpoints read as shipped, from the
checkpoint's own bytes and block scales.
"""

from __future__ import annotations

import torch

from dsaserve import triton_ops
from dsaserve.native import torch_ops
from dsaserve.prepared_calls import PreparedCalls
from dsaserve.quantization import formats
from dsaserve.quantization.fp8_blocks import Fp8Slice, as_float

KERNEL_ROWS = 16  # activation rows the native kernel takes; more go to the GEMM
FALLBACK_SCRATCH = 32 << 20  # bytes of one weight's rows dequantized at a time where no kernel runs
BLOCKS, ROWS = "blocks", "rows"  # the native kernels' packed layout; [N, K] and a scale per row (and block, fp8)


def layout_for(kind: str, k: int, col_offset: int) -> str:
    """ROWS for quantized weights where the Triton kernels run, and for int8 weights (not starting inside a scale group)
    where no native body runs the packed products and torch has its int8 matmul; BLOCKS otherwise. Chosen when the
    weight is made, from the process's kernels.
    Torch's int8 matmul reads past rows whose length is not a multiple of 16 (a segfault with torch 2.13 on
    AVX-512): those widths, rare in real models, keep the blocks and the dequantized slabs."""
    if kind in formats.QUANTIZATION_MODES and triton_ops.active_device() is not None:
        return ROWS
    if kind == "int8" and not col_offset and k % 64 == 0 and hasattr(torch, "_weight_int8pack_mm"):
        return BLOCKS if torch_ops.runs("packed_products") else ROWS
    return BLOCKS


def row_layout(weight) -> bool:
    """Whether `weight` is quantized in the row layout (what the Triton kernels multiply)."""
    return isinstance(weight, QuantizedWeight) and weight.layout == ROWS


def operator_args(kind: str, n: int, k: int, col_offset: int) -> tuple[int, int, int, int, int]:
    """(kind code, scale group, col_offset, N, K): what the operators take after the weight and its scales."""
    return formats.KINDS[kind], formats.group_of(kind, k), col_offset, n, k


def packed_args(weight) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """(packed bytes, scales, operator_args) of a QuantizedWeight or PackedMatrix: what a native call takes for it."""
    if weight.layout != BLOCKS:
        raise RuntimeError("a weight kept in torch's row layout (made while no native body ran) reached a native "
                           "kernel: build the model under the cpu_isa it runs with")
    return weight.qweight, weight.scale, list(weight.args)


class PackedMatrix:
    """The packed form of one [N, K] weight and its product with activations (views, no copies)."""

    def __init__(self, kind: str, qweight: torch.Tensor, scale: torch.Tensor, n: int, k: int, col_offset: int,
                 layout: str = BLOCKS, block_scale: torch.Tensor | None = None):
        """block_scale: an FP8 weight's scales per 128 × 128 block where it has them (fp8_scaled_mm.block_scales),
        for products on the FP8 tensor cores."""
        self.kind, self.qweight, self.scale, self.n, self.k, self.col_offset = kind, qweight, scale, n, k, col_offset
        self.layout, self.block_scale = layout, block_scale
        self.args = operator_args(kind, n, k, col_offset)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., K] @ weightᵀ → [..., N] in x's dtype."""
        rows = x if x.dim() == 2 else x.reshape(-1, self.k)  # (a reshape is one more operator call per product)
        if rows.shape[0] == 0:  # e.g. lm_head in a step of prompt chunks only
            return x.new_empty(*x.shape[:-1], self.n)
        if self.layout == ROWS and triton_ops.runs_on(rows):
            y = self._triton_rows(rows)
        elif self.layout == ROWS and self.kind != "int8":
            y = self._by_slabs(rows, self._rows_slab)
        elif self.layout == ROWS:
            y = self._int8_rows(rows) if rows.shape[0] <= KERNEL_ROWS else self._by_slabs(rows, self._rows_slab)
        elif x.is_cpu and torch_ops.runs("packed_products"):
            if rows.shape[0] <= KERNEL_ROWS:
                y = torch.ops.dsaserve.quant_linear.default(rows, self.qweight, self.scale, *self.args)
            else:
                y = self._by_slabs(rows, self._native_slab)
        else:
            y = self._by_slabs(rows, self._torch_slab)
        return y if x.dim() == 2 else y.view(*x.shape[:-1], self.n)

    def _torch_slab(self, dtype: torch.dtype, r0: int, r1: int) -> torch.Tensor:
        """Rows [r0, r1) of the weight, transposed and dequantized in torch (no native body here): the packed blocks
        reordered and widened in one copy, the scales applied in place by broadcasting (each row's, or each row's
        per group), not by gathering a scale per element. Other layouts (a slice starting inside its scale
        groups) take the reference dequantization."""
        kind, group, col_offset, _, k = self.args
        b0, b1 = r0 // 16, -(-r1 // 16)
        q, scale = self.qweight[b0:b1], self.scale[b0:b1]  # [B, K2, 32 (16 for int4)], [B, G, 16]
        blocks, k2, groups = q.shape[0], q.shape[1], scale.shape[1]
        kp = 2 * k2
        if col_offset or (groups > 1 and kp != groups * group):
            return self.dequantize(dtype, (r0, r1)).T
        # A row's column pair is one unit (bf16: 4 bytes, fp8 and int8: 2, int4: 1): the blocks' [K2, 16] units
        # transposed to [16, K2] (a plain transpose: torch copies those fast), then widened.
        unit = {"bf16": torch.int32, "fp8": torch.int16, "int8": torch.int16, "int4": torch.uint8}[self.kind]
        t = q.contiguous().view(torch.uint8).view(unit).view(blocks, k2, 16).transpose(1, 2).contiguous()
        if self.kind == "int4":
            t = torch.stack([t & 0xF, t >> 4], dim=-1).view(torch.int8) - 8
        else:
            t = t.view({"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn, "int8": torch.int8}[self.kind])
        # widened and scaled in one pass (int8 times fp32 computes in fp32)
        w = t.reshape(blocks, 16, groups, kp // groups) * scale.permute(0, 2, 1).unsqueeze(-1)
        return w.view(blocks * 16, kp)[r0 - b0 * 16:r1 - b0 * 16, :k].to(dtype).T

    def _int8_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """A few rows by torch's int8 matmul over the row layout. It takes bf16 activations and scales (its fp32
        form is several times slower), so both are rounded to bf16 here: an error of the order of the int8
        weights' own, which is what a model without a native body gives up for its speed."""
        y = torch._weight_int8pack_mm(rows.to(torch.bfloat16).contiguous(), self.qweight,
                                      self.scale.view(-1).to(torch.bfloat16))
        return y.to(rows.dtype)

    def _triton_rows(self, rows: torch.Tensor) -> torch.Tensor:
        from dsaserve.triton_ops import fp8_scaled_mm
        from dsaserve.triton_ops.quantized_linear import quantized_matmul  # the stored form, widened in registers

        if self.block_scale is not None and fp8_scaled_mm.takes(rows, self.k, self.n, self.col_offset):
            return fp8_scaled_mm.scaled_matmul(rows, self.qweight, self.block_scale)  # on Hopper's FP8 tensor cores
        return quantized_matmul(rows, self.qweight, self.scale, self.kind, self.col_offset)

    def _rows_slab(self, dtype: torch.dtype, r0: int, r1: int) -> torch.Tensor:
        """Rows [r0, r1) of a row-layout weight, dequantized and transposed: [K, r1 - r0]."""
        if self.kind == "int8":
            return (self.qweight[r0:r1].float() * self.scale[r0:r1]).to(dtype).T
        q = formats.unpack_int4_rows(self.qweight[r0:r1], self.k) if self.kind == "int4" else self.qweight[r0:r1]
        return formats.dequantize_reference(self.kind, q, self.scale[r0:r1], self.col_offset).to(dtype).T

    def _native_slab(self, dtype: torch.dtype, r0: int, r1: int) -> torch.Tensor:
        """Rows [r0, r1) of the weight, transposed and dequantized by the native kernel: [K, r1 - r0]."""
        b0, b1 = r0 // 16, -(-r1 // 16)
        kind, group, col_offset, _, k = self.args
        return torch.ops.dsaserve.dequantize_t(self.qweight[b0:b1], self.scale[b0:b1], kind, group, col_offset,
                                               r1 - r0, k, dtype)

    def _by_slabs(self, rows: torch.Tensor, slab) -> torch.Tensor:
        """rows @ weightᵀ by torch's GEMM, the weight dequantized a slab of output rows at a time (FALLBACK_SCRATCH,
        `slab(dtype, r0, r1)` giving rows [r0, r1) transposed), so a product never holds a whole weight in floats (a
        head of 154,880 × 6,144 would be 3.8 GB in fp32). The GEMM runs in bf16 only where the kernels run their
        AVX-512 BF16 bodies: elsewhere torch's bf16 GEMM is many times slower than its fp32 one."""
        bf16_gemm = torch_ops.cpu_kernels() == "avx512_bf16"
        dtype = torch.float32 if rows.dtype == torch.bfloat16 and not bf16_gemm else rows.dtype
        xs = rows.to(dtype)
        step = max(16, FALLBACK_SCRATCH // (self.k * 4) // 16 * 16)
        if step >= self.n:
            return (xs @ slab(dtype, 0, self.n)).to(rows.dtype)
        y = rows.new_empty(rows.shape[0], self.n)
        for r0 in range(0, self.n, step):
            r1 = min(self.n, r0 + step)
            y[:, r0:r1] = xs @ slab(dtype, r0, r1)
        return y

    def dequantize(self, dtype: torch.dtype = torch.float32, rows: tuple[int, int] | None = None) -> torch.Tensor:
        """The weight [N, K] as floats (in torch: the kernels' reference, and their fallback); only rows [r0, r1)
        when given (r0 a multiple of 16, the packed layout's blocks)."""
        r0, r1 = rows or (0, self.n)
        if self.layout == ROWS:
            return self._rows_slab(dtype, r0, r1).T
        b0, b1 = r0 // 16, -(-r1 // 16)
        q, scale = formats.unpack(self.kind, self.qweight[b0:b1].cpu(), self.scale[b0:b1].cpu(), r1 - r0, self.k)
        w = formats.dequantize_reference(self.kind, q, scale, self.col_offset)
        return w.to(device=self.qweight.device, dtype=dtype)


class QuantizedWeight(PreparedCalls):
    def __init__(self, kind: str, out_features: int, in_features: int, experts: int | None = None, col_offset: int = 0):
        super().__init__()
        self.kind, self.out_features, self.in_features, self.col_offset = kind, out_features, in_features, col_offset
        self.args = operator_args(kind, out_features, in_features, col_offset)
        self.layout = layout_for(kind, in_features, col_offset)
        if self.layout == ROWS:
            stored = -(-in_features // 2) if kind == "int4" else in_features
            qshape, qdtype = (out_features, stored), torch.int8 if kind == "int8" else torch.uint8
            sshape = (out_features, formats.scale_columns(kind, in_features, col_offset))
        else:
            qshape, qdtype, sshape = formats.packed_shapes(kind, out_features, in_features, col_offset)
        lead = () if experts is None else (experts,)
        self.register_buffer("qweight", torch.empty(*lead, *qshape, dtype=qdtype))
        self.register_buffer("scale", torch.empty(*lead, *sshape))

    @property
    def shape(self) -> tuple[int, ...]:
        lead = self.qweight.shape[:-2] if self.layout == ROWS else self.qweight.shape[:-3]
        return tuple(lead) + (self.out_features, self.in_features)

    def matrix(self, expert: int | None = None) -> PackedMatrix:
        if expert is None:  # made once (after loading, on the weight's device), then reused by every product
            return self.prepared("matrix", self._whole_matrix)
        return PackedMatrix(self.kind, self.qweight[expert], self.scale[expert], self.out_features, self.in_features,
                            self.col_offset, self.layout)

    def _whole_matrix(self) -> PackedMatrix:
        blocks = None  # a checkpoint's 128 × 128 block scales, where the FP8 tensor cores take them (checked once)
        if self.layout == ROWS and self.kind == "fp8" and self.scale.dim() == 2 and triton_ops.runs_on(self.qweight):
            from dsaserve.triton_ops import fp8_scaled_mm

            if fp8_scaled_mm.unavailable(self.qweight.device) is None:
                blocks = fp8_scaled_mm.block_scales(self.scale)
        return PackedMatrix(self.kind, self.qweight, self.scale, self.out_features, self.in_features, self.col_offset,
                            self.layout, blocks)

    def batched_matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, M, K] by each of the B stacked weights: [B, M, N] (one attention head each)."""
        if x.shape[1] == 0:
            return x.new_empty(x.shape[0], 0, self.out_features)
        if x.is_cpu and self.layout == BLOCKS and torch_ops.runs("packed_products") and x.shape[1] <= KERNEL_ROWS:
            return torch.ops.dsaserve.quant_linear.default(x, self.qweight, self.scale, *self.args)  # strided x too
        if self.layout == ROWS and triton_ops.runs_on(x):  # every head in one launch
            from dsaserve.triton_ops.quantized_linear import quantized_matmul

            return quantized_matmul(x, self.qweight, self.scale, self.kind, self.col_offset)
        return torch.stack([self.matrix(b).matmul(x[b]) for b in range(x.shape[0])])

    def nbytes(self) -> int:
        return self.qweight.numel() * self.qweight.element_size() + self.scale.numel() * self.scale.element_size()

    @torch.no_grad()
    def load_rows(self, first: int, source, expert: int | None = None, name: str = "weight") -> None:
        """Rows [first, first + n) from a float tensor [n, K] (quantized here) or an Fp8Slice."""
        n, k = source.shape
        if k != self.in_features or first + n > self.out_features:
            raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(source.shape)}, which does not fit rows "
                             f"{first}… of a [{self.out_features}, {self.in_features}] weight")
        q, scale = self._stored_form(source)
        qweight, scales = (self.qweight, self.scale) if expert is None else (self.qweight[expert], self.scale[expert])
        if self.layout == ROWS:
            qweight[first:first + n] = formats.pack_int4_rows(q) if self.kind == "int4" else q
            scales[first:first + n] = scale
            return
        b0, b1 = first // 16, -(-(first + n) // 16)
        rows = min(self.out_features, b1 * 16) - b0 * 16
        if first % 16 or (n % 16 and first + n != self.out_features):  # rows share a block with others: merge
            cur_q, cur_s = formats.unpack(self.kind, qweight[b0:b1].cpu(), scales[b0:b1].cpu(), rows, self.in_features)
            cur_q, cur_s = cur_q.clone(), cur_s.clone()
            cur_q[first - b0 * 16: first - b0 * 16 + n] = q
            cur_s[first - b0 * 16: first - b0 * 16 + n] = scale
            q, scale = cur_q, cur_s
        formats.pack_into(self.kind, q, scale, qweight[b0:b1], scales[b0:b1])

    def _stored_form(self, source) -> tuple[torch.Tensor, torch.Tensor]:
        if isinstance(source, Fp8Slice) and self.kind == "fp8":
            if source.col_offset != self.col_offset:  # would requantize: the slices and the model disagree
                raise ValueError(f"{source.name}: its slice starts {source.col_offset} columns into an FP8 block, the "
                                 f"model's weight {self.col_offset}")
            return source.weight.view(torch.uint8), source.row_scales()  # the checkpoint's own bytes and scales
        if self.kind in ("int8", "int4"):
            return formats.quantize(self.kind, source)
        w = as_float(source).float()
        if self.kind == "fp8":
            return formats.quantize_fp8_rows(w, self.col_offset)
        return w.to(torch.bfloat16), torch.ones(w.shape[0], 1)
