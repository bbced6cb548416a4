"""Whether the sparse path's kernels use AMX tiles in this process (native/amx_tiles.h).

Where the CPU has AMX-BF16 and AMX-INT8 (and Linux grants the tile registers), the selected-rows attention and
the indexer's scores (bf16 keys, and int8 keys kept in the int8 kernel's layout) take their tile bodies, but only
after those have been compared, once, with their AVX-512 bodies on small problems in a child process: a CPU or
kernel that disagrees, faults or hangs keeps the AVX-512 bodies, with a warning, and the process that loads the
operators never runs a tile instruction before that check has passed. The check's verdict is kept beside the library
(VERDICTS_FILE), keyed by the library, this CPU's identity (its microcode included) and the Linux release, so a later
start on the same machine reuses it instead of paying the child's second or two; a check that did not finish with a
verdict (a fault, a hang) is not kept. native_kernels 'avx512' keeps them off.
torch_ops.load() calls choose_at_load, so this module calls the operators directly and imports nothing of
dsaserve; the child runs this file as a script.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

# How far the tile bodies may be from the AVX-512 ones: both add bf16 products in fp32, in different orders.
CHECK_TOLERANCE = 2e-2
# The check takes about a second plus torch's import; a child still running after this is taken as hung.
CHECK_TIMEOUT_S = 120
VERDICTS_FILE = "amx_check_verdicts.json"  # beside the library
_state: str | None = None
_checked: tuple[str, str] | None = None  # what the load check chose: (mode, the reason doctor prints)


def mode() -> str:
    """'hardware', 'emulated' (tests only) or 'off'; the operators must be loaded (torch_ops.load())."""
    return torch.ops.dsaserve.amx_mode()


def set_mode(name: str) -> str:
    """Sets the mode ('off', 'hardware', 'emulated') and returns the previous one."""
    return torch.ops.dsaserve.set_amx_mode(name)


def state() -> str:
    """What `dsaserve doctor` says: why the tile bodies run or not (after choose_at_load)."""
    return _state or "not chosen (operators not loaded)"


def choose_at_load(library: str) -> None:
    """Called once when the operators load (from `library`): the hardware tile bodies where available and in
    agreement."""
    global _state, _checked
    _state = _choose(library)
    _checked = ("hardware" if _state.startswith("on") else "off", _state)


def _choose(library: str) -> str:
    """The tiles' mode set here, and why (what doctor prints)."""
    if not torch.ops.dsaserve.amx_available():
        return "off (no AMX-BF16 and AMX-INT8 on this CPU, or Linux did not grant the tile registers)"
    disagreement, kept = kept_or_checked(library, "hardware")
    when = "by an earlier start on this CPU and library" if kept else "at load"
    if disagreement is None:
        set_mode("hardware")
        logger.info("sparse kernels: using AMX tiles")
        return f"on (AMX tiles, checked against the AVX-512 kernels {when})"
    state = f"off (the AMX tile kernels failed their check against the AVX-512 ones {when}: {disagreement})"
    logger.warning("sparse kernels: %s", state)
    return state


def allow(allowed: bool, why_not: str = "native_kernels 'avx512'") -> None:
    """The engine's native_kernels and cpu_isa options: the tiles where the load check chose them, or off (why_not:
    the option that turned them off)."""
    global _state
    if _checked is None:
        return
    mode, reason = _checked
    set_mode(mode if allowed else "off")
    _state = reason if allowed else f"off ({why_not})"


def kept_or_checked(library: str, tiles: str) -> tuple[str | None, bool]:
    """check_in_child's answer, and whether it is the one kept from an earlier start (the same check command, CPU
    identity and Linux release); a fresh verdict is kept for the next start."""
    command = _check_command(library, tiles)
    key = hashlib.sha256(json.dumps([command, cpu_identity(), os.uname().release]).encode()).hexdigest()
    path = verdicts_path(library)
    verdicts = _read_verdicts(path)
    if key in verdicts:
        return verdicts[key], True
    disagreement, finished = _run_check(command)
    if finished:
        _write_verdicts(path, {**verdicts, key: disagreement})
    return disagreement, False


def verdicts_path(library: str) -> Path:
    return Path(library).parent / VERDICTS_FILE


def cpu_identity() -> str:
    """The first CPU's vendor, family, model, stepping, microcode and flags (/proc/cpuinfo)."""
    fields = ("vendor_id", "cpu family", "model", "stepping", "microcode", "flags")
    try:
        with open("/proc/cpuinfo") as f:
            first = f.read().split("\n\n")[0]
    except OSError:
        return "unknown"
    return "\n".join(line for line in first.splitlines() if line.split(":")[0].strip() in fields)


def _read_verdicts(path: Path) -> dict:
    try:
        verdicts = json.loads(path.read_text())
    except (OSError, ValueError):  # none yet, or unreadable: the check runs again
        return {}
    return verdicts if isinstance(verdicts, dict) else {}


def _write_verdicts(path: Path, verdicts: dict) -> None:
    partial = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        partial.write_text(json.dumps(verdicts))
        os.replace(partial, path)  # whole or not at all, should two engines start at once
    except OSError as e:  # a read-only cache: the next start checks again
        logger.info("could not keep the AMX check's verdict in %s: %s", path, e)


