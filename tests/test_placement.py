"""Threads and cores of local workers (serving/placement.py): the rule, and real `serve` processes."""

from __future__ import annotations

import os

import pytest
from test_server import Server

from hetserve.serving.devices import parse_devices
from hetserve.serving.placement import Placement, available_cores, describe, place


def placed(values: list[str], cores: int):
    return place(parse_devices(values, {}, "float32"), range(cores))


def test_cpu_workers_without_threads_share_the_cores():
    assert placed(["cpu", "cpu"], 2) == ([Placement(1, (0,)), Placement(1, (1,))], ())
    assert placed(["cpu", "cpu", "cpu"], 8) == ([Placement(3, (0, 1, 2)), Placement(3, (3, 4, 5)),
                                                 Placement(2, (6, 7))], ())
    # given threads stand; the rest of the cores go to the workers without them
    assert placed(["cpu:threads=1", "cpu"], 4) == ([Placement(1, (0,)), Placement(3, (1, 2, 3))], ())


def test_cores_no_cpu_worker_holds_are_the_api_process():
    assert placed(["cpu:threads=2"], 8) == ([Placement(2, (0, 1))], (2, 3, 4, 5, 6, 7))
    # a GPU worker keeps the whole mask, not the API process's part of it
    assert placed(["cpu:threads=1", "cuda"], 2) == ([Placement(1, (0,)), Placement(None, (0, 1))], (1,))


def test_the_start_up_line_names_what_was_pinned():
    specs = parse_devices(["cpu:threads=2", "cuda", "cpu:threads=1"], {}, "float32")
    assert describe(specs, *place(specs, range(4))) == \
        "worker cpu0: 2 threads on cores [0, 1]; worker cpu2: 1 thread on cores [2]; API process on cores [3]"
    one = parse_devices(["cpu"], {}, "float32")
    assert describe(one, *place(one, range(2))) == ""  # a lone default worker: nothing pinned, nothing said


def test_a_single_default_worker_and_remote_workers_are_left_as_they_are():
    assert placed(["cpu"], 2) == ([Placement(None, None)], ())
    assert placed(["cpu", "ray:cpu:threads=2"], 2) == ([Placement(None, None), Placement(2, None)], ())


def test_more_threads_than_cores_pins_nothing(caplog):
    assert placed(["cpu:threads=2", "cpu:threads=2"], 2) == ([Placement(2, None), Placement(2, None)], ())
    assert "4 CPU worker threads on 2 cores" in caplog.text
    assert placed(["cpu", "cpu", "cpu"], 2) == ([Placement(1, None)] * 3, ())  # at least one thread each


def _mask(pid: int) -> set[int]:
    return os.sched_getaffinity(pid)


@pytest.mark.skipif(len(available_cores()) < 2, reason="needs at least 2 cores to place two workers apart")
def test_serve_pins_default_cpu_workers_to_their_own_cores(tiny_qwen2):
    s = Server(tiny_qwen2, "--inference-device", "cpu", "--inference-device", "cpu", "--kv-cache-memory", "8MiB",
               "--no-startup-profile")
    try:
        masks = [_mask(p) for p in s.worker_pids()]
        assert len(masks) == 2 and not masks[0] & masks[1] and masks[0] | masks[1] == set(available_cores())
        assert _mask(s.proc.pid) == set(available_cores())  # no core left over: the API process keeps its mask
    finally:
        s.stop()


@pytest.mark.skipif(len(available_cores()) < 2, reason="needs a core left over for the API process")
def test_serve_keeps_the_api_process_off_the_workers_cores(tiny_qwen2):
    cores = available_cores()
    s = Server(tiny_qwen2, "--inference-device", "cpu:threads=1", "--kv-cache-memory", "8MiB")
    try:
        (worker,) = s.worker_pids()
        assert _mask(worker) == {cores[0]}
        api = set(cores[1:])
        assert _mask(s.proc.pid) == api
        assert all(_mask(p) == api for p in s.child_pids() if p != worker)  # its tokenizer processes too
    finally:
        s.stop()
