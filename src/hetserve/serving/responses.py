"""OpenAI's Responses API (`POST /v1/responses`, `GET` and `DELETE /v1/responses/{id}`): text and
function tools, as Codex CLI uses it.

A response is one assistant turn generated from the chat-templated conversation: the new
`instructions` (a leading system message), the stored conversation of `previous_response_id`
(its input and output; not its instructions, as OpenAI does) and the new `input` items. Function
tools go through the chat completions' tool grammar and parser (tool_calls.py); the turn's text
is a message item and each call a function_call item. Responses are kept in a bounded in-memory
store so that later requests can continue them.
"""

from __future__ import annotations

import contextlib
import json
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse
from pydantic import Field, field_validator, model_validator

from ..sampling_params import SamplingParams
from . import tool_calls
from .frontend import Delta, Frontend
from .http_errors import APIError
from .protocol import MAX_MESSAGES, _Body
from .streaming import EngineRequest, admit, check_model, collect, encode_chat, events, sse_data, tool_constraint

_TEXT_PARTS = ("input_text", "output_text")


def _text(content: Any, at: str) -> str:
    """A string, or text parts joined; ValueError (-> 400) for what is not text."""
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            t = part.get("type") if isinstance(part, dict) else None
            if t not in _TEXT_PARTS:
                raise ValueError(f"{at}[{j}]: content parts of type {t!r} are not supported "
                                 f"(text input only: {', '.join(_TEXT_PARTS)})")
            if not isinstance(part.get("text"), str):
                raise ValueError(f"{at}[{j}]: a text part needs a string text")
            texts.append(part["text"])
        content = "".join(texts)
    if not isinstance(content, str):
        raise ValueError(f"{at}: must be a string or a list of text parts")
    return content


def _items(items: list, at: str = "input") -> list[dict]:
    """Input items as the chat the template renders: messages (`developer` as system), a model's
    `function_call`s as an assistant turn's tool calls, `function_call_output`s as tool messages;
    `reasoning` items are skipped (no reasoning is kept). ValueError (-> 400) for the rest."""
    out: list[dict] = []
    for i, item in enumerate(items):
        where = f"{at}[{i}]"
        if not isinstance(item, dict):
            raise ValueError(f"{where}: an input item must be an object")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise ValueError(f"{where}.role must be user, system, developer or assistant")
            out.append({"role": "system" if role == "developer" else role,
                        "content": _text(item.get("content"), where + ".content")})
        elif kind == "function_call":
            if not all(isinstance(item.get(k), str) for k in ("call_id", "name", "arguments")):
                raise ValueError(f"{where}: a function_call needs string call_id, name and arguments")
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            if out and out[-1]["role"] == "assistant":  # one turn: its text and its calls
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise ValueError(f"{where}: a function_call_output needs a string call_id")
            out.append({"role": "tool", "tool_call_id": item["call_id"],
                        "content": _text(item.get("output", ""), where + ".output")})
        elif kind != "reasoning":
            raise ValueError(f"{where}: input items of type {kind!r} are not supported (message, function_call, "
                             "function_call_output, reasoning)")
    return out


def _tools(tools: list | None, tool_choice: Any, parallel: bool) -> tool_calls.Tools | None:
    """Function tools through the chat completions' tool machinery; tools a local server cannot
    run (web_search, file_search, namespace, local_shell, ...) are left out of the prompt."""
    fns = [{"type": "function", "function": {"name": t.get("name"), "description": t.get("description") or "",
                                             "parameters": t.get("parameters") or {"type": "object"}}}
           for t in tools or [] if isinstance(t, dict) and t.get("type") == "function"]
    if isinstance(tool_choice, dict):
        tool_choice = {"type": "function", "function": {"name": tool_choice.get("name")}} \
            if tool_choice.get("type") == "function" else "auto"  # a hosted tool's choice: none of ours
    if not fns:
        if tool_choice == "required" or isinstance(tool_choice, dict):
            raise ValueError("tool_choice asks for a function call, but no function tool is given")
        return None
    try:
        return tool_calls.Tools.parse(fns, tool_choice, parallel)
    except tool_calls.ToolError as e:
        raise ValueError(str(e)) from None


class ResponsesRequest(_Body):
    model: str | None = None
    input: list[dict[str, Any]]  # chat messages, from the input items (_items)
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # beyond OpenAI's schema, as vLLM takes it
    seed: int | None = None
    cache_salt: str | None = None  # vLLM's: only requests with the same salt share cached prefixes
    ignore_eos: bool = False  # vLLM's, as the other routes take it
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    parallel_tool_calls: bool = True
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None

    @model_validator(mode="before")
    @classmethod
    def _unsupported(cls, data: Any) -> Any:
        # Refused rather than ignored, so a client never believes it got JSON it did not.
        # `reasoning` is accepted and ignored (no reasoning is produced), as llama.cpp does.
        if isinstance(data, dict):
            text = data.get("text")
            fmt = text.get("format") if isinstance(text, dict) else None
            if fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") == "text"):
                raise ValueError("text.format other than {\"type\": \"text\"} is not supported yet (no structured "
                                 "outputs); the request was not run")
            if data.get("background"):
                raise ValueError("background is not supported yet; the request was not run")
        return data

    @field_validator("input", mode="before")
    @classmethod
    def _messages(cls, v: Any) -> Any:
        if isinstance(v, str):
            return [{"role": "user", "content": v}]
        if isinstance(v, list):
            if len(v) > MAX_MESSAGES:  # before any per-item work
                raise ValueError(f"at most {MAX_MESSAGES} input items")
            return _items(v)
        return v


