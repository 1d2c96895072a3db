"""Anthropic's Messages API through the official `anthropic` SDK against `hetserve serve` (tiny
model): create and stream alike, count_tokens, tools with `any` / `tool` enforced and a tool
round trip, stop reasons, the clamp of max_tokens, prefix-cache reads in usage, x-api-key, and
Anthropic's error envelope."""

from __future__ import annotations

import anthropic
import httpx
import pytest
from test_server import Server

KEY = "sekret"
WEATHER = {"name": "get_weather", "description": "The weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                            "required": ["city"], "additionalProperties": False}}
TIME = {"name": "get_time", "input_schema": {"type": "object", "properties": {}}}
USER = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(tiny_qwen2):
    s = Server(tiny_qwen2, "--kv-cache-memory", "16MiB", "--api-key", KEY, "--page-size", "16")
    yield s
    assert s.stop() == 0


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0)


def create(client, temperature: float = 0.0, **kw):
    """The SDK no longer names sampling fields; the server reads them from the body (greedy here)."""
    kw.setdefault("model", "claude-code-default")  # any name: the server's model answers
    kw.setdefault("max_tokens", 12)
    kw.setdefault("messages", USER)
    kw["extra_body"] = {"temperature": temperature, **kw.get("extra_body", {})}
    return client.messages.create(**kw)


def stream(client, **kw):
    kw["extra_body"] = {"temperature": 0.0, **kw.get("extra_body", {})}
    return client.messages.stream(model="x", messages=USER, **kw)


def test_create_and_stream_give_the_same_message(client):
    m = create(client, system=[{"type": "text", "text": "Be brief."}], extra_body={"top_k": 5})
    assert m.type == "message" and m.role == "assistant" and m.model == "claude-code-default"
    assert m.id.startswith("msg_") and [b.type for b in m.content] == ["text"] and m.content[0].text
    assert m.stop_reason in ("end_turn", "max_tokens") and m.usage.output_tokens >= 1
    with stream(client, max_tokens=12, system=[{"type": "text", "text": "Be brief."}],
                extra_body={"top_k": 5}) as s:
        kinds = [e.type for e in s]
        final = s.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "content_block_delta" in kinds
    # The stream found the prompt's pages in the prefix cache, and a prompt's tail after a hit
    # runs other kernels than a whole prompt (on AMX: fp32 rows against a bf16 prefill), whose
    # roundings can turn the random test model's near-ties: compare with a create that hits too.
    m = create(client, system=[{"type": "text", "text": "Be brief."}], extra_body={"top_k": 5})
    assert m.usage.cache_read_input_tokens == final.usage.cache_read_input_tokens > 0
    assert final.content[0].text == m.content[0].text and final.stop_reason == m.stop_reason
    assert final.usage.output_tokens == m.usage.output_tokens


def test_count_tokens_and_cached_prefix_reads(client):
    long = [{"role": "user", "content": "Tell me about the weather. " * 20}]
    n = client.messages.count_tokens(model="x", messages=long).input_tokens
    first = create(client, messages=long, max_tokens=2)
    again = create(client, messages=long, max_tokens=2)
    assert first.usage.input_tokens + first.usage.cache_read_input_tokens == n
    assert again.usage.cache_read_input_tokens >= 16 and again.usage.input_tokens + \
        again.usage.cache_read_input_tokens == n
    with_tools = client.messages.count_tokens(model="x", messages=long, tools=[WEATHER]).input_tokens
    assert with_tools >= n


def test_max_tokens_is_clamped_to_the_context_left(client):
    """Claude Code asks 32000 of a model whose context is far smaller: the answer runs to the
    context's end (EOS ignored here) and says max_tokens."""
    n = client.messages.count_tokens(model="x", messages=USER).input_tokens
    with stream(client, max_tokens=32000, extra_body={"ignore_eos": True}) as s:
        m = s.get_final_message()
    assert m.stop_reason == "max_tokens" and m.usage.output_tokens == 512 - n


def test_stop_sequences_end_the_message(client):
    text = create(client, max_tokens=16).content[0].text
    stop = text.strip()[2:5]
    m = create(client, max_tokens=16, stop_sequences=[stop])
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == stop
    assert m.content[0].text == text[: text.index(stop)]


