"""Chrome traces: well-formed, nested, one layer span per model layer (or, where the layers run
in one native call, one `layers` span per forward); NVTX pushes always popped."""

from __future__ import annotations

import json

import pytest

from hetserve import LLM, SamplingParams, trace


@pytest.fixture(params=[False, True], ids=["per-op", "native-layers"])
def traced_run(tiny_qwen2, tmp_path, request):
    llm = LLM(model=tiny_qwen2, kv_cache_memory="4MiB", max_num_batched_tokens=16,
              trace_directory=str(tmp_path), native_layers=request.param)
    try:
        llm.generate([list(range(1, 40)), [5, 6, 7]], SamplingParams(max_tokens=5, ignore_eos=True),
                     use_tqdm=False)
    finally:
        path = trace.stop()
    with open(path) as f:
        return json.load(f)["traceEvents"], llm.model.config.num_layers, request.param


def spans(events):
    """Pair begin/end events per thread with a stack; fails on any mismatch."""
    stacks, out = {}, []
    for ev in events:
        if ev["ph"] == "B":
            stacks.setdefault(ev["tid"], []).append(ev)
        elif ev["ph"] == "E":
            begin = stacks[ev["tid"]].pop()
            assert begin["name"] == ev["name"], (begin, ev)
            out.append({"name": ev["name"], "ts": begin["ts"], "end": ev["ts"], "args": begin.get("args", {}),
                        "depth": len(stacks[ev["tid"]]), "tid": ev["tid"]})
    assert all(not s for s in stacks.values()), "a span was never closed"
    return out


def test_trace_is_well_formed_and_nested(traced_run):
    events, num_layers, native_layers = traced_run
    all_spans = spans(events)
    assert all(s["end"] >= s["ts"] for s in all_spans), "a span ends before it begins"  # a short one can read 0
    names = {s["name"] for s in all_spans}
    assert {"step", "schedule", "forward", "model", "matmul", "lm_head", "sample"} <= names
    if native_layers:  # every step here has at most 16 rows a sequence: all run native
        assert "layers" in names and "layer" not in names
    else:
        assert {"layer", "attn", "qkv", "attention", "mlp"} <= names and "layers" not in names
        assert {"rope", "kv-write"} <= names or "rope+kv-write" in names  # torch ops, or the native fused op
    # Children lie within their parents: every span at depth d sits inside one at depth d - 1.
    by_depth = {}
    for s in all_spans:
        by_depth.setdefault(s["depth"], []).append(s)
    for d, items in by_depth.items():
        if d == 0:
            continue
        for s in items:
            assert any(p["ts"] <= s["ts"] and s["end"] <= p["end"] for p in by_depth[d - 1]), s
    forwards = [s for s in all_spans if s["name"] == "forward"]
    for fwd in forwards:
        inside = [s for s in all_spans if fwd["ts"] <= s["ts"] and s["end"] <= fwd["end"]]
        if native_layers:
            assert [s["args"] for s in inside if s["name"] == "layers"] == [{"native": True}]
        else:
            assert sorted(s["args"]["index"] for s in inside if s["name"] == "layer") == list(range(num_layers))
    matmuls = [s for s in all_spans if s["name"] == "matmul"]
    assert all({"op", "impl", "rows"} <= set(s["args"]) for s in matmuls)
    ops = {s["args"]["op"] for s in matmuls}
    assert ops == {"lm_head"} if native_layers else ops >= {"qkv", "o", "gate_up", "down", "lm_head"}


def test_request_instants_and_counters(traced_run):
    events, _, _ = traced_run
    instants = [e for e in events if e["ph"] == "i"]
    for name in ("queued", "scheduled", "first token", "finished"):
        assert sum(e["name"] == name for e in instants) == 2, name
    counters = {e["name"] for e in events if e["ph"] == "C"}
    assert counters == {"requests", "pages"}


class FakeNVTX:
    """Return values differ between NVTX builds (depth, -1, None): the tracer must ignore them."""

    def __init__(self, push_result):
        self.push_result, self.stack, self.log = push_result, [], []

    def range_push(self, name):
        self.stack.append(name)
        self.log.append(("push", name))
        return self.push_result

    def range_pop(self):
        self.log.append(("pop", self.stack.pop()))
        return self.push_result


@pytest.mark.parametrize("push_result", [0, -1, None, 3])
def test_nvtx_push_always_matched_by_pop(tmp_path, push_result):
    nvtx = FakeNVTX(push_result)
    trace.start(str(tmp_path), "nvtx", nvtx=nvtx)
    try:
        with trace.span("outer"):
            with trace.span("inner", rows=1):
                pass
            with pytest.raises(RuntimeError):
                with trace.span("failing"):
                    raise RuntimeError("boom")
    finally:
        trace.stop()
    assert nvtx.stack == []
    assert nvtx.log == [("push", "outer"), ("push", "inner"), ("pop", "inner"), ("push", "failing"),
                        ("pop", "failing"), ("pop", "outer")]


def test_tracing_off_is_a_shared_no_op():
    assert not trace.enabled()
    assert trace.span("x", a=1) is trace.span("y")
