"""The bytes a model's weights hold in each form, counted on the model itself built on the meta device
(so the count is the loader's, scales and padding included), for `doctor` and the benchmarks."""

from __future__ import annotations

import torch

from dsaserve.config import ModelConfig
from dsaserve.model.glm5_next import Glm5NextForCausalLM
from dsaserve.model.glm_moe_dsa import GlmMoeDsaForCausalLM
from dsaserve.quantization.apply import pack_weights
from dsaserve.quantization.packed import is_packed


def resident_bytes(cfg: ModelConfig, form: str | None, dtype: torch.dtype) -> int:
    """Bytes of one rank's weights (no MTP layer) with every projection packed in `form` (fp8, int8, int4,
    bf16; None: float), the other parameters in `dtype` (the router and the indexer's weights_proj fp32)."""
    with torch.device("meta"):
        model_class = Glm5NextForCausalLM if cfg.hybrid is not None else GlmMoeDsaForCausalLM
        model = model_class(cfg)
        if form is not None:
            pack_weights(model, lambda name: form)
    item = torch.empty((), dtype=dtype).element_size()
    total = sum(m.nbytes() for m in model.modules() if is_packed(m))
    return total + sum(p.numel() * (4 if name.endswith(model_class.FP32_PARAM_SUFFIXES) else item)
                       for name, p in model.named_parameters())
