"""OpenAI-compatibility details clients rely on: logit_bias, the legacy logprobs shape, echo with
prompt scores (loglikelihood tools), vLLM's prompt_logprobs, special tokens in raw prompts."""

from __future__ import annotations

import json
import math

import httpx
import openai
import pytest
from test_server import Server

from hetserve import LLM, SamplingParams
from hetserve.serving.streaming import sse_data

FP32 = {"weight_format": "fp32", "prefill_format": "fp32", "kv_cache_memory": "8MiB"}  # one numeric path


@pytest.fixture(scope="module")
def server(tiny_qwen2):
    s = Server(tiny_qwen2, "--kv-cache-memory", "16MiB", "--weight-format", "fp32", "--prefill-format", "fp32")
    yield s
    assert s.stop() == 0


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused")


def ids_of(server, text: str, **kw) -> list[int]:
    return httpx.post(server.url + "/tokenize", json={"prompt": text, **kw}).json()["tokens"]


def complete(server, **body) -> dict:
    r = httpx.post(server.url + "/v1/completions", json={"temperature": 0, "ignore_eos": True, **body}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def test_logit_bias_moves_greedy_tokens(server, client):
    prompt = [5, 6, 7, 8]
    base = complete(server, prompt=prompt, max_tokens=4, logprobs=0)
    first = ids_of(server, base["choices"][0]["logprobs"]["tokens"][0], parse_special=False)[0]
    banned = complete(server, prompt=prompt, max_tokens=4, logit_bias={str(first): -100})
    assert banned["choices"][0]["text"] != base["choices"][0]["text"]
    forced = complete(server, prompt=prompt, max_tokens=4, logit_bias={"42": 100}, logprobs=0)
    assert ids_of(server, forced["choices"][0]["text"], parse_special=False) == [42] * 4
    chat = client.chat.completions.create(model=client.models.list().data[0].id, temperature=0, max_tokens=3,
                                          messages=[{"role": "user", "content": "hi"}], logit_bias={"42": 100})
    assert ids_of(server, chat.choices[0].message.content, parse_special=False) == [42] * 3
    with pytest.raises(openai.BadRequestError, match="outside the vocabulary"):
        client.completions.create(model=client.models.list().data[0].id, prompt="hi",
                                  logit_bias={"999999": 1})


def test_completion_logprobs_always_carry_the_sampled_token(server):
    for n in (0, 2):
        lp = complete(server, prompt=[5, 6, 7], max_tokens=5, logprobs=n)["choices"][0]["logprobs"]
        assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) == 5
        for tok, val, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
            assert top[tok] == val and n <= len(top) <= n + 1  # the sampled token plus the top n
        assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(5)]


def test_echo_scores_the_prompt_as_generation_scored_it(server, client, tiny_qwen2):
    """Teacher-forced prompt scores equal the scores the same tokens got when they were generated."""
    prompt = [5, 6, 7, 8, 9]
    out = LLM(tiny_qwen2, **FP32).generate([prompt], SamplingParams(max_tokens=6, temperature=0, logprobs=0,
                                                                     ignore_eos=True), use_tqdm=False)[0]
    gen = complete(server, prompt=prompt, max_tokens=6, logprobs=0)["choices"][0]
    assert gen["text"] == out.text
    tokens = prompt + out.token_ids
    scored = complete(server, prompt=tokens, max_tokens=0, echo=True, logprobs=1)
    ch = scored["choices"][0]
    assert ch["finish_reason"] == "length" and scored["usage"]["completion_tokens"] == 0
    lp = ch["logprobs"]
    assert ch["text"] == httpx.post(server.url + "/detokenize", json={"tokens": tokens}).json()["prompt"]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None and len(lp["tokens"]) == len(tokens)
    for tok, want, got in zip(out.token_ids, out.logprobs, lp["token_logprobs"][len(prompt):]):
        assert math.isclose(want[tok], got, abs_tol=1e-4)
    # the openai client's view, and echo alongside generation
    r = client.completions.create(model=client.models.list().data[0].id, prompt=tokens, max_tokens=2, echo=True,
                                  logprobs=0, temperature=0)
    assert r.choices[0].text.startswith(ch["text"]) and len(r.choices[0].logprobs.tokens) == len(tokens) + 2