@dataclass
class _Stored:
    response: dict  # what GET returns
    conversation: list[dict]  # chat messages: its input (after earlier turns) and its output, no instructions
    size: int


class ResponseStore:
    """Past responses by id, least recently used first out: at most max_responses of them and
    max_chars characters in all (1024 and 64 Mi by default). A response's size counts its
    object's JSON and its whole conversation, the earlier turns included, so a long conversation
    counts once per stored turn (an upper bound of the memory it holds, which shares the texts).
    A response larger than max_chars by itself is not stored. Evicted ids are gone (404)."""

    def __init__(self, max_responses: int = 1024, max_chars: int = 64 << 20):
        self.max_responses, self.max_chars = max_responses, max_chars
        self._items: OrderedDict[str, _Stored] = OrderedDict()
        self.chars = 0

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, rid: str) -> bool:
        return rid in self._items

    def put(self, response: dict, conversation: list[dict]) -> None:
        size = len(json.dumps(response, ensure_ascii=False)) + sum(len(m["content"]) + len(json.dumps(m.get("tool_calls", ""))) + 16 for m in conversation)
        self.delete(response["id"])
        if size > self.max_chars:
            return
        self._items[response["id"]] = _Stored(response, conversation, size)
        self.chars += size
        while len(self._items) > self.max_responses or self.chars > self.max_chars:
            _, old = self._items.popitem(last=False)
            self.chars -= old.size

    def get(self, rid: str) -> _Stored | None:
        item = self._items.get(rid)
        if item is not None:
            self._items.move_to_end(rid)
        return item

    def delete(self, rid: str) -> bool:
        item = self._items.pop(rid, None)
        if item is not None:
            self.chars -= item.size
        return item is not None


def _sse(seq: list[int], kind: str, **fields) -> str:
    body = {"type": kind, "sequence_number": seq[0], **fields}
    seq[0] += 1
    return f"event: {kind}\n{sse_data(body)}"


