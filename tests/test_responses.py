"""`POST /v1/responses` (OpenAI's Responses API) end to end with the official openai client, and its store."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
import uuid

import httpx
import openai
import pytest
from test_server import Server, worker_pid

from hetserve.serving.responses import ResponseStore


@pytest.fixture(scope="module")
def server(tiny_qwen2):
    s = Server(tiny_qwen2, "--kv-cache-memory", "16MiB", "--max-num-seqs", "8")
    yield s
    assert s.stop() == 0


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused")


@pytest.fixture(scope="module")
def model(client) -> str:
    return client.models.list().data[0].id


def cold() -> dict:
    """A fresh cache salt: no prefix-cache hits, whose last-bit differences can flip the random tiny
    model's near-tied greedy choices, so that the routes' outputs compare exactly."""
    return {"cache_salt": uuid.uuid4().hex}


def chat(client, model, messages, max_tokens=6) -> str:
    """The chat route's greedy answer: what the Responses route must give for the same conversation."""
    r = client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens, temperature=0,
                                       extra_body=cold())
    return r.choices[0].message.content


def prompt_len(server, messages) -> int:
    return httpx.post(server.url + "/tokenize", json={"messages": messages}).json()["count"]


def test_text_input(server, client, model):
    r = client.responses.create(model=model, input="def add(a, b):", max_output_tokens=6, temperature=0,
                                extra_body=cold())
    assert r.object == "response" and r.id.startswith("resp_") and r.status in ("completed", "incomplete")
    msg = r.output[0]
    assert msg.type == "message" and msg.role == "assistant" and msg.id.startswith("msg_")
    assert msg.content[0].type == "output_text" and r.output_text == msg.content[0].text
    messages = [{"role": "user", "content": "def add(a, b):"}]
    assert r.output_text == chat(client, model, messages)
    assert r.usage.input_tokens == prompt_len(server, messages)
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.tools == [] and r.text.format.type == "text" and r.error is None


def test_message_list_and_instructions(server, client, model):
    items = [{"role": "user", "content": [{"type": "input_text", "text": "Hello, "}, {"type": "input_text",
                                                                                      "text": "world"}]},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hi!"}]},
             {"type": "message", "role": "user", "content": "How are you today?"}]
    r = client.responses.create(model=model, input=items, instructions="Answer in code.", max_output_tokens=6,
                                temperature=0, extra_body=cold())
    messages = [{"role": "system", "content": "Answer in code."}, {"role": "user", "content": "Hello, world"},
                {"role": "assistant", "content": "Hi!"}, {"role": "user", "content": "How are you today?"}]
    assert r.output_text == chat(client, model, messages)
    assert r.usage.input_tokens == prompt_len(server, messages)
    assert r.instructions == "Answer in code."


def test_max_output_tokens_is_incomplete(client, model):
    r = client.responses.create(model=model, input="The quick brown fox", max_output_tokens=1, temperature=0)
    assert r.usage.output_tokens == 1
    if r.status == "incomplete":  # unless the one token was the end of turn
        assert r.incomplete_details.reason == "max_output_tokens" and r.output[0].status == "incomplete"
    r = client.responses.create(model=model, input="x", max_output_tokens=3, temperature=0)
    assert r.status == "incomplete" or r.usage.output_tokens < 3


def test_streaming_events(client, model):
    kw = dict(model=model, input="Once upon a time", instructions="Tell a story.", max_output_tokens=8,
              temperature=0)
    plain = client.responses.create(**kw, extra_body=cold())
    events = list(client.responses.create(stream=True, **kw, extra_body=cold()))
    kinds = [e.type for e in events]
    final = "response." + plain.status
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", *["response.output_text.delta"] * len(deltas),
                     "response.output_text.done", "response.content_part.done", "response.output_item.done", final]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].response.status == "in_progress" and events[0].response.id == events[-1].response.id
    assert "".join(e.delta for e in deltas) == plain.output_text == events[-4].text
    assert events[-1].response.output_text == plain.output_text
    assert events[-1].response.usage.output_tokens == plain.usage.output_tokens
    # A streamed response is stored like any other.
    assert client.responses.retrieve(events[-1].response.id).output_text == plain.output_text


