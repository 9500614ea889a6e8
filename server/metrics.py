"""Prometheus metrics: engine gauges read at scrape time, request counters and histograms.

Each application owns its own registry, so several servers in one process (tests) do not
collide. Engine gauges and counters read the `EngineStats` snapshot the engine task
publishes between steps; they never touch the engine itself (which another thread may be
stepping).
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import (CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge,
                               Histogram, disable_created_metrics, generate_latest)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from heron.core.async_engine import EngineStats

disable_created_metrics()  # `*_created` series double the output and nobody reads them

_LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                      7.5, 10.0, 20.0, 40.0, 80.0, 160.0)


class Metrics:
    CONTENT_TYPE = CONTENT_TYPE_LATEST

    def __init__(self, stats: Callable[[], EngineStats]) -> None:
        self.registry = r = CollectorRegistry()
        for name, doc, field in (
            ("heron_requests_running", "Requests with a sequence in the running batch",
             "num_requests_running"),
            ("heron_requests_waiting", "Requests queued, not yet running",
             "num_requests_waiting"),
            ("heron_prompt_tokens_waiting", "Prompt tokens of the requests waiting",
             "num_prompt_tokens_waiting"),
            ("heron_requests_swapped", "Requests with a sequence swapped out to host memory",
             "num_requests_swapped"),
            ("heron_kv_blocks_total", "KV blocks in the pool", "num_kv_blocks_total"),
            ("heron_kv_blocks_in_use", "KV blocks referenced by live requests "
             "(evictable cached blocks not counted)", "num_kv_blocks_in_use"),
            ("heron_kv_blocks_cached", "KV blocks held by the prefix cache (in use or not)",
             "num_kv_blocks_cached"),
            ("heron_state_slots_in_use", "Per-sequence state slots (SSM layers) held by live "
             "requests", "num_state_slots_in_use"),
            ("heron_state_snapshots", "SSM state snapshots held for the prefix cache",
             "num_state_snapshots"),
            ("heron_host_kv_blocks_in_use", "Host KV blocks holding swapped-out sequences",
             "num_host_kv_blocks_in_use"),
            ("heron_lora_adapters_in_use", "LoRA adapters live requests reference",
             "num_adapters_in_use"),
        ):
            Gauge(name, doc, registry=r).set_function(
                lambda field=field: getattr(stats(), field))
        r.register(_EngineCounters(stats))
        self.prompt_tokens = Counter("heron_prompt_tokens", "Prompt tokens of admitted "
                                     "requests", registry=r)
        self.generation_tokens = Counter("heron_generation_tokens", "Generated tokens",
                                         registry=r)
        self.requests_finished = Counter("heron_requests_finished", "Finished requests by "
                                         "finish reason", ["finish_reason"], registry=r)
        # tenant: a `server.tenants` name, "api_keys[i]" for an `api_keys` key, "" without keys
        self.tenant_requests = Counter("heron_tenant_requests_finished", "Finished requests "
                                       "by tenant and finish reason", ["tenant", "finish_reason"],
                                       registry=r)
        self.tenant_tokens = Counter("heron_tenant_tokens", "Prompt and generated tokens by "
                                     "tenant", ["tenant", "kind"], registry=r)
        self.rejected = Counter("heron_requests_rejected", "Requests refused before admission "
                                "by HTTP status", ["status"], registry=r)
        self.ttft = Histogram("heron_time_to_first_token_seconds", "Arrival to first token",
                              buckets=_LATENCY_BUCKETS_S, registry=r)
        self.inter_token = Histogram("heron_inter_token_latency_seconds", "Time between "
                                     "successive tokens of a sequence",
                                     buckets=_LATENCY_BUCKETS_S, registry=r)
        self.e2e = Histogram("heron_e2e_request_latency_seconds", "Arrival to last token",
                             buckets=_LATENCY_BUCKETS_S, registry=r)

    def render(self) -> bytes:
        return generate_latest(self.registry)


# SpecStats' counts, as a total and, with a proposer of several parts, by source
_SPEC_COUNTERS = (("drafts", "Speculative drafts verified"),
                  ("draft_tokens", "Draft tokens proposed"),
                  ("accepted_tokens", "Draft tokens accepted"))


class _EngineCounters(Collector):
    """Counters the engine keeps itself, exported as they are at scrape time."""

    _COUNTERS = (
        ("heron_prefix_cache_queried_tokens", "Tokens looked up in the prefix cache",
         "prefix_cache_queried_tokens"),
        ("heron_prefix_cache_hit_tokens", "Looked-up tokens whose KV was reused from the "
         "prefix cache", "prefix_cache_hit_tokens"),
        ("heron_preemptions", "Sequences preempted because the KV pool ran dry",
         "num_preemptions"),
    )

    def __init__(self, stats: Callable[[], EngineStats]) -> None:
        self._stats = stats

    def collect(self):
        stats = self._stats()
        for name, doc, field in self._COUNTERS:
            yield CounterMetricFamily(name, doc, value=getattr(stats, field))
        spec = stats.spec
        if spec is None:
            return
        for field, doc in _SPEC_COUNTERS:
            yield CounterMetricFamily(f"heron_spec_decode_{field}", doc,
                                      value=getattr(spec, field))
        per_position = CounterMetricFamily("heron_spec_decode_accepted_tokens_per_position",
                                           "Draft tokens accepted at each position of a "
                                           "draft (0-based)", labels=["position"])
        for position, count in enumerate(spec.accepted_at):
            per_position.add_metric([str(position)], count)
        yield per_position
        yield GaugeMetricFamily("heron_spec_decode_acceptance_rate", "Accepted over proposed "
                                "draft tokens, so far", value=spec.acceptance_rate)
        yield GaugeMetricFamily("heron_spec_decode_mean_accepted_length", "Tokens emitted per "
                                "verification (accepted drafts + 1), so far",
                                value=spec.mean_accepted_length)
        if not spec.by_source:
            return
        for field, doc in _SPEC_COUNTERS:
            family = CounterMetricFamily(f"heron_spec_decode_{field}_by_source",
                                         f"{doc}, by the proposer part that drafted them "
                                         "([speculative] prompt_lookup)", labels=["source"])
            for source, part in sorted(spec.by_source.items()):
                family.add_metric([source], getattr(part, field))
            yield family