def check_in_child(library: str, tiles: str) -> str | None:
    """tile_disagreement(tiles) run by a child process that loads `library`: None when the tiles agree, else
    what went wrong. The hardware form has run on no CPU before the one it meets here, so a fault in it (a
    tile configuration or stride the CPU refuses) must cost the tiles, not the process."""
    return _run_check(_check_command(library, tiles))[0]


def _run_check(command: list[str]) -> tuple[str | None, bool]:
    """The child's answer, and whether it finished with a verdict (agreement or a measured disagreement) rather
    than failing, faulting or hanging."""
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=CHECK_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return f"the check did not finish in {CHECK_TIMEOUT_S} s", False
    if done.returncode < 0:
        return f"the check was killed by {_signal_name(-done.returncode)}", False
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no message"])[-1]
        return f"the check failed with exit status {done.returncode}: {last[:300]}", False
    try:
        return json.loads(done.stdout.strip().splitlines()[-1])["disagreement"], True
    except (IndexError, ValueError, KeyError, TypeError):
        return f"the check printed no verdict: {done.stdout.strip()[-300:]!r}", False


def _check_command(library: str, tiles: str) -> list[str]:
    # -P: the script's folder (this package's modules) stays off the child's import path.
    return [sys.executable, "-P", os.path.abspath(__file__), library, tiles]


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def tile_disagreement(tiles: str) -> str | None:
    """Runs both kernels in mode `tiles` and in 'off' on small seeded problems; None when they agree within
    CHECK_TOLERANCE, else which kernel differed and by how much. Leaves the mode as it found it."""
    generator = torch.Generator().manual_seed(0)
    problems = {"attend_selected_rows": _attention_problem(generator), "index_scores": _index_problem(generator)}
    if torch.ops.dsaserve.index_scores_int8_fits(16, 128):
        problems["index_scores_int8_blocks"] = _int8_index_problem(generator)
    previous = set_mode("off")
    try:
        for name, run in problems.items():
            reference = run()
            set_mode(tiles)
            calls = torch.ops.dsaserve.amx_tile_calls()
            try:
                result = run()
            finally:
                set_mode("off")
            if torch.ops.dsaserve.amx_tile_calls() == calls:
                return f"{name} did not take its tile body"
            error = float((result.float() - reference.float()).abs().max() / reference.float().abs().max())
            if not error <= CHECK_TOLERANCE:
                return f"{name} off by {error:.3g} of its largest value"
        return None
    finally:
        set_mode(previous)


def _attention_problem(generator: torch.Generator):
    heads, dim, value_dim, width = 32, 80, 64, 200  # columns padded to 96, a whole block and a ragged one
    q = torch.randn(3, heads, dim, generator=generator).bfloat16()
    rows = torch.randn(500, dim, generator=generator).bfloat16()
    slots = torch.randint(0, 500, (3, width), generator=generator)
    slots[1, 7] = -1

    def run():
        out = torch.empty(3, heads, value_dim, dtype=torch.bfloat16)
        torch.ops.dsaserve.attend_selected_rows(q, rows, slots, dim ** -0.5, out)
        return out

    return run


def _index_problem(generator: torch.Generator):
    heads, dim, block_size, keys = 32, 64, 64, 300
    cache, table = _key_cache(generator, block_size, dim // 2, keys)
    torch.ops.dsaserve.write_packed_keys(cache, _slots(table, block_size, keys),
                                         torch.randn(keys, dim, generator=generator).bfloat16())
    q = torch.randn(2, heads, dim, generator=generator).bfloat16()
    weights = torch.rand(2, heads, generator=generator)

    def run():
        out = torch.zeros(2, keys)
        torch.ops.dsaserve.index_scores_blocks(q, weights, cache, table, keys, out)
        return out

    return run


def _int8_index_problem(generator: torch.Generator):
    heads, dim, block_size, keys = 16, 128, 64, 300
    cache, table = _key_cache(generator, block_size, dim // 4, keys)
    scales = torch.zeros(cache.shape[0], block_size, dtype=torch.float16)
    torch.ops.dsaserve.write_int8_keys(cache, scales, _slots(table, block_size, keys),
                                       torch.randn(keys, dim, generator=generator).bfloat16())
    q = torch.randn(2, heads, dim, generator=generator).bfloat16()
    weights = torch.rand(2, heads, generator=generator)

    def run():
        out = torch.zeros(2, keys)
        torch.ops.dsaserve.index_scores_int8_blocks(q, weights, cache, scales, table, keys, out)
        return out

    return run


def _key_cache(generator: torch.Generator, block_size: int, lanes_per_key: int, keys: int):
    """A paged key cache in the kernels' layout [blocks, block_size / 16, lanes_per_key, 16] and a scrambled block
    table for `keys` keys."""
    blocks = -(-keys // block_size)
    cache = torch.zeros(blocks + 2, block_size // 16, lanes_per_key, 16, dtype=torch.int32)
    return cache, torch.randperm(blocks + 2, generator=generator)[:blocks]


def _slots(table: torch.Tensor, block_size: int, keys: int) -> torch.Tensor:
    positions = torch.arange(keys)
    return table[positions // block_size] * block_size + positions % block_size


if __name__ == "__main__":  # the child of check_in_child: python amx.py LIBRARY FORM
    torch.ops.load_library(sys.argv[1])
    print(json.dumps({"disagreement": tile_disagreement(sys.argv[2])}))
