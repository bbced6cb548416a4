"""Weight-only quantization: weights kept in 8 or 4 bits (FP8 as shipped, int8, int4) and multiplied in
that form (formats.py, quantized_weight.py; kernels in native/quant_linear.cpp)."""
