"""Prometheus metrics of one server, in a registry of its own (so two apps in one process never share counters).

Counters are cumulative over the server's life (Prometheus computes rates); every histogram observes one value per
request (the batch size: one per engine step), and its name says the unit. prometheus-client's metrics are
thread-safe, so the worker thread records generation figures while the event loop records HTTP statuses.

Load-aware routers read two gauges (llm-d's model-server protocol, the Gateway API inference extension's endpoint
picker): waiting requests and KV cache utilisation. They are exported under vLLM's names, which those routers know
(`vllm:num_requests_waiting`, `vllm:num_requests_running`, `vllm:kv_cache_usage_perc` as a 0-1 fraction, labelled
`model_name`), next to tandem's own.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import (
    CONTENT_TYPE_LATEST,  # noqa: F401  (re-exported for the /metrics response)
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from tandem.speculative.stats import GenerationStats

RATE_BUCKETS = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
MS_BUCKETS = (1, 5, 10, 25, 50, 100, 250, 500, 1000, 2500, 5000, 10000, 30000, 60000)


class ServerMetrics:
    def __init__(self, queue_depth: Callable[[], int], active: Callable[[], int],
                 kv_usage: Callable[[], float] = lambda: 0.0, model_name: str = "") -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("tandem_requests", "HTTP requests by endpoint and status", ["endpoint", "status"],
                                registry=r)
        self.prompt_tokens = Counter("tandem_prompt_tokens", "prompt tokens prefilled", registry=r)
        self.generated_tokens = Counter("tandem_generated_tokens", "tokens generated and returned", registry=r)
        self.draft_tokens = Counter("tandem_draft_tokens", "draft tokens proposed to the verifier", registry=r)
        self.accepted_tokens = Counter("tandem_draft_accepted_tokens", "draft tokens the verifier accepted",
                                       registry=r)
        self.cancelled = Counter("tandem_cancelled_generations", "generations stopped by a client disconnect",
                                 registry=r)
        self.acceptance = Histogram("tandem_request_acceptance_rate",
                                    "accepted / proposed draft tokens per request (requests that drafted)",
                                    buckets=RATE_BUCKETS, registry=r)
        self.prefill_ms = Histogram("tandem_request_prefill_ms", "prefill time per request, ms", buckets=MS_BUCKETS,
                                    registry=r)
        self.draft_ms = Histogram("tandem_request_draft_ms", "total drafting time per request, ms",
                                  buckets=MS_BUCKETS, registry=r)
        self.verify_ms = Histogram("tandem_request_verify_ms", "total verify-forward time per request, ms",
                                   buckets=MS_BUCKETS, registry=r)
        self.queue_ms = Histogram("tandem_request_queue_ms", "time waiting for a slot per request, ms",
                                  buckets=MS_BUCKETS, registry=r)
        self.batch_size = Histogram("tandem_batch_size", "sequences in each engine step (one target forward)",
                                    buckets=BATCH_BUCKETS, registry=r)
        # vLLM's names: prompt tokens looked up in, and found in, KV that earlier requests left (prefix reuse)
        self.prefix_queries = Counter("vllm:prefix_cache_queries", "prompt tokens looked up in the prefix cache",
                                      registry=r)
        self.prefix_hits = Counter("vllm:prefix_cache_hits", "prompt tokens whose KV was reused, not recomputed",
                                   registry=r)
        Gauge("tandem_queue_depth", "requests waiting for a slot", registry=r).set_function(queue_depth)
        Gauge("tandem_active_requests", "requests being decoded", registry=r).set_function(active)
        Gauge("tandem_kv_cache_usage_ratio", "fraction of the KV cache capacity that live sequences hold",
              registry=r).set_function(kv_usage)
        for name, doc, read in (("vllm:num_requests_waiting", "requests waiting to be scheduled", queue_depth),
                                ("vllm:num_requests_running", "requests being decoded", active),
                                ("vllm:kv_cache_usage_perc", "KV cache usage, 1 = full", kv_usage)):
            Gauge(name, doc, ["model_name"], registry=r).labels(model_name=model_name).set_function(read)

    def observe_generation(self, stats: GenerationStats, queue_ms: float) -> None:
        """Record one finished generation's figures."""
        self.prompt_tokens.inc(stats.prompt_tokens)
        self.prefix_queries.inc(stats.prompt_tokens)
        self.prefix_hits.inc(stats.cached_tokens)
        self.generated_tokens.inc(stats.generated_tokens)
        self.draft_tokens.inc(stats.draft_tokens)
        self.accepted_tokens.inc(stats.accepted_tokens)
        if stats.draft_tokens:
            self.acceptance.observe(stats.acceptance_rate)
        self.prefill_ms.observe(stats.prefill_ms)
        self.draft_ms.observe(stats.draft_ms)
        self.verify_ms.observe(stats.verify_ms)
        self.queue_ms.observe(queue_ms)

    def render(self) -> bytes:
        return generate_latest(self.registry)
