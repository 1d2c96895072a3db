"""Benchmarks under `hetserve bench ...`; they use only public APIs (Python API, CLI, HTTP)."""

from . import (
               attention,
               autocomplete,
               disagg,
               kl,
               kv_cache,
               kv_layout,
               latency,
               load,
               matmul,
               prefix_cache,
               routing,
               serve,
               speculative,
               structured,
               throughput,
               tracing,
               weight_formats,
)

BENCHMARKS = (latency, throughput, kv_layout, matmul, prefix_cache, serve, load, tracing, routing, speculative,
               weight_formats, disagg, structured, attention, autocomplete, kv_cache, kl)
