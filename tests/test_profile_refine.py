"""Routing profiles that stay true, with real worker processes and a real CPU hog: two identical
one-thread workers, one started beside a busy loop on its core, agree once the loop stops (the
router follows each worker's steps and idle probes), and split a burst evenly; a loop started
on one worker's core under load takes work from it, and stopping it gives the work back.

Waits are deadlines that only catch a hang: how fast the speeds converge is measured, not
asserted (docs/server.md gives the figures)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time

import httpx
import pytest
from test_server import Server

AGREE = 0.15  # current profiles within 15% of each other
DEADLINE_S = 180.0


def hog(core: int) -> subprocess.Popen:
    """A busy loop pinned to one core."""
    return subprocess.Popen([sys.executable, "-c", f"import os; os.sched_setaffinity(0, {{{core}}})\nwhile True: pass"])


def current(server) -> dict[str, dict]:
    workers = httpx.get(server.url + "/v1/dashboard", timeout=30).json()["workers"]
    return {w["name"]: w["profile"]["current"] for w in workers}


def apart(profiles: dict[str, dict]) -> float:
    """The largest relative difference between the two workers' current rates, over every point."""
    a, b = profiles.values()
    gaps = [abs(x[1] - y[1]) / max(x[1], y[1]) for kind in ("prefill", "decode") for x, y in zip(a[kind], b[kind])]
    return max(gaps)


def burst(server, n: int = 16) -> dict[str, int]:
    """n equal requests at once; how many each worker was given (from the route log)."""
    before = len(server.log.read_text().splitlines())

    async def main():
        async with httpx.AsyncClient(timeout=120) as c:
            body = {"prompt": [5, 6, 7, 8, 9, 10, 11, 12], "max_tokens": 8, "ignore_eos": True, "temperature": 0}
            rs = await asyncio.gather(*[c.post(server.url + "/v1/completions", json=body) for _ in range(n)])
            assert all(r.status_code == 200 for r in rs), [r.text for r in rs if r.status_code != 200]

    asyncio.run(main())
    lines = [json.loads(x) for x in server.log.read_text().splitlines()[before:]]
    choices = [x["choice"] for x in lines if "choice" in x]
    assert len(choices) == n
    return {w: choices.count(w) for w in ("cpu0", "cpu1")}


def until(condition, what: str, detail=lambda: ""):
    deadline = time.monotonic() + DEADLINE_S
    while True:
        value = condition()
        if value:
            return value
        assert time.monotonic() < deadline, f"{what} did not happen within {DEADLINE_S:.0f} s {detail()}"
        time.sleep(0.2)


@pytest.fixture(scope="module")
def cores():
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        pytest.skip("two cores are needed: one worker on each, a hog on one of them")
    return cores


def test_profiles_measured_beside_a_hog_come_true_and_follow_a_hog_under_load(tiny_qwen2, cores, tmp_path):
    log = tmp_path / "route.jsonl"
    h = hog(cores[0])  # the workers are pinned in order: cpu0 to the first core
    try:
        s = Server(tiny_qwen2, "--kv-cache-memory", "16MiB", "--inference-device", "cpu:threads=1",
                   "--inference-device", "cpu:threads=1", "--route-log", str(log), "--profile-probe-s", "0.1",
                   "--worker-restarts", "0")
    finally:
        h.kill()
        h.wait()
    s.log = log
    try:
        workers = httpx.get(s.url + "/v1/dashboard", timeout=30).json()["workers"]
        startup = {w["name"]: w["profile"] for w in workers}
        assert all(p["spread"]["worst"] >= 0 and p["current"]["speed"]["steps"] >= 0 for p in startup.values())
        # The hog has stopped: the idle workers' probes bring the two current profiles together.
        until(lambda: apart(current(s)) <= AGREE, f"current profiles within {AGREE:.0%}",
              lambda: f"start-up: {startup}; now: {current(s)}")
        split = burst(s)
        assert abs(split["cpu0"] - 8) <= 1, (split, current(s))

        # A hog on cpu0's core under load: its share of a burst falls below an even one (how far
        # depends on how the machine shares a core: on a KVM Sapphire Rapids one run did not get
        # to 6 of 16 within 180 s where the same test alone did)...
        h = hog(cores[0])
        splits = []
        try:
            until(lambda: splits.append(burst(s)) or splits[-1]["cpu0"] <= 7, "the slowed worker's share falling",
                  lambda: f"bursts: {splits[-10:]}; profiles now: {current(s)}")
        finally:
            h.kill()
            h.wait()
        # ...and comes back once the hog has stopped.
        until(lambda: abs(burst(s)["cpu0"] - 8) <= 1, "an even split after the hog stopped")
        assert "decode_estimate" in json.loads(log.read_text().splitlines()[-1])
    finally:
        assert s.stop() == 0
