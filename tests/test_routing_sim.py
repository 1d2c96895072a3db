"""The routing simulator: exact timings on small cases, the reference experiment on the issue's rates, the CLI."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from hetserve.bench.routing_sim import SimRequest, simulate, summary
from hetserve.serving.router import Profile

GPU, CPU = Profile.flat(2551, 293), Profile.flat(73, 45)
PREFIX = list(range(1, 497))


def test_one_request_timing_follows_the_profile():
    r = SimRequest(0.5, list(range(1, 101)), 10)
    simulate([("w", Profile.flat(100, 10))], [r], "cost", max_num_batched_tokens=64)
    assert r.worker == "w"
    assert r.ttft == pytest.approx(1.0)  # 100 prompt tokens in chunks of 64 + 36 at 100 tok/s
    assert r.e2e == pytest.approx(1.0 + 9 * 0.1)  # then 9 decode steps of one row at 10 tok/s


def test_a_cached_prefix_shortens_prefill_and_pages_are_shared_after_publication():
    a = SimRequest(0.0, PREFIX + [900 + j for j in range(20)], 2)
    simulate([("w", Profile.flat(10, 1000))], [a], "cost", seed_prefix=PREFIX + [0])
    assert a.ttft == pytest.approx(20 / 10)
    first, second = SimRequest(0.0, PREFIX + [1], 1), SimRequest(60.0, PREFIX + [2], 1)
    simulate([("w", Profile.flat(10, 1000))], [first, second], "cost")
    assert first.ttft == pytest.approx(497 / 10) and second.ttft == pytest.approx(1 / 10)  # 31 pages hit


def test_reference_experiment_on_the_issues_rates():
    def run(n, policy):
        reqs = [SimRequest(0.05 * i, PREFIX + [1000 + 20 * i + j for j in range(20)], 128) for i in range(n)]
        simulate([("gpu", GPU), ("cpu", CPU)], reqs, policy, max_num_seqs=4, seed_prefix=PREFIX + [0] * 8)
        return summary(reqs)

    for n, offloaded in ((8, 1), (48, 6)):
        forced, cost = run(n, "force:gpu"), run(n, "cost")
        assert forced["per_worker"] == {"gpu": n}
        assert cost["per_worker"] == {"gpu": n - offloaded, "cpu": offloaded}
        assert cost["completion_s"] < forced["completion_s"]
        assert cost["output_tok_s"] > forced["output_tok_s"]
    assert run(8, "round-robin")["per_worker"] == {"gpu": 4, "cpu": 4}
    # simulated workers run at their profiles' speed: refining them changes nothing
    static, refined = run(48, "cost+static"), run(48, "cost")
    assert {k: v for k, v in static.items() if not k.startswith("route_ms")} == \
        {k: v for k, v in refined.items() if not k.startswith("route_ms")}  # the router's own timing aside


def test_bench_routing_simulate_cli(tmp_path):
    paths = []
    for name, prof in (("gpu", GPU), ("cpu", CPU)):
        prof.device = "cuda" if name == "gpu" else "cpu"
        paths += ["--profile", str(tmp_path / f"{name}.json")]
        (tmp_path / f"{name}.json").write_text(json.dumps(prof.to_json()))
    r = subprocess.run([sys.executable, "-m", "hetserve.cli", "bench", "routing", "--simulate", *paths, "--bursts",
                        "8", "200", "--out", str(tmp_path / "out")], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "| 8 | cost |" in r.stdout and "| 200 | force:cuda0 |" in r.stdout
    report = json.loads((tmp_path / "out" / "routing-simulated.json").read_text())
    assert [(c["requests"], c["policy"]) for c in report["cases"]] == [
        (8, "force:cuda0"), (8, "cost"), (200, "force:cuda0"), (200, "cost")]
    assert sum(report["cases"][3]["median"]["per_worker"][0].values()) == 200
