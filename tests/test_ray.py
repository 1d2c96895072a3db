"""Workers on a Ray cluster: a local two-node cluster (ray.cluster_utils), the tiny model, real
server processes. Greedy tokens through Ray workers equal one local worker's; the route log
names each candidate's node; a cached prefix draws the request to its node; disaggregation
across nodes; a killed actor fails exactly its requests, the others finish, pages come back,
and with restarts the worker rejoins."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import httpx
import pytest
from test_routing_server import (
    PREFIX,
    complete,
    concurrent_completions,
    one_worker_outputs,
    routed,
)
from test_server import Server

from hetserve.sampling_params import SamplingParams

ray = pytest.importorskip("ray", reason="Ray is not installed")

PROMPTS = [[(11 * i + 3 * k) % 390 + 1 for k in range(20 + 9 * i)] for i in range(4)]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """Two Ray nodes on this machine, told apart by a custom resource each (node_a, node_b)."""
    from ray.cluster_utils import Cluster

    try:
        c = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "resources": {"node_a": 2},
                                                          "include_dashboard": False})
        c.add_node(num_cpus=2, resources={"node_b": 2})
        c.wait_for_nodes()
    except Exception as e:  # e.g. no room for the object store, ports taken
        pytest.skip(f"a local Ray cluster cannot start here: {type(e).__name__}: {e}")
    yield c
    c.shutdown()


def ray_server(model, cluster, log, *flags):
    return Server(model, "--kv-cache-memory", "16MiB", "--deterministic", "--no-startup-profile",
                  "--ray-address", cluster.address, "--route-log", str(log),
                  "--inference-device", "ray:cpu:threads=1,node=node_a",
                  "--inference-device", "ray:cpu:threads=1,node=node_b", *flags, timeout=240)


def health(server) -> dict:
    return {w["name"]: w for w in httpx.get(server.url + "/health", timeout=60).json()["workers"]}


def pages_used(server) -> dict:
    return {w: v["kv_pages_used"] for w, v in health(server).items()}


def wait_for(pred, timeout=60.0):  # only an upper bound: returns as soon as pred() holds
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


async def killed_mid_request(server, worker: str, kill, others_on: str | None = None):
    """A long request pinned to `worker`, three short ones on `others_on`; `kill()` once the long
    one runs. Returns (the long one's response, the short ones')."""
    async with httpx.AsyncClient(timeout=120) as c:
        doomed = asyncio.ensure_future(c.post(server.url + "/v1/completions", json={
            "prompt": [1, 2, 3], "max_tokens": 400, "ignore_eos": True, "worker": worker}))
        others = [asyncio.ensure_future(c.post(server.url + "/v1/completions", json={
            "prompt": [i + 5, 6, 7], "max_tokens": 60, "ignore_eos": True, "worker": others_on}))
            for i in range(3)] if others_on else []
        deadline = time.monotonic() + 60  # polled however long a slow host takes; 60 s: it never ran
        while (await asyncio.to_thread(health, server))[worker]["running"] != 1:
            assert time.monotonic() < deadline, f"{worker} never showed the request running"
            await asyncio.sleep(0.005)
        kill()
        return await doomed, await asyncio.gather(*others)


@pytest.fixture(scope="module")
def pair(tiny_qwen2, cluster, tmp_path_factory):
    log = tmp_path_factory.mktemp("ray") / "route.jsonl"
    s = ray_server(tiny_qwen2, cluster, log, "--ray-restarts", "1")
    s.log = log
    yield s
    assert s.stop() == 0


def test_two_ray_workers_give_one_local_workers_tokens(tiny_qwen2, pair):
    expected = one_worker_outputs(tiny_qwen2, PROMPTS, SamplingParams(max_tokens=12, temperature=0.0,
                                                                     ignore_eos=True))
    results = concurrent_completions(pair.url, PROMPTS)
    assert [r["choices"][0]["text"] for r in results] == [o.text for o in expected]
    h = health(pair)
    assert {w["state"] for w in h.values()} == {"up"} and h["ray-cpu0"]["node"] != h["ray-cpu1"]["node"]
    lines = routed(pair.log)
    assert all({c["worker"]: c["node"] for c in line["candidates"]} ==
               {name: w["node"] for name, w in h.items()} for line in lines)
    assert {line["choice"] for line in lines} == {"ray-cpu0", "ray-cpu1"}
    wait_for(lambda: set(pages_used(pair).values()) == {0})


def test_a_cached_prefix_draws_the_request_to_its_node(pair):
    complete(pair.url, PREFIX + [1, 2, 3], 2, worker="ray-cpu1")
    r = complete(pair.url, PREFIX + [4, 5, 6, 7], 4)
    last = routed(pair.log)[-1]
    assert last["choice"] == "ray-cpu1" and r["usage"]["prompt_tokens_details"]["cached_tokens"] == 96


def test_a_killed_actor_fails_its_requests_the_rest_finish_and_it_rejoins(pair):
    pid = health(pair)["ray-cpu1"]["pid"]

    doomed, others = asyncio.run(killed_mid_request(pair, "ray-cpu1", lambda: os.kill(pid, signal.SIGKILL),
                                                    others_on="ray-cpu0"))
    assert doomed.status_code == 503 and "ray-cpu1" in doomed.json()["error"]["message"]
    assert all(r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 60 for r in others)
    assert httpx.get(pair.url + "/health").status_code == 200
    wait_for(lambda: pages_used(pair)["ray-cpu0"] == 0)
    # --ray-restarts 1: Ray restarts the actor, which loads the model again and rejoins.
    wait_for(lambda: health(pair)["ray-cpu1"]["state"] == "up", timeout=120)
    assert health(pair)["ray-cpu1"]["pid"] != pid
    assert complete(pair.url, [9, 8, 7], 3, worker="ray-cpu1")["usage"]["completion_tokens"] == 3


def test_disaggregation_across_nodes(tiny_qwen2, cluster, tmp_path):
    s = ray_server(tiny_qwen2, cluster, tmp_path / "route.jsonl", "--disaggregate",
                   "prefill=ray-cpu0,decode=ray-cpu1")
    try:
        expected = one_worker_outputs(tiny_qwen2, PROMPTS, SamplingParams(max_tokens=12, temperature=0.0,
                                                                         ignore_eos=True))
        results = concurrent_completions(s.url, PROMPTS)
        assert [r["choices"][0]["text"] for r in results] == [o.text for o in expected]
        moves = [line for line in routed(tmp_path / "route.jsonl") if line.get("event") == "kv_transfer"]
        assert len(moves) == 4 and all(m["ok"] and m["bytes"] > 0 for m in moves)
        wait_for(lambda: set(pages_used(s).values()) == {0})
    finally:
        assert s.stop() == 0


def test_the_python_api_runs_ray_workers(tiny_qwen2, cluster):
    from hetserve import LLM

    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    expected = [o.text for o in one_worker_outputs(tiny_qwen2, PROMPTS[:2], params)]
    llm = None
    try:
        llm = LLM(model=tiny_qwen2, devices=["ray:cpu:threads=1,node=node_a", "ray:cpu:threads=1,node=node_b"],
                  ray_address=cluster.address, kv_cache_memory="16MiB", deterministic=True)
        assert [o.text for o in llm.generate(PROMPTS[:2], params, use_tqdm=False)] == expected
    finally:
        if llm is not None:
            llm.close()
        ray.shutdown()  # this test process joined the cluster as a driver


def test_local_and_ray_workers_mix_and_a_lost_node_leaves_the_rest_serving(tiny_qwen2, cluster, tmp_path):
    """A local worker beside a Ray worker on a node of its own; that node is then removed from the
    cluster: its worker is declared dead with a 503 for its request, the local one serves on."""
    node_c = cluster.add_node(num_cpus=1, resources={"node_c": 1})
    cluster.wait_for_nodes()
    log = tmp_path / "route.jsonl"
    s = Server(tiny_qwen2, "--kv-cache-memory", "16MiB", "--deterministic", "--no-startup-profile",
               "--ray-address", cluster.address, "--route-log", str(log), "--inference-device", "cpu:threads=1",
               "--inference-device", "ray:cpu:threads=1,node=node_c", timeout=240)
    try:
        expected = one_worker_outputs(tiny_qwen2, PROMPTS, SamplingParams(max_tokens=12, temperature=0.0,
                                                                         ignore_eos=True))
        results = concurrent_completions(s.url, PROMPTS)
        assert [r["choices"][0]["text"] for r in results] == [o.text for o in expected]
        nodes = {c["worker"]: c["node"] for c in routed(log)[0]["candidates"]}
        assert nodes["cpu0"] == "local" and nodes["ray-cpu1"] == health(s)["ray-cpu1"]["node"] != "local"

        doomed, _ = asyncio.run(killed_mid_request(s, "ray-cpu1",
                                                   lambda: cluster.remove_node(node_c, allow_graceful=False)))
        assert doomed.status_code == 503 and "ray-cpu1" in doomed.json()["error"]["message"]
        assert health(s)["ray-cpu1"]["state"] == "dead" and health(s)["cpu0"]["state"] == "up"
        assert complete(s.url, [4, 5, 6], 3)["usage"]["completion_tokens"] == 3
        wait_for(lambda: pages_used(s)["cpu0"] == 0)
    finally:
        assert s.stop() == 0
