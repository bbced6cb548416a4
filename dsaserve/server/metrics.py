"""Prometheus metrics: engine state read at scrape time, latency histograms observed per request."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from dsaserve.engine.stats import EngineStats

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                   20.0, 40.0, 80.0)


class EngineCollector:
    """Reads the engine's stats snapshot when scraped, so the step loop does no metrics work."""

    def __init__(self, stats: Callable[[], EngineStats], model_name: str):
        self.stats = stats
        self.labels = {"model_name": model_name}

    def _gauge(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        g = GaugeMetricFamily(name, doc, labels=list(self.labels))
        g.add_metric(list(self.labels.values()), value)
        return g

    def _counter(self, name: str, doc: str, value: float) -> CounterMetricFamily:
        c = CounterMetricFamily(name, doc, labels=list(self.labels))
        c.add_metric(list(self.labels.values()), value)
        return c

    def collect(self):
        stats = self.stats()
        yield self._gauge("dsaserve:num_requests_running", "Sequences in the running batch.", stats.num_running)
        yield self._gauge("dsaserve:num_requests_waiting", "Sequences waiting to be scheduled.", stats.num_waiting)
        yield self._gauge("dsaserve:kv_cache_usage_perc", "Fraction of KV blocks in use (0-1).", stats.kv_cache_usage)
        yield self._gauge("dsaserve:prefix_cache_hit_rate", "Prompt tokens served from the prefix cache / queried.",
                          stats.prefix_cache_hit_rate)
        yield self._counter("dsaserve:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                            stats.prefix_cache_queried_tokens)
        yield self._counter("dsaserve:prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                            stats.prefix_cache_hit_tokens)
        yield self._counter("dsaserve:prompt_tokens", "Prompt tokens admitted.", stats.num_prompt_tokens)
        yield self._counter("dsaserve:generation_tokens", "Tokens generated.", stats.num_generation_tokens)
        yield self._counter("dsaserve:num_preemptions", "Sequences preempted for lack of KV blocks.",
                            stats.num_preemptions)
        yield from self._spec_decode(stats)

    def _spec_decode(self, stats: EngineStats):
        """vLLM's speculative-decoding counters (zero without speculation)."""
        spec = stats.spec_decode
        yield self._counter("dsaserve:spec_decode_num_drafts",
                            "Verification rounds (one request's drafts in one step).", spec.num_drafts)
        yield self._counter("dsaserve:spec_decode_num_draft_tokens", "Draft tokens verified.", spec.num_draft_tokens)
        yield self._counter("dsaserve:spec_decode_num_accepted_tokens", "Draft tokens accepted.",
                            spec.num_accepted_tokens)
        per_pos = CounterMetricFamily("dsaserve:spec_decode_num_accepted_tokens_per_pos",
                                      "Accepted draft tokens by draft position (0 = first).",
                                      labels=[*self.labels, "position"])
        for position, count in enumerate(spec.accepted_per_pos):
            per_pos.add_metric([*self.labels.values(), str(position)], count)
        yield per_pos


class ServerMetrics:
    def __init__(self, stats: Callable[[], EngineStats], model_name: str):
        self.registry = CollectorRegistry()
        self.registry.register(EngineCollector(stats, model_name))
        labels = ["model_name"]
        self.ttft = Histogram("dsaserve:time_to_first_token_seconds", "Time from request arrival to first token.",
                              labels, buckets=LATENCY_BUCKETS, registry=self.registry).labels(model_name)
        self.itl = Histogram("dsaserve:inter_token_latency_seconds", "Time between consecutive outputs of a request.",
                             labels, buckets=LATENCY_BUCKETS, registry=self.registry).labels(model_name)
        self.e2e = Histogram("dsaserve:e2e_request_latency_seconds", "Time from arrival to the last token.",
                             labels, buckets=LATENCY_BUCKETS, registry=self.registry).labels(model_name)

    def render(self) -> bytes:
        return generate_latest(self.registry)
