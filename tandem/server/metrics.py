"""Prometheus metrics of one server, in a registry of its own (so two apps in one process never share counters).

Counters are cumulative over the server's life (Prometheus computes rates); every histogram observes one value per
request (the batch size: one per engine step), and its name says the unit. prometheus-client's metrics are
thread-safe, so the worker thread records generation figures while the event loop records HTTP statuses.

Load-aware routers read two gauges (llm-d's model-server protocol, the Gateway API inference extension's endpoint
picker): waiting requests and KV cache utilisation. They are exported under vLLM's names, which those routers know
(`vllm:num_requests_waiting`, `vllm:num_requests_running`, `vllm:kv_cache_usage_perc` as a 0-1 fraction, labelled
`model_name`), next to tandem's own.

Where a served step's wall time goes (StepClock): the engine's parts of each step and the worker's time between
steps, as summaries (`tandem_step_part_seconds{part}`: _sum / _count is the mean). The clock keeps float sums that a
scrape reads, a few perf_counter reads a step and no lock on the worker's path.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import (
    CONTENT_TYPE_LATEST,  # noqa: F401  (re-exported for the /metrics response)
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.metrics_core import CounterMetricFamily, Metric, SummaryMetricFamily

from tandem.engine.generation import StepTimes
from tandem.speculative.stats import GenerationStats

RATE_BUCKETS = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
MS_BUCKETS = (1, 5, 10, 25, 50, 100, 250, 500, 1000, 2500, 5000, 10000, 30000, 60000)
# An engine step's parts, in order (StepTimes' readings): admission, the plan, the drafts, queuing the target's
# forward, reading the verify's outcomes (the host waits for the device here), the draft's share of the prompt
# chunks, and accepting and handing out the tokens.
ENGINE_PARTS = ("admit", "plan", "draft", "forward", "read", "draft_prefill", "bookkeeping")
# The worker's time from one step's end to the next one's start while it has work: Engine.add for the jobs it
# admits ("add"), the rest of its own work ("between": handing out chunks, metrics, the queue's lock; the thread's CPU
# time) and the time it did not run ("wait": for the GIL, which the HTTP side holds, or for a core).
WORKER_PARTS = ("add", "between", "wait")


class StepClock:
    """Sums of where served steps' wall time goes. The engine tells `engine_step` of each step through the target's
    forward (Engine.step_hook); the scheduler's worker tells `stepped` of every engine.step() it ran that had a batch,
    `added` of its Engine.add calls, and `paused` when it stops stepping (no work, idle work): the gap after that is
    no step's. Written by the worker thread only; a scrape reads floats."""

    def __init__(self) -> None:
        self.seconds = dict.fromkeys(ENGINE_PARTS + WORKER_PARTS, 0.0)
        self.counts = dict.fromkeys(ENGINE_PARTS + WORKER_PARTS, 0)
        self.steps, self.step_seconds = 0, 0.0  # engine.step() calls the worker ran with a batch, their wall time
        self.step_cpu_seconds = 0.0  # ... and the worker thread's CPU time in them
        self.draft_prefills = 0  # prompt chunks the draft took in beside the target's
        self._last_end: tuple[float, float] | None = None  # (perf_counter, thread_time) at the end of the worker's
        # last step, None after a pause
        self._added = 0.0  # Engine.add's seconds since then

    def engine_step(self, t: StepTimes) -> None:
        drafted = t.drafted  # a lone sequence's drafts may be timed on the device, past the forward's queuing
        parts = (t.started - t.admitting, t.planned - t.started, drafted - t.planned, max(0.0, t.forwarded - drafted),
                 t.finished - max(t.forwarded, drafted), t.prefilled - t.finished, t.ended - t.prefilled)
        for part, s in zip(ENGINE_PARTS, parts, strict=True):
            self.seconds[part] += s
            self.counts[part] += 1
        self.draft_prefills += t.draft_prefills

    def added(self, seconds: float) -> None:
        self._added += seconds

    def stepped(self, started: tuple[float, float], ended: tuple[float, float]) -> None:
        """The worker ran engine.step() from `started` to `ended`: (time.perf_counter(), time.thread_time()) each."""
        self.steps += 1
        self.step_seconds += ended[0] - started[0]
        self.step_cpu_seconds += ended[1] - started[1]
        if self._last_end is not None:
            gap, cpu = started[0] - self._last_end[0], started[1] - self._last_end[1]
            added = min(self._added, gap)
            between = min(max(0.0, cpu - added), gap - added)
            for part, s in (("add", added), ("between", between), ("wait", gap - added - between)):
                self.seconds[part] += s
                self.counts[part] += 1
        self._last_end, self._added = ended, 0.0

    def paused(self) -> None:
        self._last_end, self._added = None, 0.0

    def mean_ms(self) -> dict[str, float]:
        """Each part's mean ms (over the steps, or the gaps, it was timed in)."""
        return {part: 1000.0 * s / self.counts[part] if self.counts[part] else 0.0 for part, s in self.seconds.items()}

    def summary(self) -> str:
        """One line for the log."""
        step, cpu = (1000.0 * s / self.steps if self.steps else 0.0 for s in (self.step_seconds, self.step_cpu_seconds))
        parts = " ".join(f"{part} {ms:.3f}" for part, ms in self.mean_ms().items())
        return (f"{self.steps} steps, {step:.3f} ms a step ({cpu:.3f} ms the worker's CPU); mean ms: {parts}; "
                f"draft prefills: {self.draft_prefills} chunks, {1000.0 * self.seconds['draft_prefill']:.0f} ms")

    def collect(self) -> Iterator[Metric]:
        """The prometheus collector's side (registered in ServerMetrics' registry)."""
        parts = SummaryMetricFamily("tandem_step_part_seconds", "where served steps' wall time goes: the engine's "
                                    "parts of each step, and the worker's between steps (mean = _sum / _count)",
                                    labels=["part"])
        for part, s in self.seconds.items():
            parts.add_metric([part], self.counts[part], s)
        yield parts
        yield SummaryMetricFamily("tandem_engine_step_seconds", "wall time of each engine step the server ran",
                                  count_value=self.steps, sum_value=self.step_seconds)
        yield SummaryMetricFamily("tandem_engine_step_cpu_seconds", "the worker thread's CPU time in each engine step "
                                  "(the wall time less it: the worker waited, for the device, the GIL or a core)",
                                  count_value=self.steps, sum_value=self.step_cpu_seconds)
        yield CounterMetricFamily("tandem_draft_prefill_chunks", "prompt chunks the draft took in beside the target's",
                                  value=self.draft_prefills)


class ServerMetrics:
    def __init__(self, queue_depth: Callable[[], int], active: Callable[[], int],
                 kv_usage: Callable[[], float] = lambda: 0.0, model_name: str = "",
                 step_clock: StepClock | None = None) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.step_clock = step_clock or StepClock()
        r.register(self.step_clock)
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
