"""Fill-in-the-middle: the FIM tokens of a GGUF, the prompt layout against HF's tokenizer,
llama.cpp's /infill and /v1/completions with `suffix` on a tiny model with FIM tokens, and the
real Qwen2.5-Coder-0.5B filling a function body (and using a helper from another file)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time

import httpx
import pytest
from test_server import Server
from tiny_model import write_tiny_gguf

from hetserve import SamplingParams
from hetserve.models.fim import FimTokens, infill_ids
from hetserve.models.gguf_loader import GGUFFile
from hetserve.models.tokenizer import NoFIM, Tokenizer

PREFIX = "def add(a, b):\n    total = a + b\n    # sum of both\n    "
SUFFIX = "\n\nprint(add(1, 2))\n"
EXTRA = [{"filename": "utils/math.py", "text": "def clamp(x, lo, hi):\n    return max(lo, min(hi, x))\n"},
         {"filename": "README.md", "text": "adds things"}]


@pytest.fixture(scope="module")
def fim_model(tmp_path_factory) -> str:
    d = tmp_path_factory.mktemp("fim")
    return write_tiny_gguf(d / "tiny-fim.gguf", "qwen2", fim=True)


@pytest.fixture(scope="module")
def tok(fim_model) -> Tokenizer:
    with GGUFFile(fim_model) as f:
        return Tokenizer.from_gguf_metadata(f.metadata)


def test_fim_tokens_come_from_the_gguf_fields_or_the_spellings(tok):
    ids = {t: tok.token_to_id(t) for t in ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>", "<|fim_pad|>",
                                           "<|repo_name|>", "<|file_sep|>")}
    assert tok.fim == FimTokens(*ids.values())
    assert tok.fim.stops == {ids["<|fim_pad|>"], ids["<|repo_name|>"], ids["<|file_sep|>"]}
    by_field = FimTokens.find({"tokenizer.ggml.fim_pre_token_id": 7, "tokenizer.ggml.fim_suf_token_id": 8,
                               "tokenizer.ggml.fim_mid_token_id": 9}, {}, 10)
    assert (by_field.prefix, by_field.suffix, by_field.middle, by_field.stops) == (7, 8, 9, set())
    assert FimTokens.find({"tokenizer.ggml.fim_pre_token_id": 10}, {}, 10) is None  # out of the vocabulary
    assert FimTokens.find({}, {"<|fim_prefix|>": 1, "<|fim_suffix|>": 2}, 10) is None  # no middle


def test_the_prompt_is_the_repository_layout_as_hf_reads_it(tok, fim_model):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(fim_model.rsplit("/", 1)[0]), gguf_file=fim_model.rsplit("/", 1)[1])
    text = ("<|repo_name|>repo\n<|file_sep|>utils/math.py\n" + EXTRA[0]["text"] + "<|file_sep|>README.md\n"
            "adds things\n<|file_sep|>src/add.py\n<|fim_prefix|>" + PREFIX + "<|fim_suffix|>" + SUFFIX
            + "<|fim_middle|>")
    ids, truncated = tok.encode_infill(PREFIX, SUFFIX, EXTRA, "src/add.py")
    assert ids == hf(text, add_special_tokens=False)["input_ids"] and not truncated
    plain, _ = tok.encode_infill(PREFIX, SUFFIX)  # no other files: no repository header
    assert plain == hf("<|fim_prefix|>" + PREFIX + "<|fim_suffix|>" + SUFFIX + "<|fim_middle|>",
                       add_special_tokens=False)["input_ids"]
    # Text that spells a FIM token is code, not a token.
    assert tok.encode_infill("<|fim_middle|>", "")[0].count(tok.fim.middle) == 1


def test_over_budget_the_text_nearest_the_cursor_stays(tok, tiny_qwen2):
    enc = lambda t: tok.encode(t, add_bos=False)  # noqa: E731
    pre, suf = "".join(f"line{i} = {i}\n" for i in range(200)), "".join(f"after{i}()\n" for i in range(200))
    full, _ = infill_ids(enc, tok.fim, pre, suf, EXTRA, "a.py")
    ids, truncated = infill_ids(enc, tok.fim, pre, suf, EXTRA, "a.py", budget=300)
    assert truncated and len(ids) <= 300 < len(full)
    cut = ids[ids.index(tok.fim.prefix) + 1: ids.index(tok.fim.suffix)]
    after = ids[ids.index(tok.fim.suffix) + 1: ids.index(tok.fim.middle)]
    assert cut == enc(pre)[-len(cut):] and after == enc(suf)[:len(after)]  # the prefix's tail, the suffix's head
    assert 0 < len(after) < len(cut)  # both sides kept, the prefix the larger share
    capped, truncated = infill_ids(enc, tok.fim, "x = 1\n", suf, EXTRA, "a.py", max_suffix=10)
    assert capped[capped.index(tok.fim.suffix) + 1: capped.index(tok.fim.middle)] == enc(suf)[:10]
    assert not truncated  # the cap is the layout's, not a cut for the context
    small, truncated = infill_ids(enc, tok.fim, "x = 1\n", "y = 2\n", EXTRA, "a.py", budget=300)
    assert not truncated and tok.fim.repo in small  # what fits is not cut
    with pytest.raises(ValueError, match="no room"):
        infill_ids(enc, tok.fim, pre, suf, budget=2)
    with GGUFFile(tiny_qwen2) as f, pytest.raises(NoFIM, match="fill-in-the-middle"):
        Tokenizer.from_gguf_metadata(f.metadata).encode_infill("a", "b")


@pytest.fixture(scope="module")
def server(fim_model):
    s = Server(fim_model, "--kv-cache-memory", "8MiB", "--page-size", "16")
    yield s
    assert s.stop() == 0


def infill(server, **body) -> dict:
    r = httpx.post(server.url + "/infill", json={"temperature": 0, "n_predict": 8, "ignore_eos": True, **body},
                   timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_infill_answers_in_llama_cpps_shape_and_as_completions_with_suffix(server, tok):
    body = {"input_prefix": PREFIX, "input_suffix": SUFFIX, "input_extra": EXTRA}
    out = infill(server, **body, n_indent=4, samplers=["top_k", "infill"], cache_prompt=True)  # ignored extras
    ids, _ = tok.encode_infill(PREFIX, SUFFIX, EXTRA)
    assert out["tokens_evaluated"] == len(ids) and out["tokens_predicted"] == 8 and out["stop"] is True
    assert out["stop_type"] == "limit" and out["truncated"] is False and out["model"] == "tiny-fim.gguf"
    t = out["timings"]
    assert t["predicted_n"] == 8 and t["prompt_n"] == len(ids) - out["tokens_cached"] and t["predicted_ms"] >= 0
    # /v1/completions: prompt before, suffix after (no other files), the same greedy text
    plain = infill(server, input_prefix=PREFIX, input_suffix=SUFFIX)
    r = httpx.post(server.url + "/v1/completions", timeout=120, json={
        "prompt": PREFIX, "suffix": SUFFIX, "max_tokens": 8, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == plain["content"]
    assert r.json()["usage"]["prompt_tokens"] == plain["tokens_evaluated"] == len(tok.encode_infill(PREFIX, SUFFIX)[0])
    # `prompt` is what was typed since the prefix was taken
    typed = infill(server, input_prefix=PREFIX[:-6], prompt=PREFIX[-6:], input_suffix=SUFFIX)
    assert typed["content"] == plain["content"]


def test_streamed_infill_gives_the_same_text(server):
    body = {"input_prefix": PREFIX, "input_suffix": SUFFIX, "temperature": 0, "n_predict": 8, "ignore_eos": True}
    whole = infill(server, **body)
    with httpx.stream("POST", server.url + "/infill", json={**body, "stream": True}, timeout=120) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    assert all(e["stop"] is False for e in events[:-1]) and events[-1]["stop"] is True
    assert "".join(e["content"] for e in events) == whole["content"]
    assert events[-1]["tokens_predicted"] == 8 and "timings" in events[-1]


def test_the_next_keystroke_reuses_the_cached_prefix(server):
    body = {"input_extra": EXTRA, "input_suffix": SUFFIX, "filename": "src/add.py"}
    infill(server, **body, input_prefix=PREFIX * 4)
    again = infill(server, **body, input_prefix=PREFIX * 4 + "x = ")
    assert again["tokens_cached"] >= 16 and again["tokens_cached"] % 16 == 0  # whole pages, up to the cursor
    assert again["timings"]["prompt_n"] == again["tokens_evaluated"] - again["tokens_cached"]


def test_the_suffix_keeps_its_head_at_every_keystroke(server, tok):
    """--infill-suffix-tokens (256): the text after the cursor, computed again at every keystroke,
    is held to its first 256 tokens."""
    after = "".join(f"after{i}()\n" for i in range(120))
    out = infill(server, input_prefix=PREFIX, input_suffix=after)
    assert len(tok.encode_infill(PREFIX, after)[0]) > out["tokens_evaluated"]
    assert out["tokens_evaluated"] == len(tok.encode_infill(PREFIX, after, max_suffix=256)[0])
    assert out["truncated"] is False


def test_a_long_file_is_cut_to_leave_room_for_the_answer(server):
    long = "".join(f"v{i} = {i}\n" for i in range(600))
    out = infill(server, input_prefix=long, input_suffix=long, n_predict=64)
    assert out["truncated"] is True and out["tokens_evaluated"] <= 512 - 64 and 0 < out["tokens_predicted"] <= 64


def test_an_abandoned_request_stops_at_once(server):
    async def main():
        async with httpx.AsyncClient(timeout=120) as c:
            body = {"input_prefix": PREFIX, "input_suffix": SUFFIX, "n_predict": 400, "ignore_eos": True,
                    "stream": True}
            async with c.stream("POST", server.url + "/infill", json=body) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        break  # the user typed on: the editor drops the request

    asyncio.run(main())
    deadline = time.monotonic() + 60  # only an upper bound: the abort lands within a step or two
    while server.metric("hetserve:num_requests_running") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.metric("hetserve:num_requests_running") == 0 and server.metric("hetserve:kv_pages_used") == 0


def test_bad_infill_requests_get_400(server):
    r = httpx.post(server.url + "/infill", json={"input_prefix": "x", "input_extra": [{"filename": 3}]})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.post(server.url + "/v1/completions", json={"prompt": [1, 2], "suffix": "x"})
    assert r.status_code == 400 and "suffix" in r.json()["error"]["message"]
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "a", "suffix": "x", "echo": True})
    assert r.status_code == 400


@pytest.mark.real_model
def test_the_real_model_fills_a_body_and_uses_another_file(real_llm):
    """Greedy fills of the real 0.5B (instruct) model, the cursor on an indented line."""
    tok = real_llm.tokenizer
    greedy = SamplingParams(max_tokens=24, temperature=0.0)
    ids, _ = tok.encode_infill('def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n    ',
                               "\n\nprint(fibonacci(10))\n")
    body = real_llm.generate([ids], greedy, use_tqdm=False)[0].text
    assert body.startswith("return fibonacci(n - 1) + fibonacci(n - 2)"), body
    helper = [{"filename": "geometry/units.py", "text": "def inches_to_cm(inches):\n    return inches * 2.54\n"}]
    ids, _ = tok.encode_infill("from geometry.units import inches_to_cm\n\n\ndef screen_diagonal_cm(d):\n"
                               "    \"\"\"The diagonal d, given in inches, in centimetres.\"\"\"\n    return ",
                               "\n", helper, "report.py")
    assert "inches_to_cm(" in real_llm.generate([ids], greedy, use_tqdm=False)[0].text


def test_bench_autocomplete_replays_an_editor(server, tmp_path):
    """`hetserve bench autocomplete` against a live server: every typing point is one request,
    each completed or cancelled (the next word came first), never failed; the person waits at
    every line's end, so those all complete. Only what holds at any speed is asserted."""
    from hetserve.bench.autocomplete import typing_points

    code = "def area(w, h):\n    return w * h\n\nprint(area(2, 3))\n"
    (tmp_path / "main.py").write_text(code)
    (tmp_path / "util.py").write_text("def clamp(x, lo, hi):\n    return max(lo, min(hi, x))\n")
    out = tmp_path / "ac.json"
    r = subprocess.run([sys.executable, "-m", "hetserve.cli", "bench", "autocomplete", "--url", server.url,
                        "--file", str(tmp_path / "main.py"), "--extra", str(tmp_path / "util.py"), "--start-line", "0",
                        "--lines", "4", "--chars-per-second", "200", "--patience-s", "300", "--n-predict", "4",
                        "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    rep = json.loads(out.read_text())
    lines = code.splitlines()
    assert rep["requests"] == sum(len(typing_points(line)) for line in lines)
    assert rep["failed"] == 0 and rep["completed"] + rep["cancelled"] == rep["requests"]
    assert rep["line_end_complete"]["n"] == sum(1 for line in lines if line.strip())
    for key in ("ttft", "complete", "line_end_ttft", "line_end_complete"):
        assert 0 <= rep[key]["p50_ms"] <= rep[key]["p99_ms"], key
    assert 0 <= rep["cached_tokens"] <= rep["prompt_tokens"] and rep["mean_tokens_predicted"] <= 4
    assert "line_end_complete" in r.stdout
