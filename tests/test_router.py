"""The router's cost model and policies, as pure code (no workers): exact numbers on the issue's example."""

from __future__ import annotations

import msgpack
import pytest

from hetserve.kv.prefix_cache import chain_hashes, root_hash
from hetserve.serving import ipc
from hetserve.serving.devices import parse_devices
from hetserve.serving.router import NoWorker, OutputLengths, Placed, Profile, Router, WorkerView

MODEL = "qwen2:test:123"
PREFIX = [(5 * i) % 300 + 1 for i in range(496)]  # 31 full pages of 16


def prompt(i: int) -> list[int]:
    return PREFIX + [1000 + 20 * i + j for j in range(20)]  # 516 tokens, 496 shared


def seeded(name: str, prefill: float, decode: float, **kw) -> WorkerView:
    v = WorkerView(name, Profile.flat(prefill, decode), MODEL, 16, **kw)
    v.cached.update(chain_hashes(root_hash(MODEL), PREFIX, 16))
    return v


def test_worked_example_picks_the_gpu_with_exact_scores():
    cpu, gpu = seeded("cpu0", 73, 45), seeded("cuda1", 2551, 293)
    router = Router("cost", [cpu, gpu])
    # The GPU's backlog: 4 running requests with 496 tokens of budget left, 2 queued ones.
    for i in range(6):
        router.route(f"r{i}", prompt(i), 128, pin="cuda1")
    gpu.apply_state(queued_ids=["r4", "r5"], running={f"r{i}": 0 for i in range(4)}, published=[], evicted=[])
    for i, generated in enumerate([0, 0, 8, 8]):  # remaining budgets 128 + 128 + 120 + 120 = 496
        router.progress("cuda1", f"r{i}", generated)

    d = router.route("new", prompt(9), 128)
    c_cpu, c_gpu = d.candidates
    assert (c_cpu.active, c_cpu.queued, c_cpu.cached_tokens) == (0, 0, 496)
    assert (c_cpu.prefill_tokens, c_cpu.decode_tokens) == (20, 128)
    assert c_cpu.score == 20 / 73 + 128 / 45
    assert (c_gpu.active, c_gpu.queued, c_gpu.cached_tokens) == (4, 2, 496)
    assert (c_gpu.prefill_tokens, c_gpu.decode_tokens) == (60, 880)
    assert c_gpu.score == 60 / 2551 + 880 / 293
    assert d.worker == "cuda1" and set(gpu.requests) == {f"r{i}" for i in range(6)} | {"new"}
    assert not cpu.requests


def test_cost_prefers_the_worker_with_the_cached_prefix():
    cold = WorkerView("cpu0", Profile.flat(100, 10), MODEL, 16)
    warm = seeded("cpu1", 100, 10)
    d = Router("cost", [cold, warm]).route("a", prompt(0), 16)
    assert d.worker == "cpu1"
    assert [c.cached_tokens for c in d.candidates] == [0, 496]


def test_cached_prefix_follows_publication_eviction_and_salt():
    v = seeded("w", 1, 1)
    p = prompt(0)
    assert v.cached_tokens(p) == 496
    assert v.cached_tokens(p, cache_salt="tenant") == 0  # another root: nothing shared
    assert v.cached_tokens(PREFIX) == 480  # the last token of a prompt is always computed
    evicted = chain_hashes(root_hash(MODEL), PREFIX, 16)[10]
    v.apply_state([], {}, published=[], evicted=[evicted])
    assert v.cached_tokens(p) == 160  # a hole ends the usable run
    v.apply_state([], {}, published=[evicted], evicted=[])
    assert v.cached_tokens(p) == 496


def test_queued_requests_keep_their_routing_estimate_until_they_run():
    v = WorkerView("w", Profile.flat(10, 10), MODEL, 16)
    r = Router("cost", [v])
    r.route("a", list(range(1, 101)), 50)
    v.apply_state(queued_ids=[], running={}, published=[], evicted=[])  # sent before "a" arrived
    assert v.requests["a"].prefill_tokens == 100 and not v.requests["a"].active
    v.apply_state(queued_ids=[], running={"a": 36}, published=[], evicted=[])  # partly prefilled
    assert v.requests["a"].prefill_tokens == 36 and v.requests["a"].active
    r.progress("w", "a", 10)
    assert v.estimate().prefill_tokens == 0 and v.estimate().decode_tokens == 40
    v.apply_state(queued_ids=["a"], running={}, published=[], evicted=[])  # preempted
    assert not v.requests["a"].active
    r.finished("w", "a")
    assert not v.requests


