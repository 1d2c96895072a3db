"""Benchmarks under `hetserve bench ...`; they use only public APIs (Python API, CLI, HTTP)."""

from . import kv_layout, latency, matmul, prefix_cache, serve, speculative, throughput, tracing

BENCHMARKS = (latency, throughput, kv_layout, matmul, prefix_cache, serve, tracing, speculative)
