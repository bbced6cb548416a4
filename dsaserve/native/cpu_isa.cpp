// The body family the native operators run (cpu_features.h): what this CPU can run, the choice, and setting it
// (torch_ops.configure, once per process at load, from the engine's cpu_isa option).
#include <torch/library.h>

#include <string>
#include <vector>

#include "cpu_features.h"

namespace {

using dsaserve::Isa;

// The families this CPU runs, best first ("none": torch's operators, always possible).
std::vector<std::string> cpu_isas() {
    std::vector<std::string> out;
    if (dsaserve::cpu_has_avx512_bf16()) out.emplace_back("avx512_bf16");
    if (dsaserve::cpu_has_avx512f()) out.emplace_back("avx512");
    if (dsaserve::cpu_has_avx2()) out.emplace_back("avx2");
    out.emplace_back("none");
    return out;
}

std::string cpu_kernels() { return dsaserve::isa_name(dsaserve::chosen_isa()); }

// Chooses a family; an error that names the missing instructions where the CPU cannot run it.
void set_cpu_isa(const std::string& name) {
    Isa isa;
    if (name == "avx512_bf16") {
        TORCH_CHECK(dsaserve::cpu_has_avx512_bf16(), "cpu_isa='avx512_bf16': this CPU lacks AVX-512 BF16 (it needs "
                    "avx512f, avx512bw, avx512vl, avx512_bf16, f16c and fma)");
        isa = Isa::avx512_bf16;
    } else if (name == "avx512") {
        TORCH_CHECK(dsaserve::cpu_has_avx512f(), "cpu_isa='avx512': this CPU lacks AVX-512 (it needs avx512f, "
                    "avx512bw, avx512vl, avx512dq besides avx2, fma and f16c)");
        isa = Isa::avx512;
    } else if (name == "avx2") {
        TORCH_CHECK(dsaserve::cpu_has_avx2(), "cpu_isa='avx2': this CPU lacks AVX2 (it needs avx2, fma and f16c)");
        isa = Isa::avx2;
    } else {
        TORCH_CHECK(name == "none", "cpu_isa '", name, "' is not one of avx512_bf16, avx512, avx2, none");
        isa = Isa::none;
    }
    dsaserve::isa_choice().store(static_cast<int>(isa), std::memory_order_relaxed);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(dsaserve, m) {
    m.def("cpu_isas() -> str[]", &cpu_isas);
    m.def("cpu_kernels() -> str", &cpu_kernels);
    m.def("set_cpu_isa(str name) -> ()", &set_cpu_isa);
}