def test_decode_rate_follows_the_batch_size():
    prof = Profile([(64, 100), (512, 200)], [(1, 10), (4, 30)])
    assert prof.prefill_rate(288) == 150 and prof.prefill_rate(10) == 100 and prof.prefill_rate(4096) == 200
    assert prof.decode_rate(2) == pytest.approx(16.666666) and prof.decode_rate(8) == 30
    v = WorkerView("w", prof, MODEL, 16, max_num_seqs=4)
    r = Router("cost", [v])
    for i in range(6):
        r.route(f"r{i}", [1] * 10, 30)
    # 6 requests but at most 4 run together: 180 tokens at the batch-4 rate
    assert v.estimate().decode_s == 180 / 30
    assert Profile.from_json(prof.to_json()) == prof
    with pytest.raises(ValueError):
        Profile([(64, 0.0)], [(1, 1.0)])
    with pytest.raises(ValueError):
        Profile.from_json({"prefill": [], "decode": []})


def test_round_robin_least_loaded_force_and_dead_workers():
    views = [WorkerView(n, Profile.flat(1, 1), MODEL) for n in ("cpu0", "cpu1", "cpu2")]
    rr = Router("round-robin", views)
    assert [rr.route(f"a{i}", [1, 2], 4).worker for i in range(4)] == ["cpu0", "cpu1", "cpu2", "cpu0"]
    views[1].alive = False
    assert [rr.route(f"b{i}", [1, 2], 4).worker for i in range(2)] == ["cpu2", "cpu0"]
    ll = Router("least-loaded", views)  # cpu0 has 3, cpu2 has 2, cpu1 is dead
    assert ll.route("c", [1, 2], 4).worker == "cpu2"
    assert ll.route("d", [1, 2], 4).worker == "cpu0"  # 3 each: the first wins
    forced = Router("force:cpu1", views)
    with pytest.raises(NoWorker):
        forced.route("e", [1, 2], 4)
    views[1].alive = True
    assert forced.route("e", [1, 2], 4).worker == "cpu1"
    with pytest.raises(ValueError, match="no worker named"):
        Router("force:gpu9", views)
    with pytest.raises(ValueError, match="unknown route policy"):
        Router("fastest", views)


def test_a_request_only_goes_where_it_fits():
    small = WorkerView("small", Profile.flat(1000, 1000), MODEL, capacity_tokens=64)
    big = WorkerView("big", Profile.flat(1, 1), MODEL, capacity_tokens=4096)
    r = Router("cost", [small, big])
    assert r.route("a", [1] * 10, 10).worker == "small"
    assert r.route("b", [1] * 100, 10).worker == "big"
    big.alive = False
    with pytest.raises(NoWorker):
        r.route("c", [1] * 100, 10)


def test_device_specs_and_overrides():
    specs = parse_devices(["cpu:threads=1,dtype=float32,max_num_seqs=4", "gpu", "cuda", "gpu", "cpu"],
                          {"max_num_seqs": 8, "deterministic": False}, "bfloat16")
    assert [s.name for s in specs] == ["cpu0", "cuda1", "cuda2", "cuda3", "cpu4"]
    assert [s.device for s in specs] == ["cpu", "cuda:1", "cuda:0", "cuda:2", "cpu"]
    assert (specs[0].threads, specs[0].dtype, specs[0].engine["max_num_seqs"]) == (1, "float32", 4)
    assert (specs[4].threads, specs[4].dtype, specs[4].engine["max_num_seqs"]) == (None, "bfloat16", 8)
    one = parse_devices(["cpu:threads=2,deterministic=true"], {}, "float32")[0]
    assert (one.name, one.threads, one.engine) == ("cpu", 2, {"deterministic": True})
    floats = parse_devices(["cpu,max_decode_stall=0.5,spec_tv_budget=0.25"], {}, "float32")[0]
    assert floats.engine == {"max_decode_stall": 0.5, "spec_tv_budget": 0.25}
    for bad in ("tpu", "cpu,colour=red", "cpu,max_num_seqs=0", "gpu:1", "cpu,threads=0", "cpu,max_num_seqs=x",
                "cpu,max_decode_stall=soon", "cpu,max_decode_stall=-1"):
        with pytest.raises(ValueError):
            parse_devices([bad], {}, "float32")


def test_worker_state_messages_are_checked():
    h = bytes(range(32))
    st = ipc.WorkerState(1, 0, 2, 8, 0, queued_ids=["a"], running_prefill={"b": 3}, published=[h], evicted=[])
    msg = ipc.decode(ipc.encode(ipc.Outputs("w", [], st)))
    assert msg.state == st
    for bad in ({"published": [b"short"]}, {"running_prefill": {"b": -1}}, {"queued_ids": [1]},
                {"evicted": "x"}, {"chunk_budget": -1}, {"chunk_budget": 1.5}):
        raw = ipc.encode(ipc.Outputs("w", [], ipc.WorkerState(1, 0, 2, 8, 0)))
        data = msgpack.unpackb(raw)
        data["state"].update(bad)
        with pytest.raises(ipc.IPCError):
            ipc.decode(msgpack.packb(data, use_bin_type=True))