def add_responses_routes(app: FastAPI, fe: Frontend, store: ResponseStore | None = None) -> ResponseStore:
    """Register the Responses routes on app; returns the store they keep responses in."""
    store = store if store is not None else ResponseStore()

    def not_found(rid: str, param: str | None = None) -> APIError:
        return APIError(404, f"no response with id {rid!r} (unknown, deleted, not stored or evicted)", param,
                        "response_not_found")

    @app.post("/v1/responses")
    async def create_response(body: ResponsesRequest, request: Request):
        check_model(fe, body.model)
        history: list[dict] = []
        if body.previous_response_id is not None:
            prev = store.get(body.previous_response_id)
            if prev is None:
                raise not_found(body.previous_response_id, "previous_response_id")
            history = prev.conversation
        conversation = history + body.input
        msgs = ([{"role": "system", "content": body.instructions}] if body.instructions is not None else []) \
            + conversation
        if not msgs:
            raise APIError(400, "input must not be empty", "input")
        try:
            tools = _tools(body.tools, body.tool_choice, body.parallel_tool_calls)
        except ValueError as e:
            raise APIError(400, str(e), "tools") from None
        ids = await encode_chat(request, fe, msgs, tools, param="input")
        try:
            params = SamplingParams(max_tokens=body.max_output_tokens,
                                    temperature=1.0 if body.temperature is None else body.temperature,
                                    top_p=1.0 if body.top_p is None else body.top_p, top_k=body.top_k or 0,
                                    seed=body.seed, ignore_eos=body.ignore_eos, structured=tool_constraint(fe, tools))
        except ValueError as e:
            raise APIError(400, str(e)) from None
        req = admit(fe, EngineRequest(ids, params, tools, cache_salt=body.cache_salt))

        rid, mid, created = "resp_" + uuid.uuid4().hex, "msg_" + uuid.uuid4().hex, int(time.time())

        def response(status: str, output: list | None = None, last: Delta | None = None, out_tokens: int = 0,
                     error: dict | None = None) -> dict:
            usage, incomplete = None, None
            if status == "incomplete":
                incomplete = {"reason": "max_output_tokens"}
            if last is not None:
                usage = {"input_tokens": len(ids),
                         "input_tokens_details": {"cached_tokens": last.num_cached_tokens, "cache_write_tokens": 0},
                         "output_tokens": out_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                         "total_tokens": len(ids) + out_tokens}
            return {"id": rid, "object": "response", "created_at": created, "status": status, "error": error,
                    "incomplete_details": incomplete, "instructions": body.instructions,
                    "max_output_tokens": body.max_output_tokens, "model": fe.model_name, "output": output or [],
                    "parallel_tool_calls": body.parallel_tool_calls,
                    "previous_response_id": body.previous_response_id,
                    "temperature": params.temperature, "top_p": params.top_p,
                    "tool_choice": body.tool_choice or "auto", "tools": body.tools or [],
                    "text": {"format": {"type": "text"}}, "truncation": "disabled", "usage": usage,
                    "user": body.user, "metadata": body.metadata or {}, "store": body.store}

        def message(text: str | None, status: str) -> dict:
            content = [] if text is None else [{"type": "output_text", "text": text, "annotations": []}]
            return {"type": "message", "id": mid, "status": status, "role": "assistant", "content": content}

        def function_call(call: dict) -> dict:
            return {"type": "function_call", "id": "fc_" + call["id"].removeprefix("call_"), "call_id": call["id"],
                    "name": call["function"]["name"], "arguments": call["function"]["arguments"],
                    "status": "completed"}

        def finish(text: str | None, calls: list[dict], last: Delta, out_tokens: int, message_at: int | None = 0) -> dict:
            """message_at: the message's place among the output items (None: no message, only calls)."""
            status = "incomplete" if last.finish_reason == "length" else "completed"
            output = [function_call(c) for c in calls]
            if message_at is not None and (text or not calls):
                output.insert(message_at, message(text, status))
            done = response(status, output, last, out_tokens)
            if body.store:
                turn = {"role": "assistant", "content": text or ""}
                if calls:
                    turn["tool_calls"] = calls
                store.put(done, conversation + [turn])
            return done

        async def sse_events() -> AsyncIterator[str]:
            seq = [0]
            where = {"item_id": mid, "output_index": 0, "content_index": 0}
            yield _sse(seq, "response.created", response=response("in_progress"))
            yield _sse(seq, "response.in_progress", response=response("in_progress"))
            calls: list[dict] = []
            opened = False  # the message item is announced with its first text (at once without tools)

            def open_message() -> list[str]:
                where["output_index"] = len(calls)  # after the calls already announced
                return [_sse(seq, "response.output_item.added", output_index=where["output_index"],
                             item=message(None, "in_progress")),
                        _sse(seq, "response.content_part.added", **where,
                             part={"type": "output_text", "text": "", "annotations": []})]

            if tools is None:
                opened = True
                for e in open_message():
                    yield e
            parts, n, last = [], 0, None
            try:
                async with contextlib.aclosing(events(fe, req)) as evs:  # a client gone stops the work now
                    async for ev in evs:
                        n += len(ev.delta.token_ids)
                        last = ev.delta
                        if ev.text:
                            if not opened:
                                opened = True
                                for e in open_message():
                                    yield e
                            parts.append(ev.text)
                            yield _sse(seq, "response.output_text.delta", **where, delta=ev.text, logprobs=[])
                        for call in ev.calls:  # each whole call is one output item
                            item = function_call(call)
                            index = len(calls) + int(opened)
                            calls.append(call)
                            yield _sse(seq, "response.output_item.added", output_index=index,
                                       item={**item, "arguments": "", "status": "in_progress"})
                            yield _sse(seq, "response.function_call_arguments.delta", item_id=item["id"],
                                       output_index=index, delta=item["arguments"])
                            yield _sse(seq, "response.function_call_arguments.done", item_id=item["id"],
                                       output_index=index, arguments=item["arguments"])
                            yield _sse(seq, "response.output_item.done", output_index=index, item=item)
            except APIError as e:  # the headers are sent: the failure becomes the stream's last event
                yield _sse(seq, "response.failed",
                           response=response("failed", error={"code": "server_error", "message": e.message}))
                return
            text = "".join(parts)
            done = finish(text if opened else None, calls, last, n, where["output_index"] if opened else None)
            if opened:
                item = done["output"][where["output_index"]]
                yield _sse(seq, "response.output_text.done", **where, text=text, logprobs=[])
                yield _sse(seq, "response.content_part.done", **where, part=item["content"][0])
                yield _sse(seq, "response.output_item.done", output_index=where["output_index"], item=item)
            yield _sse(seq, "response." + done["status"], response=done)  # response.completed or .incomplete

        if body.stream:
            return StreamingResponse(sse_events(), media_type="text/event-stream")

        out = await collect(request, fe, req)
        return finish(out.text, out.calls, out.last, out.num_tokens)

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str):
        item = store.get(response_id)
        if item is None:
            raise not_found(response_id)
        return item.response

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str):
        if not store.delete(response_id):
            raise not_found(response_id)
        return {"id": response_id, "object": "response", "deleted": True}

    return store