def test_echo_streams_the_prompt_first(server):
    body = {"prompt": [5, 6, 7], "max_tokens": 3, "echo": True, "stream": True, "temperature": 0}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    text = "".join(c["choices"][0]["text"] for c in chunks)
    full = complete(server, **{k: v for k, v in body.items() if k != "stream"})["choices"][0]["text"]
    assert text == full and chunks[0]["choices"][0]["text"].startswith(
        httpx.post(server.url + "/detokenize", json={"tokens": [5, 6, 7]}).json()["prompt"])


def test_prompt_logprobs_match_in_process_and_chunked(server, tiny_qwen2):
    prompt = list(range(5, 45))
    served = complete(server, prompt=prompt, max_tokens=1, prompt_logprobs=2)["choices"][0]["prompt_logprobs"]
    assert served[0] is None and len(served) == len(prompt)
    for tok, entry in zip(prompt[1:], served[1:]):
        assert str(tok) in entry and 2 <= len(entry) <= 3
        ranks = sorted(v["rank"] for v in entry.values() if v["rank"] is not None)
        assert ranks == [1, 2]
    whole = LLM(tiny_qwen2, **FP32)
    chunked = LLM(tiny_qwen2, **FP32, max_num_batched_tokens=16)  # 3 prefill chunks
    p = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0)
    a = whole.generate([prompt], p, use_tqdm=False)[0].prompt_logprobs
    whole.generate([prompt], p, use_tqdm=False)  # a second time: a prefix-cache hit would skip the scores
    b = chunked.generate([prompt], p, use_tqdm=False)[0].prompt_logprobs
    c = whole.generate([prompt], p, use_tqdm=False)[0].prompt_logprobs
    assert a[0] is None and len(a) == len(b) == len(c) == len(prompt)
    for x, y, z, tok, entry in zip(a[1:], b[1:], c[1:], prompt[1:], served[1:]):
        assert math.isclose(x[tok], y[tok], abs_tol=1e-4) and x == z
        assert math.isclose(x[tok], entry[str(tok)]["logprob"], abs_tol=1e-4)


def test_raw_prompts_parse_special_tokens(server, tiny_qwen2):
    chatml = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    special = ids_of(server, chatml)
    plain = ids_of(server, chatml, parse_special=False)
    im_start = ids_of(server, "<|im_start|>")
    assert len(im_start) == 1 and special.count(im_start[0]) == 2 and im_start[0] not in plain
    assert complete(server, prompt=chatml, max_tokens=1)["usage"]["prompt_tokens"] == len(special)
    assert complete(server, prompt=chatml, max_tokens=1, parse_special=False)["usage"]["prompt_tokens"] == len(plain)
    chat = httpx.post(server.url + "/tokenize", json={"messages": [{"role": "user", "content": "<|im_start|>"}]})
    assert chat.json()["tokens"].count(im_start[0]) == 2  # the template's own two: message content stays text
    llm = LLM(tiny_qwen2, **FP32)  # the Python API reads a raw prompt by the same rule
    assert llm.encode(chatml) == special and llm.encode(chatml, parse_special=False) == plain


def test_fill_in_the_middle_needs_a_model_with_fim_tokens(server):
    for path, body in (("/v1/completions", {"prompt": "def f(", "suffix": ")\n"}),
                       ("/infill", {"input_prefix": "def f(", "input_suffix": ")\n"})):
        r = httpx.post(server.url + path, json=body, timeout=60)
        assert r.status_code == 400 and "no fill-in-the-middle tokens" in r.json()["error"]["message"], r.text


def test_sse_events_stay_one_line():
    line = sse_data({"text": "a\u2028b\u2029c\x85d\ne"})
    assert line.count("\n") == 2 and len(line[:-2].splitlines()) == 1
    assert json.loads(line[6:])["text"] == "a\u2028b\u2029c\x85d\ne"
