// Which instructions this CPU has (asked at run time), and which body family the process runs (the engine's
// cpu_isa option, set once at load by set_cpu_isa). Every operator with several bodies asks use_*() before it
// enters one: a body compiled for an ISA is never entered on a CPU without it, nor when the choice excludes it.
#pragma once

#include <atomic>

#if defined(__x86_64__)
#define DSASERVE_X86 1
#else
#define DSASERVE_X86 0
#endif

namespace dsaserve {

// The AVX2 bodies: 256-bit integer and float vectors, FMA, F16C (every x86-64 server CPU since 2013).
inline bool cpu_has_avx2() {
#if DSASERVE_X86
    static const bool has = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                            __builtin_cpu_supports("f16c");
    return has;
#else
    return false;
#endif
}

// The AVX-512F bodies (Skylake-SP to Ice Lake, Zen 4): 512-bit vectors with byte and word operations, no BF16.
inline bool cpu_has_avx512f() {
#if DSASERVE_X86
    static const bool has = cpu_has_avx2() && __builtin_cpu_supports("avx512f") &&
                            __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
                            __builtin_cpu_supports("avx512dq");
    return has;
#else
    return false;
#endif
}

inline bool cpu_has_avx512_bf16() {
#if DSASERVE_X86
    static const bool has = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                            __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bf16") &&
                            __builtin_cpu_supports("f16c") && __builtin_cpu_supports("fma");
    return has;
#else
    return false;
#endif
}

// Body families, in the order of what they need: a CPU that runs one runs those before it. avx512 is the AVX2
// family with the packed-weight products' blocks in 512-bit registers (quant_linear_avx512f.cpp).
enum class Isa : int { none = 0, avx2 = 1, avx512 = 2, avx512_bf16 = 3 };

// The family chosen for this process: the best the CPU has until set_cpu_isa says otherwise.
inline std::atomic<int>& isa_choice() {
    static std::atomic<int> choice{static_cast<int>(cpu_has_avx512_bf16() ? Isa::avx512_bf16
                                                    : cpu_has_avx512f()   ? Isa::avx512
                                                    : cpu_has_avx2()      ? Isa::avx2
                                                                          : Isa::none)};
    return choice;
}

inline Isa chosen_isa() { return static_cast<Isa>(isa_choice().load(std::memory_order_relaxed)); }

inline const char* isa_name(Isa isa) {
    switch (isa) {
        case Isa::avx512_bf16: return "avx512_bf16";
        case Isa::avx512: return "avx512";
        case Isa::avx2: return "avx2";
        default: return "none";
    }
}

// Whether the AVX-512 BF16 bodies run: the CPU has them and the choice is theirs.
inline bool use_avx512_bf16() { return chosen_isa() == Isa::avx512_bf16 && cpu_has_avx512_bf16(); }

// Whether the AVX2 bodies run (chosen: on an AVX-512 CPU they run only when cpu_isa asks for them). The avx512
// family runs them too, for every operator without a 512-bit body.
inline bool use_avx2() { return (chosen_isa() == Isa::avx2 || chosen_isa() == Isa::avx512) && cpu_has_avx2(); }

// Whether the AVX-512F bodies run (the avx512 family: AVX-512 without BF16, or cpu_isa 'avx512' asking for it).
inline bool use_avx512f() { return chosen_isa() == Isa::avx512 && cpu_has_avx512f(); }

// The avx512 family on a CPU with AVX-512 VNNI (Cascade Lake, Ice Lake): int4 weights by int8-rounded activations
// take vpdpbusd.
inline bool use_avx512f_vnni() {
#if DSASERVE_X86
    static const bool has = __builtin_cpu_supports("avx512vnni");
    return has && use_avx512f();
#else
    return false;
#endif
}

// int8 dot products (vpdpbusd): the int8 indexer keys' scores.
inline bool use_avx512_vnni() {
#if DSASERVE_X86
    static const bool has = __builtin_cpu_supports("avx512vnni");
    return has && use_avx512_bf16();
#else
    return false;
#endif
}

// int8 dot products (vpdpbusd) and byte permutes (vpermb): the int4 kernel's path for bf16 activations.
inline bool use_avx512_vnni_vbmi() {
#if DSASERVE_X86
    static const bool has = __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vbmi");
    return has && use_avx512_bf16();
#else
    return false;
#endif
}

}  // namespace dsaserve
