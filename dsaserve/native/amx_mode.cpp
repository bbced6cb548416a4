/* Which form of the AMX tile kernels runs in this process (amx_tiles.h): `off` (the AVX-512 bodies),
 * `hardware` (the instructions; only where amx_available) or `emulated` (the tile operations in C++, for the
 * kernels' tests on any CPU with AVX-512 BF16). Registered as torch.ops.dsaserve.amx_mode / set_amx_mode;
 * dsaserve/native/amx.py chooses the mode at load.
 */
#include <ATen/ATen.h>
#include <torch/library.h>

#include <string>

#include "amx_tiles.h"

#if DSASERVE_X86
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace {

constexpr long kArchGetXcompPerm = 0x1022;  // arch_prctl: the extended state components this process may use
constexpr long kArchReqXcompPerm = 0x1023;  // arch_prctl: ask for an extended state component
constexpr long kXfeatureXtiledata = 18;     // the tile registers' data

#if DSASERVE_X86
// Asks Linux for the tile data, then reads the permission back: a kernel that accepted the request is not
// taken at its word.
bool tile_data_permitted() {
    if (syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) != 0) return false;
    unsigned long long permitted = 0;
    if (syscall(SYS_arch_prctl, kArchGetXcompPerm, &permitted) != 0) return false;
    return (permitted >> kXfeatureXtiledata) & 1;
}
#endif

const char* name_of(dsaserve::AmxMode mode) {
    switch (mode) {
        case dsaserve::AmxMode::hardware: return "hardware";
        case dsaserve::AmxMode::emulated: return "emulated";
        default: return "off";
    }
}

std::string amx_mode_name() { return name_of(dsaserve::amx_mode()); }

bool available() { return dsaserve::amx_available(); }

int64_t tile_calls() { return dsaserve::amx_tile_calls().load(); }

// Sets the mode and returns the previous one.
std::string set_amx_mode(const std::string& mode) {
    dsaserve::AmxMode next;
    if (mode == "off") {
        next = dsaserve::AmxMode::off;
    } else if (mode == "hardware") {
        TORCH_CHECK(dsaserve::amx_available(), "set_amx_mode: 'hardware' needs a CPU with AMX-BF16 and AMX-INT8 whose "
                    "kernel grants the tile registers (lscpu: amx_bf16, amx_int8; Linux 5.16 or later)");
        next = dsaserve::AmxMode::hardware;
    } else if (mode == "emulated") {
        TORCH_CHECK(dsaserve::use_avx512_bf16(), "set_amx_mode: 'emulated' runs the kernels' AVX-512 BF16 "
                    "parts, which this CPU lacks");
        next = dsaserve::AmxMode::emulated;
    } else {
        TORCH_CHECK(false, "set_amx_mode: mode '", mode, "' is not one of off, hardware, emulated");
    }
    const auto previous = static_cast<dsaserve::AmxMode>(dsaserve::amx_mode_slot().exchange(static_cast<int>(next)));
    return name_of(previous);
}

}  // namespace

bool dsaserve::amx_available() {
#if DSASERVE_X86
    // The CPU's flag, and Linux's permission for this process to use the tile data (without it, the first
    // tile instruction faults).
    static const bool granted = cpu_has_avx512_bf16() && __builtin_cpu_supports("amx-tile") &&
                                __builtin_cpu_supports("amx-bf16") && __builtin_cpu_supports("amx-int8") &&
                                tile_data_permitted();
    return granted;
#else
    return false;
#endif
}

void dsaserve::EmuTiles::require(bool ok, const char* what) { TORCH_CHECK(ok, "emulated AMX tiles: ", what); }

TORCH_LIBRARY_FRAGMENT(dsaserve, m) {
    m.def("amx_available() -> bool", &available);
    m.def("amx_mode() -> str", &amx_mode_name);
    m.def("set_amx_mode(str mode) -> str", &set_amx_mode);
    m.def("amx_tile_calls() -> int", &tile_calls);
}