# -- profiles refined from the worker's steps ------------------------------------------------------
def test_speed_follows_the_steps_a_worker_runs_and_one_slow_step_moves_it_little():
    v = WorkerView("cpu0", Profile([(32, 320.0), (128, 640.0)], [(1, 50.0), (4, 100.0)]), MODEL, 16)
    v.observe(0, 1, 0.02)  # decode of one row as the profile says (1 / 50 s): no change
    assert v.speed.decode == pytest.approx([1.0, 1.0]) and v.speed.prefill == [1.0, 1.0]
    v.observe(0, 1, 2.0)  # one step 100x slower moves its point's factor by at most max_move
    assert v.speed.decode == pytest.approx([1 / v.speed.max_move, 1.0])
    for _ in range(80):  # then every decode step of 4 rows at half the profile's speed
        v.observe(0, 4, 4 / 100.0 * 2)
    assert v.speed.decode[1] == pytest.approx(0.5, rel=0.05) and v.speed.prefill == [1.0, 1.0]
    assert v.decode_rate(4) == pytest.approx(50.0, rel=0.05)
    assert v.current_profile().decode[1] == (4, pytest.approx(50.0, rel=0.05))
    for _ in range(80):  # 128-token prefills 4x faster than measured: only that point moves
        v.observe(128, 0, 128 / 640.0 / 4)
    assert v.speed.prefill == [1.0, pytest.approx(4.0, rel=0.05)]
    for _ in range(80):  # 80-token prefills sit between the points: both move, each by its share
        v.observe(80, 0, 80 / 320.0)
    assert v.speed.prefill[0] < 1.0 and v.speed.prefill[1] < 4.0
    for _ in range(150):  # the profile's sizes at the profile's speed (an idle worker's probes)
        for size in (32, 128):
            v.observe(size, 0, size / (320.0 if size == 32 else 640.0))
        for rows in (1, 4):
            v.observe(0, rows, rows / (50.0 if rows == 1 else 100.0))
    assert v.speed.prefill == pytest.approx([1.0, 1.0], rel=0.05)
    assert v.speed.decode == pytest.approx([1.0, 1.0], rel=0.05)
    before = v.current_profile()
    v.observe(32, 4, 32 / before.prefill_rate(32) + 4 / before.decode_rate(4))  # a mixed step as predicted
    assert [r for _, r in v.current_profile().prefill] == pytest.approx([r for _, r in before.prefill])
    assert v.speed.to_json()["steps"] == 2 + 80 * 3 + 150 * 4 + 1 and v.speed.to_json()["decode"][0][0] == 1
    v.rejoin()
    assert v.speed.prefill == v.speed.decode == [1.0, 1.0] and v.current_profile() is v.profile


def test_a_slowed_worker_loses_work_and_a_fixed_profile_does_not_move():
    fast, slow = seeded("cpu0", 500, 50), seeded("cpu1", 500, 50)
    fixed = seeded("cpu2", 500, 50, refine=False)
    for _ in range(100):
        slow.observe(0, 1, 0.1)  # its decode steps take 5x what its profile says
        fixed.observe(0, 1, 0.1)
    assert slow.speed.decode == [pytest.approx(0.2, rel=0.05)] and fixed.speed.decode == [1.0]
    router = Router("cost", [fast, slow])
    choices = [router.route(f"r{i}", [7, 8, 9, i], 16).worker for i in range(12)]
    assert choices.count("cpu0") == 10 and choices.count("cpu1") == 2  # 1/5 of the speed: 1/6 of the work


def test_an_unknown_output_length_is_priced_at_what_the_server_has_seen():
    lengths = OutputLengths()
    assert lengths.estimate() == (OutputLengths.default, "default")
    for n in (10, 20, 31):
        lengths.finished(n)
    assert lengths.estimate() == (21, "learned")
    for _ in range(OutputLengths.window):
        lengths.finished(100)
    assert lengths.estimate() == (100, "learned")  # the last `window` only
    open_ended = Placed("r", 10, max_tokens=30000, expected=100)
    assert open_ended.decode_tokens == 100
    open_ended.generated = 90
    assert open_ended.decode_tokens == 25  # past most of it: a quarter of it again
    assert Placed("r", 10, max_tokens=40, expected=100).decode_tokens == 40  # never past max_tokens
    assert Placed("r", 10, max_tokens=40).decode_tokens == 40
    v = seeded("cpu0", 100, 10)
    d = Router("cost", [v]).route("x", [1, 2, 3], 30000, expected=100)
    assert d.candidates[0].decode_tokens == 100
