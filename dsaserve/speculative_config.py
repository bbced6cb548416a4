"""SpeculativeConfig: `--speculative-config '{"method": "mtp", "num_speculative_tokens": N}'`, vLLM's spelling."""

from __future__ import annotations

import json
from dataclasses import dataclass

METHODS = ("mtp",)
MAX_SPECULATIVE_TOKENS = 8
# Drafting pauses in steps with this many running sequences or more, unless the config says otherwise
# (null: never). Measured on CPU (docs/benchmarks.md): drafts pay up to batch 4 and cost from 8 on, where
# a step's weights are already shared by enough rows that verifying drafts only adds work.
DEFAULT_DISABLE_BY_BATCH_SIZE = 8


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    # No drafting in steps with at least this many running sequences (None: always draft).
    disable_by_batch_size: int | None = DEFAULT_DISABLE_BY_BATCH_SIZE

    @classmethod
    def parse(cls, value) -> "SpeculativeConfig | None":
        """From a dict, a JSON string, or None (speculation off)."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config={value!r} is not JSON: {e}; e.g. "
                                 '\'{"method": "mtp", "num_speculative_tokens": 3}\'') from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a JSON object, got {value!r}")
        unknown = sorted(set(value) - {"method", "num_speculative_tokens", "disable_by_batch_size"})
        if unknown:
            raise ValueError(f"speculative_config has unknown keys {unknown}; it takes method, num_speculative_tokens "
                             "and disable_by_batch_size")
        method = value.get("method")
        if method not in METHODS:
            raise ValueError(f"speculative_config.method={method!r} is not supported; use 'mtp' (the checkpoint's "
                             "multi-token-prediction layer)")
        n = value.get("num_speculative_tokens")
        if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"speculative_config.num_speculative_tokens={n!r} must be an integer from 1 to "
                             f"{MAX_SPECULATIVE_TOKENS}")
        limit = value.get("disable_by_batch_size", DEFAULT_DISABLE_BY_BATCH_SIZE)
        if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool) or limit < 1):
            raise ValueError(f"speculative_config.disable_by_batch_size={limit!r} must be a positive integer "
                             "(speculation pauses in steps with at least that many running sequences), "
                             "or null to never pause")
        return cls(method, n, limit)
