"""`hetserve bench load` against a two-worker server: misbehaving streaming clients lose nothing."""

from __future__ import annotations

import json
import subprocess
import sys

from test_server import Server


def test_misbehaving_clients_lose_nothing_and_pages_come_back(tiny_qwen2, tmp_path):
    s = Server(tiny_qwen2, "--inference-device", "cpu:threads=1", "--inference-device", "cpu:threads=1",
               "--kv-cache-memory", "8MiB", "--no-startup-profile")
    try:
        out = tmp_path / "load.json"
        run = subprocess.run([sys.executable, "-m", "hetserve.cli", "bench", "load", "--url", s.url, "--clients", "24",
                              "--duration", "10", "--prompt-tokens", "96", "--abort", "0.1", "--out", str(out)],
                             capture_output=True, text=True, timeout=600)  # 10 s of load, up to 30 s to settle
        report = json.loads(out.read_text())
        assert run.returncode == 0, run.stdout + run.stderr
        kinds = report["outcomes"]
        # Each misbehaviour happened (how many fit in the 10 s depends on the machine's speed) and lost nothing
        assert kinds.get("full", 0) > 0 and kinds.get("disconnected", 0) > 0 and kinds.get("aborted", 0) > 0
        assert "lost" not in kinds and not report["errors"], report
        assert report["after"] == {"hetserve:num_requests_running": 0, "hetserve:num_requests_waiting": 0,
                                   "hetserve:kv_pages_used": 0}
    finally:
        assert s.stop() == 0
    log = s.proc.stdout.read()
    assert "Traceback" not in log and "socket.send() raised" not in log, log[-2000:]


def test_bench_load_refuses_remote_servers():
    run = subprocess.run([sys.executable, "-m", "hetserve.cli", "bench", "load", "--url", "http://10.1.2.3:8000"],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode != 0 and "loopback" in run.stderr
