"""Structured outputs and tool calls on the real Qwen2.5-Coder-0.5B: outputs validate (jsonschema),
batching leaves greedy tokens alone, and the official openai client's parse and tool-call round
trips work, streaming and not."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field
from test_server import Server, model_id

from hetserve import LLM, SamplingParams
from hetserve.bench.structured import SCHEMA  # nested objects, an array, an enum, a pattern
from hetserve.structured import StructuredOutputs

pytestmark = pytest.mark.real_model

PHONE = r"\([0-9]{3}\) [0-9]{3}-[0-9]{4}"
CHOICES = ["positive", "negative", "neutral"]


@pytest.fixture(scope="module")
def llm(real_05b) -> LLM:
    return LLM(model=real_05b, kv_cache_memory="256MiB", deterministic=True)


def chat(llm: LLM, text: str) -> list[int]:
    return llm.tokenizer.encode_chat([{"role": "user", "content": text}])


def twenty(llm, prompt: str, spec: StructuredOutputs, max_tokens: int) -> list[str]:
    params = [SamplingParams(max_tokens=max_tokens, temperature=0.8, seed=i, structured=spec) for i in range(20)]
    outs = llm.generate([chat(llm, prompt)] * 20, params, use_tqdm=False)
    assert all(o.finish_reason == "stop" for o in outs), [o.text for o in outs if o.finish_reason != "stop"]
    return [o.text for o in outs]


def test_twenty_generations_validate_against_a_nested_schema(llm):
    for text in twenty(llm, "Invent an employee record as JSON.", StructuredOutputs.json_schema(SCHEMA), 160):
        jsonschema.validate(json.loads(text), SCHEMA)


def test_twenty_generations_match_a_regex_and_a_choice(llm):
    for text in twenty(llm, "Write a US phone number.", StructuredOutputs("regex", PHONE), 20):
        assert re.fullmatch(PHONE, text), text
    for text in twenty(llm, "Sentiment of: 'I love this editor!'", StructuredOutputs.choice(CHOICES), 8):
        assert text in CHOICES


def test_greedy_constrained_alone_equals_inside_an_unconstrained_batch(llm):
    spec = StructuredOutputs.json_schema(SCHEMA)
    greedy = SamplingParams(max_tokens=160, temperature=0.0, structured=spec)
    prompt = chat(llm, "Invent an employee record as JSON.")
    alone = llm.generate([prompt], greedy, use_tqdm=False)[0]
    others = [chat(llm, f"Write a Python function number {i}.") for i in range(5)]
    plain = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    ref = [o.token_ids for o in llm.generate(others, plain, use_tqdm=False)]
    mixed = llm.generate([others[0], prompt, *others[1:]], [plain, greedy] + [plain] * 4, use_tqdm=False)
    assert mixed[1].token_ids == alone.token_ids
    jsonschema.validate(json.loads(mixed[1].text), SCHEMA)
    assert [mixed[0].token_ids] + [o.token_ids for o in mixed[2:]] == ref


def test_the_templates_renders_tool_calls_and_results(llm):
    msgs = [{"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": "call_1", "type": "function",
                 "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 18}'}]
    out = llm.tokenizer.apply_chat_template(msgs, tools=[WEATHER])
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in out
    assert '<tool_response>\n{"temp": 18}\n</tool_response>' in out and '"name": "get_weather"' in out


# -- the server, through the official client ----------------------------------------------------
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city"]}}}


class Person(BaseModel):
    name: str = Field(max_length=40)
    age: int
    city: str = Field(max_length=40)


@pytest.fixture(scope="module")
def client(real_05b):
    s = Server(real_05b, "--kv-cache-memory", "256MiB")
    try:
        yield openai.OpenAI(base_url=s.url + "/v1", api_key="unused")
    finally:
        s.stop()


def test_openai_parse_with_a_pydantic_model(client):
    r = client.chat.completions.parse(model=model_id(client), response_format=Person, temperature=0, max_tokens=80,
                                      messages=[{"role": "user", "content": "Describe a fictional programmer."}])
    assert isinstance(r.choices[0].message.parsed, Person) and r.choices[0].finish_reason == "stop"
    r = client.chat.completions.create(model=model_id(client), response_format={"type": "json_object"},
                                       temperature=0, max_tokens=80,
                                       messages=[{"role": "user", "content": "A JSON object about a cat."}])
    assert isinstance(json.loads(r.choices[0].message.content), dict)


def _streamed(client, **kw) -> tuple[str, list[dict], str]:
    content, calls, finish = [], {}, None
    for chunk in client.chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            content.append(c.delta.content or "")
            for tc in c.delta.tool_calls or []:
                slot = calls.setdefault(tc.index, {"id": tc.id, "name": "", "arguments": ""})
                slot["name"] += tc.function.name or ""
                slot["arguments"] += tc.function.arguments or ""
            finish = c.finish_reason or finish
    return "".join(content), [calls[i] for i in sorted(calls)], finish


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_a_tool_call_round_trip(client, choice):
    mid = model_id(client)
    msgs = [{"role": "user", "content": "What is the weather like in Paris right now?"}]
    kw = dict(model=mid, messages=msgs, tools=[WEATHER], tool_choice=choice, temperature=0, max_tokens=60,
              parallel_tool_calls=False)
    r = client.chat.completions.create(**kw)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and len(msg.tool_calls) == 1
    call = msg.tool_calls[0]
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, WEATHER["function"]["parameters"])
    content, calls, finish = _streamed(client, **kw)
    assert finish == "tool_calls" and [(c["name"], json.loads(c["arguments"])) for c in calls] == [
        ("get_weather", args)] and not content.strip()
    msgs += [msg.model_dump(exclude_none=True),
             {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 18, "unit": "celsius"})}]
    final = client.chat.completions.create(model=mid, messages=msgs, tools=[WEATHER], tool_choice="none",
                                           temperature=0, max_tokens=40)
    assert final.choices[0].message.content and final.choices[0].message.tool_calls in (None, [])


def test_calls_cut_by_max_tokens_keep_the_complete_ones(client):
    """`required` with parallel calls: the 0.5B opens call after call until max_tokens. The
    complete calls come back, the cut one is dropped (not content), finish_reason is length."""
    kw = dict(model=model_id(client), tools=[WEATHER], tool_choice="required", temperature=0, max_tokens=48,
              messages=[{"role": "user", "content": "Weather in Tokyo, London, Paris, Rome and Oslo?"}])
    r = client.chat.completions.create(**kw)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "length" and msg.tool_calls and not msg.content, msg
    whole = [(c.function.name, json.loads(c.function.arguments)) for c in msg.tool_calls]
    content, calls, finish = _streamed(client, **kw)
    assert finish == "length" and not content.strip()
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == whole


def test_auto_may_answer_in_text_or_call(client):
    r = client.chat.completions.create(model=model_id(client), tools=[WEATHER], temperature=0, max_tokens=40,
                                       messages=[{"role": "user", "content": "Say hello in French."}])
    assert r.choices[0].finish_reason in ("stop", "length") and r.choices[0].message.content
