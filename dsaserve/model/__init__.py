"""The GLM-MoE-DSA model and how to build it from a checkpoint directory."""

from __future__ import annotations

import torch

from dsaserve.config import ModelConfig
from dsaserve.distributed.parallel_context import ParallelContext
from dsaserve.model.glm5_next import Glm5NextForCausalLM
from dsaserve.model.glm_moe_dsa import GlmMoeDsaForCausalLM
from dsaserve.model.huge_pages import place_weights as place_in_huge_pages
from dsaserve.model.load_memory import available_memory, check_fits, default_scratch_budget, model_bytes, scratch_bytes
from dsaserve.model.loader import checkpoint_files, load_checkpoint, mtp_extras
from dsaserve.quantization.apply import pack_weights
from dsaserve.quantization.quantized_weight import ROWS, QuantizedWeight


def refuse_cpu_forms(model, device: torch.device) -> None:
    """Off the CPU, a quantized weight takes the row layout (what the Triton kernels read), never the CPU kernels'
    packed blocks."""
    cpu_only = sorted({m.kind for m in model.modules() if isinstance(m, QuantizedWeight) and m.layout != ROWS})
    if cpu_only:
        raise ValueError(f"weights packed for the CPU kernels ({', '.join(cpu_only)}) on device {device.type!r}: "
                         "those forms exist only on the CPU (off it, quantized weights take the row layout the Triton "
                         "kernels read); load with triton_kernels auto or on, or without quantization")


def load_model(cfg: ModelConfig, model_dir: str, dtype: torch.dtype, device: torch.device,
               attention_backend: str = "sparse", progress: bool = True, page_budget: int | None = None,
               with_mtp: bool = False, parallel: ParallelContext | None = None,
               weight_forms=None, decode_plan: bool = True, huge_pages: bool = True,
               scratch_budget: int | None = None) -> GlmMoeDsaForCausalLM:
    """Build the model without initializing weights, then fill every parameter from the checkpoint
    (the MTP layer too, with_mtp); with `parallel`, this rank's share of it; with `weight_forms` (a
    parameter name → fp8, int8, int4, bf16 or None), its projections packed (quantization/apply.py).
    A plain string packs every projection in that form. decode_plan: few-token steps through the layers' native
    pieces where they have them (model/decode_plan.py); off, always through the modules. huge_pages: the weights
    in memory advised for 2 MiB pages where Linux allows (model/huge_pages.py). scratch_budget: bytes the loading
    threads may use for conversions (default: model/load_memory.py's); loading refuses to start where the weights
    and that scratch exceed the memory available."""
    mtp = mtp_extras(cfg, model_dir) if with_mtp else None
    parallel = parallel or ParallelContext.single()
    model_class = Glm5NextForCausalLM if cfg.hybrid is not None else GlmMoeDsaForCausalLM
    with torch.device("meta"):
        model = model_class(cfg, attention_backend, page_budget, mtp, parallel, decode_plan)
        if isinstance(weight_forms, str):
            pack_weights(model, lambda name, form=weight_forms: form)
        elif weight_forms is not None:
            pack_weights(model, weight_forms)
        if device.type != "cpu":
            refuse_cpu_forms(model, device)
        for name, param in model.named_parameters():
            param.data = param.data.to(torch.float32 if name.endswith(model_class.FP32_PARAM_SUFFIXES) else dtype)
    budget = default_scratch_budget() if scratch_budget is None else scratch_budget
    if device.type == "cpu":
        form = weight_forms if isinstance(weight_forms, str) else None
        check_fits(cfg, model_bytes(model), scratch_bytes(len(checkpoint_files(model_dir)), budget),
                   available_memory(), form, dtype)
    model.to_empty(device=device)
    if huge_pages:
        place_in_huge_pages(model)
    model.tie_weights()  # (packed weights are not zeroed first: loading writes each of their bytes, padding included)
    load_checkpoint(model, cfg, model_dir, progress=progress, with_mtp=with_mtp, plan=parallel.plan,
                    scratch_budget=budget)
    return model.eval()


__all__ = ["Glm5NextForCausalLM", "GlmMoeDsaForCausalLM", "load_model"]
