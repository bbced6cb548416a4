// AMX tiles for the sparse path's kernels (selected_rows.cpp, index_scores.cpp, index_scores_int8.cpp): eight
// registers of 16 rows × 64 bytes, and the instructions that add the product of two of them into a third:
// tdpbf16ps (a 16 × 32 bf16 tile by a 32 × 16 one kept as 16 rows of column pairs, into 16 × 16 fp32) and
// tdpbsud (16 × 64 signed bytes by 64 × 16 unsigned bytes kept as 16 rows of column quads, into 16 × 16 int32).
//
// The kernels are templates over a Tiles type with one interface in two forms: HwTiles issues the instructions;
// EmuTiles computes the same products in plain C++ on a per-thread copy of the registers and checks each
// operation's shapes as the CPU would. The emulated form lets the kernels' layouts and loops run, and be
// tested, on CPUs without AMX; it is never chosen by default. Which form runs (or neither) is a process-wide
// mode (amx_mode.cpp's operators): `off` until dsaserve/native/amx.py has compared the hardware form with the
// AVX-512 kernels on this CPU.
#pragma once

#include <atomic>
#include <cstdint>
#include <cstring>

#include "cpu_features.h"

#if DSASERVE_X86
#include <immintrin.h>
#endif

namespace dsaserve {

enum class AmxMode : int { off = 0, hardware = 1, emulated = 2 };

inline std::atomic<int>& amx_mode_slot() {
    static std::atomic<int> mode{static_cast<int>(AmxMode::off)};
    return mode;
}

inline AmxMode amx_mode() { return static_cast<AmxMode>(amx_mode_slot().load(std::memory_order_relaxed)); }

// Kernel calls that took a tile body (either form) since load: what tests and doctor read to see them used.
inline std::atomic<int64_t>& amx_tile_calls() {
    static std::atomic<int64_t> calls{0};
    return calls;
}

// LDTILECFG's 64 bytes: palette 1, then bytes per row and rows for each of up to 16 tiles.
struct TileConfig {
    uint8_t palette;
    uint8_t start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};
static_assert(sizeof(TileConfig) == 64, "LDTILECFG reads 64 bytes");

// Every kernel uses all eight tiles at full size: 16 rows of 64 bytes (16 fp32, or 16 pairs of bf16).
inline TileConfig full_tiles() {
    TileConfig c;
    std::memset(&c, 0, sizeof(c));
    c.palette = 1;
    for (int t = 0; t < 8; ++t) {
        c.colsb[t] = 64;
        c.rows[t] = 16;
    }
    return c;
}

constexpr int kTileRows = 16;
constexpr int kTileBytes = 64;

#if DSASERVE_X86
#pragma GCC push_options
#pragma GCC target("amx-tile,amx-bf16,amx-int8")

// The instructions take tile numbers as immediates: each operation is a switch the compiler folds away.
// GCC's tile load (and ldtilecfg, which it tells reads 8 of the 64 bytes) has no memory clobber: nothing stops
// the compiler from delaying or dropping stores that only the tile load reads (a buffer filled just before), or
// from hoisting a later store (the next fill of that buffer) above it. A compiler barrier on both sides of each
// load keeps its buffer's stores in program order; the store gets the same, as not every GCC's header gives it
// a memory clobber.
#define DSASERVE_TILES_0_7(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7)
struct HwTiles {
    static void configure() {
        alignas(64) TileConfig c = full_tiles();
        __asm__ volatile("" ::: "memory");
        _tile_loadconfig(&c);
    }
    static void release() { _tile_release(); }
    template <int T>
    static void zero() {
        switch (T) {
#define DSASERVE_ZERO(t) case t: _tile_zero(t); break;
            DSASERVE_TILES_0_7(DSASERVE_ZERO)
#undef DSASERVE_ZERO
        }
    }
    template <int T>
    static void load(const void* base, int64_t stride) {
        __asm__ volatile("" ::: "memory");
        switch (T) {
#define DSASERVE_LOAD(t) case t: _tile_loadd(t, base, stride); break;
            DSASERVE_TILES_0_7(DSASERVE_LOAD)
#undef DSASERVE_LOAD
        }
        __asm__ volatile("" ::: "memory");
    }
    template <int T>
    static void store(void* base, int64_t stride) {
        __asm__ volatile("" ::: "memory");
        switch (T) {
#define DSASERVE_STORE(t) case t: _tile_stored(t, base, stride); break;
            DSASERVE_TILES_0_7(DSASERVE_STORE)
#undef DSASERVE_STORE
        }
        __asm__ volatile("" ::: "memory");
    }
    // C += A · B: the kernels' accumulators are tiles 0-3, one operand is tile 4 and the other 5, 6 or 7.
#define DSASERVE_DOTS(op, c) DSASERVE_DOT(op, c, 4, 5) DSASERVE_DOT(op, c, 4, 6) DSASERVE_DOT(op, c, 4, 7) \
                             DSASERVE_DOT(op, c, 5, 4) DSASERVE_DOT(op, c, 6, 4) DSASERVE_DOT(op, c, 7, 4)
#define DSASERVE_DOT(op, c, a, b) case c * 64 + a * 8 + b: op(c, a, b); break;
#define DSASERVE_ROLES_CHECK                                                                                     \
    static_assert(C >= 0 && C < 4 && ((A == 4 && B >= 5 && B < 8) || (B == 4 && A >= 5 && A < 8)),            \
                  "the kernels' tile roles: accumulators 0-3, operands 4 and 5-7")
    template <int C, int A, int B>
    static void dot_bf16() {
        DSASERVE_ROLES_CHECK;
        switch (C * 64 + A * 8 + B) {
            DSASERVE_DOTS(_tile_dpbf16ps, 0) DSASERVE_DOTS(_tile_dpbf16ps, 1)
            DSASERVE_DOTS(_tile_dpbf16ps, 2) DSASERVE_DOTS(_tile_dpbf16ps, 3)
        }
    }
    template <int C, int A, int B>
    static void dot_s8u8() {
        DSASERVE_ROLES_CHECK;
        switch (C * 64 + A * 8 + B) {
            DSASERVE_DOTS(_tile_dpbsud, 0) DSASERVE_DOTS(_tile_dpbsud, 1)
            DSASERVE_DOTS(_tile_dpbsud, 2) DSASERVE_DOTS(_tile_dpbsud, 3)
        }
    }
#undef DSASERVE_ROLES_CHECK
#undef DSASERVE_DOT
#undef DSASERVE_DOTS
};
#undef DSASERVE_TILES_0_7
#pragma GCC pop_options
#endif

// The same operations on a per-thread copy of the registers, with the CPU's shape rules checked (a breach
// would fault on the hardware): tdpbf16ps as the instruction set reference gives it, each pair of products
// added in fp32 (the hardware also treats bf16 denormals as zero; the kernels' tests allow for rounding).
struct EmuTiles {
    struct State {
        alignas(64) uint8_t tile[8][kTileRows][kTileBytes];
        TileConfig config;
        bool configured = false;
    };
    static State& state() {
        thread_local State s;
        return s;
    }
    static void require(bool ok, const char* what);
    static void configure() {
        State& s = state();
        s.config = full_tiles();
        s.configured = true;
        std::memset(s.tile, 0, sizeof(s.tile));
    }
    static void release() { state().configured = false; }
    template <int T>
    static void zero() {
        require(state().configured, "tile zero before configure");
        std::memset(state().tile[T], 0, sizeof(state().tile[T]));
    }
    template <int T>
    static void load(const void* base, int64_t stride) {
        State& s = state();
        require(s.configured, "tile load before configure");
        for (int r = 0; r < s.config.rows[T]; ++r)
            std::memcpy(s.tile[T][r], static_cast<const uint8_t*>(base) + r * stride, s.config.colsb[T]);
    }
    template <int T>
    static void store(void* base, int64_t stride) {
        State& s = state();
        require(s.configured, "tile store before configure");
        for (int r = 0; r < s.config.rows[T]; ++r)
            std::memcpy(static_cast<uint8_t*>(base) + r * stride, s.tile[T][r], s.config.colsb[T]);
    }
    template <int C, int A, int B>
    static void dot_bf16() {
        const TileConfig& c = check_dot<C, A, B>();
        State& s = state();
        for (int m = 0; m < c.rows[C]; ++m)
            for (int n = 0; n < c.colsb[C] / 4; ++n) {
                float acc;
                std::memcpy(&acc, &s.tile[C][m][4 * n], 4);
                for (int k = 0; k < c.colsb[A] / 4; ++k) {
                    acc += bf16(s.tile[A][m] + 4 * k) * bf16(s.tile[B][k] + 4 * n);
                    acc += bf16(s.tile[A][m] + 4 * k + 2) * bf16(s.tile[B][k] + 4 * n + 2);
                }
                std::memcpy(&s.tile[C][m][4 * n], &acc, 4);
            }
    }
    // tdpbsud: A's bytes signed, B's unsigned, four products a lane added into int32.
    template <int C, int A, int B>
    static void dot_s8u8() {
        const TileConfig& c = check_dot<C, A, B>();
        State& s = state();
        for (int m = 0; m < c.rows[C]; ++m)
            for (int n = 0; n < c.colsb[C] / 4; ++n) {
                int32_t acc;
                std::memcpy(&acc, &s.tile[C][m][4 * n], 4);
                for (int k = 0; k < c.colsb[A] / 4; ++k)
                    for (int i = 0; i < 4; ++i)
                        acc += static_cast<int32_t>(static_cast<int8_t>(s.tile[A][m][4 * k + i])) *
                               static_cast<int32_t>(s.tile[B][k][4 * n + i]);
                std::memcpy(&s.tile[C][m][4 * n], &acc, 4);
            }
    }
    template <int C, int A, int B>
    static const TileConfig& check_dot() {
        static_assert(C != A && C != B && A != B, "a tile product needs three different tiles");
        State& s = state();
        const TileConfig& c = s.config;
        require(s.configured, "tile product before configure");
        require(c.rows[A] == c.rows[C] && c.colsb[A] / 4 == c.rows[B] && c.colsb[B] == c.colsb[C],
                "tile product with shapes that do not fit");
        return c;
    }
    static float bf16(const uint8_t* p) {
        uint16_t h;
        std::memcpy(&h, p, 2);
        const uint32_t bits = static_cast<uint32_t>(h) << 16;
        float f;
        std::memcpy(&f, &bits, 4);
        return f;
    }
};

// A worker's hold on the tiles: configured for its lifetime, released however it ends (an emulated tile's
// shape check throws; a thread left configured would pass the next call's "before configure" checks).
template <class Tiles>
struct TileSession {
    TileSession() { Tiles::configure(); }
    ~TileSession() { Tiles::release(); }
    TileSession(const TileSession&) = delete;
    TileSession& operator=(const TileSession&) = delete;
};

#if DSASERVE_X86
#pragma GCC push_options
#pragma GCC target("amx-tile,amx-bf16,amx-int8")
// The indexer kernels' tile step: accumulators 0-3 = a (tile 4: 16 rows, 64 bytes a step, rows a_stride bytes
// apart) times each of four column groups (tiles 5-7 in turn: group t's step s is 16 rows of 64 bytes at
// b[t] + 1024 s), over `steps` steps, stored to products [4][16][16] (fp32 for bf16 products, int32 for
// signed × unsigned bytes).
template <class Tiles, bool kBytes>
inline void products_of_four_groups(const uint8_t* a, int64_t a_stride, const uint8_t* const* b, int64_t steps,
                                    void* products) {
    Tiles::template zero<0>();
    Tiles::template zero<1>();
    Tiles::template zero<2>();
    Tiles::template zero<3>();
    for (int64_t s = 0; s < steps; s++) {
        Tiles::template load<4>(a + s * 64, a_stride);
        Tiles::template load<5>(b[0] + s * 1024, 64);
        if constexpr (kBytes) Tiles::template dot_s8u8<0, 4, 5>(); else Tiles::template dot_bf16<0, 4, 5>();
        Tiles::template load<6>(b[1] + s * 1024, 64);
        if constexpr (kBytes) Tiles::template dot_s8u8<1, 4, 6>(); else Tiles::template dot_bf16<1, 4, 6>();
        Tiles::template load<7>(b[2] + s * 1024, 64);
        if constexpr (kBytes) Tiles::template dot_s8u8<2, 4, 7>(); else Tiles::template dot_bf16<2, 4, 7>();
        Tiles::template load<5>(b[3] + s * 1024, 64);
        if constexpr (kBytes) Tiles::template dot_s8u8<3, 4, 5>(); else Tiles::template dot_bf16<3, 4, 5>();
    }
    auto* out = static_cast<uint8_t*>(products);
    Tiles::template store<0>(out, 64);
    Tiles::template store<1>(out + 1024, 64);
    Tiles::template store<2>(out + 2048, 64);
    Tiles::template store<3>(out + 3072, 64);
}
#pragma GCC pop_options
#endif

#if DSASERVE_X86
// The form a kernel call takes: the mode's where the call's shapes fit its tile body (counted in amx_tile_calls),
// else off.
inline AmxMode tile_form(bool shapes_fit) {
    const AmxMode mode = shapes_fit ? amx_mode() : AmxMode::off;
    if (mode != AmxMode::off) amx_tile_calls()++;
    return mode;
}

// with_tiles(HwTiles{}) or with_tiles(EmuTiles{}) as the form says, plain() when it is off.
template <class WithTiles, class Plain>
inline auto by_form(AmxMode form, WithTiles with_tiles, Plain plain) {
    if (form == AmxMode::hardware) return with_tiles(HwTiles{});
    if (form == AmxMode::emulated) return with_tiles(EmuTiles{});
    return plain();
}
#endif

// True where the CPU has AMX-BF16 and AMX-INT8 and the kernel lets this process use the tile registers (asked once).
bool amx_available();

}  // namespace dsaserve