@pytest.mark.parametrize("choice", [{"type": "any"}, {"type": "tool", "name": "get_weather"},
                                    {"type": "any", "disable_parallel_tool_use": True}])
def test_any_and_tool_are_enforced(client, choice):
    m = create(client, tools=[WEATHER, TIME], tool_choice=choice, max_tokens=200)
    uses = [b for b in m.content if b.type == "tool_use"]
    # Parallel calls may go on to the limit (the cut one is dropped); a lone call ends by itself
    single = choice.get("disable_parallel_tool_use", False)
    assert uses and m.stop_reason in (("tool_use",) if single else ("tool_use", "max_tokens")), m.content
    assert all(u.id.startswith("toolu_") and u.name in ("get_weather", "get_time") for u in uses)
    if choice["type"] == "tool":
        assert {u.name for u in uses} == {"get_weather"} and isinstance(uses[0].input["city"], str)
    if single:
        assert len(uses) == 1
    with stream(client, max_tokens=200, tools=[WEATHER, TIME], tool_choice=choice) as s:
        final = s.get_final_message()
    assert [(b.type, getattr(b, "name", None), getattr(b, "input", None)) for b in final.content] == \
        [(b.type, getattr(b, "name", None), getattr(b, "input", None)) for b in m.content]
    # The round trip: the call and its result in the history, none offered now
    follow = create(client, tools=[WEATHER], tool_choice={"type": "none"}, messages=USER + [
        {"role": "assistant", "content": [{"type": "tool_use", "id": uses[0].id, "name": uses[0].name,
                                           "input": uses[0].input}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id,
                                      "content": [{"type": "text", "text": "18 C, sunny"}]}]}])
    assert follow.stop_reason in ("end_turn", "max_tokens") and all(b.type == "text" for b in follow.content)


def test_claude_codes_request_shape(client):
    """As Claude Code 2.1 sends a turn: a system turn among the messages, system blocks with
    cache_control, adaptive thinking, output_config, context_management."""
    m = create(client, system=[{"type": "text", "text": "You are a coding agent.", "cache_control": {"type": "ephemeral"}}],
               messages=[{"role": "user", "content": [{"type": "text", "text": "<system-reminder>ctx</system-reminder>"},
                                                      {"type": "text", "text": "What is 2 + 2?"}]},
                         {"role": "system", "content": [{"type": "text", "text": "Be brief."}]}],
               tools=[WEATHER], extra_body={"thinking": {"type": "adaptive"}, "output_config": {"effort": "high"},
                                            "context_management": {"edits": [{"type": "clear_thinking_20251015"}]}})
    assert m.type == "message" and m.stop_reason in ("end_turn", "max_tokens", "tool_use")


def test_server_tools_and_unknown_fields_are_ignored(client):
    m = create(client, tools=[WEATHER, {"type": "web_search_20250305", "name": "web_search", "max_uses": 2}],
               metadata={"user_id": "u"}, extra_body={"thinking": {"type": "enabled", "budget_tokens": 1024},
                                                      "context_management": {"edits": []}},
               extra_headers={"anthropic-beta": "interleaved-thinking-2025-05-14"})
    assert m.type == "message"


def test_errors_have_anthropics_envelope(server, client):
    with pytest.raises(anthropic.BadRequestError) as e:
        create(client, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}]}])
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "invalid_request_error"
    assert "image" in e.value.body["error"]["message"]
    r = httpx.post(server.url + "/v1/messages?beta=true", headers={"x-api-key": KEY}, json={"messages": USER})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"  # max_tokens required
    assert "max_tokens" in r.json()["error"]["message"]
    with pytest.raises(anthropic.AuthenticationError) as e:
        anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0).messages.create(
            model="x", max_tokens=2, messages=USER)
    assert e.value.body["error"]["type"] == "authentication_error"
    bearer = httpx.post(server.url + "/v1/messages", headers={"Authorization": f"Bearer {KEY}"},
                        json={"model": "x", "max_tokens": 2, "messages": USER}, timeout=60)
    assert bearer.status_code == 200  # either header carries the key
    assert server.metric("hetserve:kv_pages_used", headers={"x-api-key": KEY}) == 0
