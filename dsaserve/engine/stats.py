"""A read-only snapshot of the engine's counters and gauges, for /metrics and benchmarks."""

from __future__ import annotations

from dataclasses import dataclass, field

from dsaserve.engine.speculative.spec_decode_stats import SpecDecodeStats


@dataclass(frozen=True)
class EngineStats:
    num_running: int  # sequences (a request with n samples counts n)
    num_waiting: int
    num_blocks: int
    num_free_blocks: int  # cached blocks nobody references count as free
    prefix_cache_queried_tokens: int
    prefix_cache_hit_tokens: int
    num_prompt_tokens: int  # admitted
    num_generation_tokens: int
    num_preemptions: int
    spec_decode: SpecDecodeStats = field(default_factory=lambda: SpecDecodeStats(0))  # zeros without speculation

    @property
    def kv_cache_usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    @property
    def prefix_cache_hit_rate(self) -> float:
        return (self.prefix_cache_hit_tokens / self.prefix_cache_queried_tokens if self.prefix_cache_queried_tokens
                else 0.0)
