"""Anthropic's Messages API (`POST /v1/messages`, `POST /v1/messages/count_tokens`), the API
Claude Code and the `anthropic` SDK speak.

A request becomes the chat the model's template renders: `system` (a string or text blocks) the
system message, text blocks the message text, `tool_use` blocks an assistant's tool calls and
`tool_result` blocks tool messages; `tools` (`input_schema`) and `tool_choice` (`auto`, `any`,
`tool`, `none`, `disable_parallel_tool_use`) go through the same tool-call grammar and parser as
chat completions (tool_calls.py), so `any` and `tool` are enforced. The answer is text and
`tool_use` blocks with Anthropic's stop reasons and usage (`cache_read_input_tokens` from the
prefix cache), streamed as its events or not; errors have its envelope (http_errors.py).
`max_tokens` is clamped to the context the prompt leaves (stop reason `max_tokens` there).
Fields a local server cannot honour (`thinking`, `metadata`, `cache_control`,
`context_management`, server tools such as `web_search`) are accepted and ignored, as
llama.cpp's server does; image and document blocks get a 400.
"""

from __future__ import annotations

import contextlib
import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse
from pydantic import Field

from ..sampling_params import SamplingParams
from . import tool_calls
from .frontend import Delta, Frontend
from .http_errors import APIError, anthropic_error_body
from .protocol import MAX_MESSAGES, _Body
from .streaming import EngineRequest, admit, collect, encode_chat, events, tool_constraint


class MessagesRequest(_Body):
    model: str | None = None
    messages: list[dict[str, Any]] = Field(max_length=MAX_MESSAGES)
    system: str | list[dict[str, Any]] | None = None
    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(None, ge=0.0, le=1.0)
    top_p: float | None = None
    top_k: int | None = None
    stream: bool = False
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    ignore_eos: bool = False  # vLLM's, as the other routes take it


class CountTokensRequest(_Body):
    model: str | None = None
    messages: list[dict[str, Any]] = Field(max_length=MAX_MESSAGES)
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None


