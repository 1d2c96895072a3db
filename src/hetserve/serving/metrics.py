"""Prometheus metrics of the server, labelled by worker."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from . import ipc

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320)


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        label = ["worker"]
        self._ttft = Histogram("hetserve:time_to_first_token_seconds", "Time to first token", label,
                               buckets=_LATENCY_BUCKETS, registry=r)
        self._itl = Histogram("hetserve:inter_token_latency_seconds", "Time between output tokens", label,
                              buckets=_LATENCY_BUCKETS, registry=r)
        self._e2e = Histogram("hetserve:e2e_request_latency_seconds", "Arrival to finish", label,
                              buckets=_LATENCY_BUCKETS, registry=r)
        self._queue = Histogram("hetserve:request_queue_time_seconds", "Arrival to first scheduled step", label,
                                buckets=_LATENCY_BUCKETS, registry=r)
        self._up = Gauge("hetserve:worker_up", "1 while the worker serves, 0 once it died or went silent", label,
                         registry=r)
        self._restarts = Counter("hetserve:worker_restarts", "Times a dead local worker was started again",
                                 label, registry=r)
        self._running = Gauge("hetserve:num_requests_running", "Requests running", label, registry=r)
        self._waiting = Gauge("hetserve:num_requests_waiting", "Requests waiting", label, registry=r)
        self._pages_used = Gauge("hetserve:kv_pages_used", "KV pages referenced by requests", label, registry=r)
        self._pages_total = Gauge("hetserve:kv_pages_total", "KV pages in the pool", label, registry=r)
        self._preempt = Gauge("hetserve:num_preemptions", "Preemptions so far", label, registry=r)
        self._chunk = Gauge("hetserve:prefill_chunk_budget", "Prompt tokens a step may carry while requests decode "
                            "(what prefills in --max-decode-stall, measured)", label, registry=r)
        self._prefix = Gauge("hetserve:prefix_cache", "Prefix cache counters (lookups, hits, restored, published "
                             "and evicted tokens, cached pages)", label + ["counter"], registry=r)
        self._spec = Gauge("hetserve:spec_decode", "Speculative decoding counters (proposed, accepted, acceptance "
                           "rate, mean accepted length, verification rounds, k_<K>: decode steps that drafted K)",
                           label + ["counter"], registry=r)
        self._kv_s = Histogram("hetserve:kv_transfer_seconds", "Prefill-to-decode KV transfer time per request "
                               "(export, relay, install)", ["prefill", "decode"], buckets=_LATENCY_BUCKETS, registry=r)
        self._kv_bytes = Counter("hetserve:kv_transfer_bytes", "KV bytes moved from prefill to decode workers",
                                 ["prefill", "decode"], registry=r)
        self.requests = Counter("hetserve:requests", "Finished HTTP requests by route and status",
                                ["route", "status"], registry=r)

    def ttft(self, worker: str, s: float) -> None:
        self._ttft.labels(worker).observe(s)

    def itl(self, worker: str, s: float) -> None:
        self._itl.labels(worker).observe(s)

    def e2e(self, worker: str, s: float) -> None:
        self._e2e.labels(worker).observe(s)

    def queue_time(self, worker: str, s: float) -> None:
        self._queue.labels(worker).observe(s)

    def kv_transfer(self, prefill: str, decode: str, seconds: float, nbytes: int) -> None:
        self._kv_s.labels(prefill, decode).observe(seconds)
        self._kv_bytes.labels(prefill, decode).inc(nbytes)

    def worker_up(self, worker: str, up: bool) -> None:
        self._up.labels(worker).set(1 if up else 0)

    def worker_down(self, worker: str) -> None:
        """A dead worker runs nothing and holds no pages: its gauges go to zero, not stay at their last values."""
        self.worker_up(worker, False)
        for g in (self._running, self._waiting, self._pages_used):
            g.labels(worker).set(0)

    def worker_restarted(self, worker: str) -> None:
        self._restarts.labels(worker).inc()

    def worker_state(self, worker: str, st: ipc.WorkerState) -> None:
        self._running.labels(worker).set(st.running)
        self._waiting.labels(worker).set(st.waiting)
        self._pages_used.labels(worker).set(st.pages_used)
        self._pages_total.labels(worker).set(st.pages_total)
        self._preempt.labels(worker).set(st.preemptions)
        self._chunk.labels(worker).set(st.chunk_budget)
        for k, v in st.prefix_cache.items():
            self._prefix.labels(worker, k).set(v)
        for k, v in st.spec_decode.items():
            self._spec.labels(worker, k).set(v)

    def render(self) -> bytes:
        return generate_latest(self.registry)
