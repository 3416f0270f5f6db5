"""Prometheus metrics for the server, named after vLLM's (``vllm:`` -> ``specdec_``).

Each app has its own ``CollectorRegistry`` (several servers can live in one process, as in
the tests). Counters are updated by the scheduler thread after every engine step, so
``/metrics`` shows live totals; ``prometheus_client`` metrics are thread-safe.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                   7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                   60.0, 120.0, 240.0, 480.0, 960.0)
FINISH_REASONS = ("stop", "length", "abort", "error")


class ServerMetrics:
    def __init__(self, model_name: str, kv_slots: int):
        self.registry = r = CollectorRegistry()
        labels = {"model_name": model_name}
        names = list(labels)

        def counter(name, doc, extra=()):
            return Counter(name, doc, names + list(extra), registry=r)

        # speculative decoding (vLLM: vllm:spec_decode_*)
        self.num_drafts = counter("specdec_spec_decode_num_drafts",
                                  "Verify steps in which a request had at least one draft token.").labels(**labels)
        self.num_draft_tokens = counter("specdec_spec_decode_num_draft_tokens",
                                        "Draft tokens proposed (tree nodes for token trees).").labels(**labels)
        self.num_accepted_tokens = counter("specdec_spec_decode_num_accepted_tokens",
                                           "Draft tokens accepted by the target.").labels(**labels)
        self._per_pos = counter("specdec_spec_decode_num_accepted_tokens_per_pos",
                                "Accepted draft tokens at each draft position (0 = first).", ["position"])
        self.labels = labels
        # requests and tokens
        self._success = counter("specdec_request_success", "Finished requests by finish reason.",
                                ["finished_reason"])
        for reason in FINISH_REASONS:  # present from the start, at 0
            self._success.labels(**labels, finished_reason=reason)
        self.prompt_tokens = counter("specdec_prompt_tokens", "Prefilled prompt tokens.").labels(**labels)
        self.generation_tokens = counter("specdec_generation_tokens", "Generated tokens.").labels(**labels)
        self._rejected = counter("specdec_http_requests_rejected",
                                 "Requests refused before generation, by HTTP status.", ["status"])
        # latencies
        hist = lambda name, doc, buckets: Histogram(name, doc, names, buckets=buckets, registry=r).labels(**labels)  # noqa: E731
        self.ttft = hist("specdec_time_to_first_token_seconds",
                         "Time from arrival to the first generated token.", LATENCY_BUCKETS)
        self.itl = hist("specdec_inter_token_latency_seconds",
                        "Time between successive outputs of a request (one per verify step, "
                        "which may carry several tokens).", LATENCY_BUCKETS)
        self.e2e = hist("specdec_e2e_request_latency_seconds",
                        "Time from arrival to the last token.", REQUEST_BUCKETS)
        self.queue_time = hist("specdec_request_queue_time_seconds",
                               "Time from arrival to admission into the running batch.", REQUEST_BUCKETS)
        # state
        gauge = lambda name, doc: Gauge(name, doc, names, registry=r).labels(**labels)  # noqa: E731
        self.running = gauge("specdec_num_requests_running", "Requests in the running batch.")
        self.waiting = gauge("specdec_num_requests_waiting", "Requests accepted but not yet running.")
        self.kv_slots_used = gauge("specdec_kv_slots_used", "Target KV-cache slots (sequences) in use.")
        self.kv_slots_total = gauge("specdec_kv_slots_total", "Target KV-cache slots (max batch size).")
        self.kv_tokens = gauge("specdec_kv_cache_tokens", "Tokens the running requests hold in the target KV cache.")
        self.prefix_tokens = gauge("specdec_prefix_cache_tokens",
                                   "Prompt tokens whose KV free slots keep for a new prompt that starts the same.")
        self.kv_slots_total.set(kv_slots)

    def accepted_at(self, position: int):
        return self._per_pos.labels(**self.labels, position=str(position))

    def success(self, reason: str):
        return self._success.labels(**self.labels, finished_reason=reason)

    def rejected(self, status: int):
        return self._rejected.labels(**self.labels, status=str(status))

    def render(self) -> bytes:
        return generate_latest(self.registry)
