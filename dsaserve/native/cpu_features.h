// Which instructions this CPU has, asked at run time: the native operators compile their AVX-512
// bodies for those instructions alone and take them only where the CPU reports them.
#pragma once

#if defined(__x86_64__)
#define DSASERVE_X86 1
#else
#define DSASERVE_X86 0
#endif

namespace dsaserve {

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

// int8 dot products (vpdpbusd): the int8 indexer keys' scores.
inline bool cpu_has_avx512_vnni() {
#if DSASERVE_X86
    static const bool has = cpu_has_avx512_bf16() && __builtin_cpu_supports("avx512vnni");
    return has;
#else
    return false;
#endif
}

// int8 dot products (vpdpbusd) and byte permutes (vpermb): the int4 kernel's path for bf16 activations.
inline bool cpu_has_avx512_vnni_vbmi() {
#if DSASERVE_X86
    static const bool has = cpu_has_avx512_bf16() && __builtin_cpu_supports("avx512vnni") &&
                            __builtin_cpu_supports("avx512vbmi");
    return has;
#else
    return false;
#endif
}

}  // namespace dsaserve