def _text(content: Any, at: str) -> str:
    """The text of a content value: a string, or blocks of which text ones count (thinking blocks
    are skipped; images and documents are refused)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"{at}: content must be a string or a list of content blocks", at)
    texts = []
    for i, b in enumerate(content):
        kind = b.get("type") if isinstance(b, dict) else None
        if kind == "text" and isinstance(b.get("text"), str):
            texts.append(b["text"])
        elif kind in ("image", "document", "search_result"):
            raise APIError(400, f"{at}[{i}]: {kind} blocks are not supported (text only)", at)
        elif kind not in ("thinking", "redacted_thinking"):
            raise APIError(400, f"{at}[{i}]: a content block of type {kind!r} is not supported here", at)
    return "".join(texts)


def chat_messages(system: Any, messages: list[dict]) -> list[dict]:
    """Anthropic's system and messages as the chat the template renders (OpenAI's roles)."""
    out = [{"role": "system", "content": _text(system, "system")}] if system else []
    for i, m in enumerate(messages):
        at = f"messages[{i}]"
        role, content = (m.get("role"), m.get("content")) if isinstance(m, dict) else (None, None)
        if role not in ("user", "assistant", "system"):  # Claude Code sends system turns among them
            raise APIError(400, f"{at}.role must be user, assistant or system", at)
        blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content
        if not isinstance(blocks, list):
            raise APIError(400, f"{at}.content must be a string or a list of content blocks", at)
        texts, calls = [], []
        for j, b in enumerate(blocks):
            kind = b.get("type") if isinstance(b, dict) else None
            where = f"{at}.content[{j}]"
            if kind == "tool_result" and role == "user":
                if not isinstance(b.get("tool_use_id"), str):
                    raise APIError(400, f"{where}.tool_use_id must be a string", where)
                result = _text(b.get("content", ""), where + ".content")
                out.append({"role": "tool", "tool_call_id": b["tool_use_id"],
                            "content": ("Error: " if b.get("is_error") else "") + result})
            elif kind == "tool_use" and role == "assistant":
                if not isinstance(b.get("name"), str) or not isinstance(b.get("input", {}), dict):
                    raise APIError(400, f"{where}: a tool_use block needs a name and an input object", where)
                calls.append({"id": b.get("id", ""), "type": "function",
                              "function": {"name": b["name"], "arguments": b.get("input", {})}})
            else:
                texts.append(_text([b], where))
        if texts or calls or not blocks:
            msg = {"role": role, "content": "".join(texts)}
            if calls:
                msg["tool_calls"] = calls
            out.append(msg)
    return out


def parse_tools(tools: list[dict] | None, tool_choice: dict | None) -> tool_calls.Tools | None:
    """Anthropic's tools and tool_choice through the chat completions' tool machinery. Tools a
    local server cannot run (server tools: web search, code execution, ...) are left out."""
    fns = [{"type": "function", "function": {"name": t.get("name"), "description": t.get("description", ""),
                                             "parameters": t.get("input_schema") or {"type": "object"}}}
           for t in tools or [] if isinstance(t, dict) and t.get("type", "custom") == "custom"]
    choice = tool_choice or {"type": "auto"}
    kind = choice.get("type")
    mapped = {"auto": "auto", "any": "required", "none": "none"}.get(kind)
    if kind == "tool":
        mapped = {"type": "function", "function": {"name": choice.get("name")}}
    if mapped is None:
        raise APIError(400, "tool_choice.type must be auto, any, tool or none", "tool_choice")
    if not fns:
        return None
    try:
        return tool_calls.Tools.parse(fns, mapped, not choice.get("disable_parallel_tool_use", False))
    except tool_calls.ToolError as e:
        raise APIError(400, str(e), "tools") from None


def _stop_reason(d: Delta, called: bool) -> tuple[str, str | None]:
    if d.finish_reason == "length":
        return "max_tokens", None
    if called:
        return "tool_use", None
    if d.stopped_by is not None:
        return "stop_sequence", d.stopped_by
    return "end_turn", None


def _tool_use(call: dict) -> dict:
    return {"type": "tool_use", "id": "toolu_" + call["id"].removeprefix("call_"), "name": call["function"]["name"],
            "input": json.loads(call["function"]["arguments"])}


def _event(kind: str, body: dict) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **body}, ensure_ascii=False)}\n\n"


def add_anthropic_routes(app: FastAPI, fe: Frontend) -> None:
    """The routes. Any `model` is served by this server's model (Claude Code names Anthropic's);
    the answer names the one asked for."""
    async def prompt(request: Request, system, messages, tools: tool_calls.Tools | None) -> list[int]:
        msgs = chat_messages(system, messages)
        if not msgs:
            raise APIError(400, "messages must not be empty", "messages")
        return await encode_chat(request, fe, msgs, tools)

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(body: CountTokensRequest, request: Request):
        tools = parse_tools(body.tools, body.tool_choice)
        return {"input_tokens": len(await prompt(request, body.system, body.messages, tools))}

    @app.post("/v1/messages")
    async def messages(body: MessagesRequest, request: Request):
        tools = parse_tools(body.tools, body.tool_choice)
        ids = await prompt(request, body.system, body.messages, tools)
        params = SamplingParams(
            max_tokens=max(1, min(body.max_tokens, fe.max_model_len - len(ids))),  # clamped to what is left
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p, top_k=body.top_k or 0,
            stop=body.stop_sequences or [], ignore_eos=body.ignore_eos, structured=tool_constraint(fe, tools))
        req = admit(fe, EngineRequest(ids, params, tools))
        mid = "msg_" + uuid.uuid4().hex

        def usage(last: Delta | None, out_tokens: int) -> dict:
            cached = last.num_cached_tokens if last else 0
            return {"input_tokens": len(ids) - cached, "output_tokens": out_tokens,
                    "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}

        def message(content: list, stop: tuple[str | None, str | None], u: dict) -> dict:
            return {"id": mid, "type": "message", "role": "assistant", "model": body.model or fe.model_name,
                    "content": content, "stop_reason": stop[0], "stop_sequence": stop[1], "usage": u}

        if body.stream:
            return StreamingResponse(_stream(fe, req, message, usage), media_type="text/event-stream")
        out = await collect(request, fe, req)
        content = ([{"type": "text", "text": out.text}] if out.text else []) + [_tool_use(c) for c in out.calls]
        return message(content, _stop_reason(out.last, bool(out.calls)), usage(out.last, out.num_tokens))


async def _stream(fe: Frontend, req: EngineRequest, message, usage) -> AsyncIterator[str]:
    """Anthropic's event sequence: message_start, ping, per block content_block_start /
    content_block_delta (text_delta, input_json_delta) / content_block_stop, message_delta (stop
    reason, usage), message_stop; a failure after the headers is an `error` event."""
    yield _event("message_start", {"message": message([], (None, None), usage(None, 0))})
    yield _event("ping", {})
    index, text_open, n, called, last = 0, False, 0, 0, None
    try:
        async with contextlib.aclosing(events(fe, req)) as stream:  # a client gone stops the work now
            async for ev in stream:
                n, last = n + len(ev.delta.token_ids), ev.delta
                if ev.text:
                    if not text_open:
                        text_open = True
                        yield _event("content_block_start",
                                     {"index": index, "content_block": {"type": "text", "text": ""}})
                    yield _event("content_block_delta",
                                 {"index": index, "delta": {"type": "text_delta", "text": ev.text}})
                for call in ev.calls:
                    if text_open:
                        yield _event("content_block_stop", {"index": index})
                        index, text_open = index + 1, False
                    block = _tool_use(call)
                    yield _event("content_block_start", {"index": index, "content_block": {**block, "input": {}}})
                    yield _event("content_block_delta", {"index": index, "delta": {
                        "type": "input_json_delta", "partial_json": json.dumps(block["input"], ensure_ascii=False)}})
                    yield _event("content_block_stop", {"index": index})
                    index, called = index + 1, called + 1
    except APIError as e:  # the headers are sent: the failure is the stream's last event
        yield f"event: error\ndata: {json.dumps(anthropic_error_body(e.status, e.message))}\n\n"
        return
    if text_open:
        yield _event("content_block_stop", {"index": index})
    reason, seq = _stop_reason(last, bool(called))
    yield _event("message_delta", {"delta": {"stop_reason": reason, "stop_sequence": seq}, "usage": usage(last, n)})
    yield _event("message_stop", {})