def test_previous_response_id(client, model):
    first = client.responses.create(model=model, input="Hello", instructions="Be brief.", max_output_tokens=5,
                                    temperature=0, extra_body=cold())
    second = client.responses.create(model=model, input="And then?", previous_response_id=first.id,
                                     max_output_tokens=5, temperature=0, extra_body=cold())
    assert second.previous_response_id == first.id
    # The earlier turns continue, the earlier instructions do not (as OpenAI does).
    assert second.output_text == chat(client, model, [
        {"role": "user", "content": "Hello"}, {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "And then?"}], max_tokens=5)
    third = client.responses.create(model=model, input="More", previous_response_id=second.id,
                                    instructions="Be long.", max_output_tokens=5, temperature=0,
                                    extra_body=cold())
    assert third.output_text == chat(client, model, [
        {"role": "system", "content": "Be long."}, {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": first.output_text}, {"role": "user", "content": "And then?"},
        {"role": "assistant", "content": second.output_text}, {"role": "user", "content": "More"}], max_tokens=5)
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.create(model=model, input="x", previous_response_id="resp_nope", max_output_tokens=2)
    assert e.value.body["param"] == "previous_response_id"


def test_get_delete_and_store_false(client, model):
    r = client.responses.create(model=model, input="hi", max_output_tokens=3, metadata={"k": "v"})
    got = client.responses.retrieve(r.id)
    assert got.id == r.id and got.output_text == r.output_text and got.metadata == {"k": "v"}
    client.responses.delete(r.id)
    for call in (lambda: client.responses.retrieve(r.id), lambda: client.responses.delete(r.id)):
        with pytest.raises(openai.NotFoundError):
            call()
    unstored = client.responses.create(model=model, input="hi", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=model, input="x", previous_response_id=unstored.id, max_output_tokens=2)


def test_refused(server, client, model):
    bad = [dict(tool_choice="required"), dict(tools=[{"type": "function", "name": "bad name"}]),
           dict(tools=[{"type": "web_search"}], tool_choice={"type": "function", "name": "f"}),
           dict(text={"format": {"type": "json_object"}}),
           dict(input=[{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]),
           dict(input=[{"type": "computer_call", "call_id": "c"}]),
           dict(input=[{"type": "function_call", "call_id": "c", "name": "f"}]),  # no arguments
           dict(max_output_tokens=0), dict(input=[])]
    for extra in bad:
        with pytest.raises(openai.BadRequestError):
            client.responses.create(**{"model": model, "input": "hi", **extra})
    # A lone surrogate (the client cannot send one: raw JSON).
    r = httpx.post(server.url + "/v1/responses", content=b'{"input": "\\ud800"}',
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and "surrogate" in r.json()["error"]["message"]
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="no-such-model", input="hi")
    with pytest.raises(openai.BadRequestError) as e:  # the context limit, as the other routes check it
        client.responses.create(model=model, input="hi", max_output_tokens=10**6)
    assert "max" in e.value.message.lower() or "context" in e.value.message.lower()


def test_store_bounds():
    def resp(rid: str, text: str = "") -> dict:
        return {"id": rid, "output_text": text}

    by_count = ResponseStore(max_responses=2, max_chars=10**6)
    for rid in ("a", "b", "c"):
        by_count.put(resp(rid), [{"role": "user", "content": "x"}])
    assert "a" not in by_count and "b" in by_count and "c" in by_count
    by_count.get("b")  # now the most recently used: "c" goes next
    by_count.put(resp("d"), [])
    assert set(by_count._items) == {"b", "d"}

    one = ResponseStore()
    one.put(resp("x"), [{"role": "user", "content": "y" * 1000}])
    size = one.chars
    by_size = ResponseStore(max_responses=100, max_chars=2 * size + size // 2)
    for rid in ("x", "z", "w"):  # same sizes: room for two
        by_size.put(resp(rid), [{"role": "user", "content": "y" * 1000}])
    assert set(by_size._items) == {"z", "w"} and by_size.chars == 2 * size
    by_size.put(resp("big"), [{"role": "user", "content": "y" * 10 * size}])  # larger than the store: not kept
    assert "big" not in by_size and len(by_size) == 2
    assert by_size.delete("z") and not by_size.delete("z") and by_size.chars == size


def test_disconnecting_clients_cancel(server):
    """A client that leaves, streaming or not, stops its generation at once: each asks for 480 tokens (the tiny
    model writes them in about a quarter of a second) and far fewer are made. The plain client leaves as soon as
    its request runs, not after a fixed timeout that a fast machine could outrun."""
    body = {"input": "go on and on", "max_output_tokens": 480, "ignore_eos": True, "temperature": 0}

    def tokens_made() -> float:
        return server.metric("hetserve:inter_token_latency_seconds_count")

    async def streamed(client):
        async with client.stream("POST", server.url + "/v1/responses", json={**body, "stream": True}) as r:
            async for line in r.aiter_lines():
                if line.startswith("event: response.output_text.delta"):
                    return

    async def plain(client):
        task = asyncio.ensure_future(client.post(server.url + "/v1/responses", json=body))
        while not task.done() and await asyncio.to_thread(server.metric, "hetserve:num_requests_running") == 0:
            await asyncio.sleep(0.002)
        assert not task.done(), task.result().text
        task.cancel()  # closes the connection
        with pytest.raises(asyncio.CancelledError):
            await task

    for leave in (streamed, plain):
        before = tokens_made()

        async def main():
            async with httpx.AsyncClient(timeout=120) as client:
                await leave(client)

        asyncio.run(main())
        deadline = time.monotonic() + 60  # only an upper bound: the abort lands within a step or two
        while server.metric("hetserve:num_requests_running") != 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert server.metric("hetserve:num_requests_running") == 0 and server.metric("hetserve:kv_pages_used") == 0
        # Of 480: the tokens made while the abort travels (8 at most seen on a loaded 2-core host) are the
        # worker's steps over the frontend's reaction, both CPU work of the same machine: not a speed bar
        assert tokens_made() - before < 240, leave.__name__


def test_strict_openai_types(server, model):
    """The client builds its models without validating them; here the bodies pass pydantic's strict check."""
    from openai.types.responses import Response, ResponseStreamEvent
    from pydantic import TypeAdapter

    body = {"model": model, "input": "hi", "max_output_tokens": 3, "metadata": {"a": "b"}}
    r = httpx.post(server.url + "/v1/responses", json=body, timeout=60)
    assert Response.model_validate(r.json()).output_text == r.json()["output"][0]["content"][0]["text"]
    events = TypeAdapter(ResponseStreamEvent)
    with httpx.stream("POST", server.url + "/v1/responses", json={**body, "stream": True}, timeout=60) as r:
        lines = [x for x in r.iter_lines() if x]
    for kind, data in zip(lines[::2], lines[1::2]):
        assert events.validate_json(data.removeprefix("data: ")).type == kind.removeprefix("event: ")
    assert len(lines) >= 18 and lines[-2] in ("event: response.completed", "event: response.incomplete")


def test_worker_death_mid_stream_fails_the_response(tiny_qwen2):
    from openai.types.responses import ResponseStreamEvent
    from pydantic import TypeAdapter

    s = Server(tiny_qwen2, "--kv-cache-memory", "8MiB")
    try:
        body = {"input": "long", "max_output_tokens": 400, "ignore_eos": True, "stream": True}
        kinds = []
        with httpx.stream("POST", s.url + "/v1/responses", json=body, timeout=120) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("event: "):
                    kinds.append(line.removeprefix("event: "))
                    # As soon as the stream is open: the tiny model's 400 tokens can all be out
                    # before a client on a loaded machine has read its first delta.
                    if kinds[-1] == "response.created":
                        os.kill(worker_pid(s, "cpu"), signal.SIGKILL)
                elif line.startswith("data: "):
                    last = TypeAdapter(ResponseStreamEvent).validate_json(line.removeprefix("data: "))
        assert kinds[-1] == "response.failed" and "response.completed" not in kinds
        assert last.response.status == "failed" and "died" in last.response.error.message
        assert last.response.error.code == "server_error"
    finally:
        s.stop()


WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                          "required": ["city"], "additionalProperties": False}}
HOSTED = [{"type": "web_search"}, {"type": "namespace", "name": "mcp", "tools": []}]  # Codex sends these


def test_function_tools_streamed_and_not_and_a_round_trip(client, model):
    kw = dict(model=model, input=[{"role": "developer", "content": "Use tools."},
                                  {"role": "user", "content": "Weather in Oslo?"}],
              tools=[WEATHER, *HOSTED], tool_choice="required", parallel_tool_calls=False, max_output_tokens=80,
              temperature=0, reasoning={"effort": "low"}, extra_body=cold())
    r = client.responses.create(**kw)
    calls = [o for o in r.output if o.type == "function_call"]
    assert r.status == "completed" and len(calls) == 1 and calls[0].name == "get_weather"
    assert calls[0].call_id.startswith("call_") and isinstance(json.loads(calls[0].arguments)["city"], str)
    assert r.tools and r.tool_choice == "required"
    events = list(client.responses.create(stream=True, **kw))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    i = kinds.index("response.function_call_arguments.delta")
    assert kinds[i - 1:i + 3] == ["response.output_item.added", "response.function_call_arguments.delta",
                                  "response.function_call_arguments.done", "response.output_item.done"]
    done = events[-1].response
    assert [(o.type, o.name, o.arguments) for o in done.output] == [("function_call", calls[0].name,
                                                                     calls[0].arguments)]
    # The call and its output go back as input items; a stored response continues with them too
    follow = client.responses.create(model=model, max_output_tokens=6, temperature=0, tools=[WEATHER], input=[
        *kw["input"], {"type": "function_call", "call_id": calls[0].call_id, "name": "get_weather",
                       "arguments": calls[0].arguments},
        {"type": "function_call_output", "call_id": calls[0].call_id, "output": "18 C"},
        {"type": "reasoning", "id": "rs_1", "summary": []}], tool_choice="none")
    assert follow.output[0].type == "message"
    stored = client.responses.create(model=model, previous_response_id=r.id, max_output_tokens=4, input=[
        {"type": "function_call_output", "call_id": calls[0].call_id, "output": "18 C"}])
    assert stored.status in ("completed", "incomplete")
