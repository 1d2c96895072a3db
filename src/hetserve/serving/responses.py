"""OpenAI's Responses API (`POST /v1/responses`, `GET` and `DELETE /v1/responses/{id}`), text only.

A response is one assistant message generated from the chat-templated conversation: the new
`instructions` (a leading system message), the stored conversation of `previous_response_id`
(its input and output; not its instructions, as OpenAI does) and the new `input`. Responses
are kept in a bounded in-memory store so that later requests can continue them.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, Field, field_validator, model_validator

from ..sampling_params import SamplingParams
from .frontend import Delta, Frontend, ServiceUnavailable
from .http_errors import APIError, unless_gone
from .protocol import MAX_MESSAGES, _Body
from .streaming import deltas, sse_data

_TEXT_PARTS = ("input_text", "output_text")


class InputMessage(BaseModel):
    role: Literal["user", "system", "developer", "assistant"]
    content: str  # the text of its parts, joined


def _message(item: Any, at: str) -> dict:
    """One input item as a chat message {role, content: str}; ValueError (-> 400) for what is not text."""
    if not isinstance(item, dict):
        raise ValueError(f"{at}: an input item must be an object")
    kind = item.get("type", "message")
    if kind != "message":
        raise ValueError(f"{at}: input items of type {kind!r} are not supported yet (messages only; no tool calls)")
    content = item.get("content")
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            t = part.get("type") if isinstance(part, dict) else None
            if t not in _TEXT_PARTS:
                raise ValueError(f"{at}.content[{j}]: content parts of type {t!r} are not supported "
                                 f"(text input only: {', '.join(_TEXT_PARTS)})")
            if not isinstance(part.get("text"), str):
                raise ValueError(f"{at}.content[{j}]: a text part needs a string text")
            texts.append(part["text"])
        content = "".join(texts)
    if not isinstance(content, str):
        raise ValueError(f"{at}.content: must be a string or a list of text parts")
    return {"role": item.get("role"), "content": content}


class ResponsesRequest(_Body):
    model: str | None = None
    input: list[InputMessage]
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

    @model_validator(mode="before")
    @classmethod
    def _unsupported(cls, data: Any) -> Any:
        # Refused rather than ignored, so a client never believes it got a tool call, JSON or
        # reasoning it did not.
        if isinstance(data, dict):
            if data.get("tools"):
                raise ValueError("tools is not supported yet (no tool calling); the request was not run")
            if data.get("tool_choice") not in (None, "none"):
                raise ValueError("tool_choice is not supported yet (no tool calling); the request was not run")
            text = data.get("text")
            fmt = text.get("format") if isinstance(text, dict) else None
            if fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") == "text"):
                raise ValueError("text.format other than {\"type\": \"text\"} is not supported yet (no structured "
                                 "outputs); the request was not run")
            if data.get("reasoning"):
                raise ValueError("reasoning is not supported yet; the request was not run")
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
            return [_message(item, f"input[{i}]") for i, item in enumerate(v)]
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
        size = len(json.dumps(response, ensure_ascii=False)) + sum(len(m["content"]) + 16 for m in conversation)
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
        if body.model is not None and body.model != fe.model_name:
            raise APIError(404, f"model {body.model!r} does not exist; this server serves {fe.model_name!r}",
                           "model", "model_not_found")
        history: list[dict] = []
        if body.previous_response_id is not None:
            prev = store.get(body.previous_response_id)
            if prev is None:
                raise not_found(body.previous_response_id, "previous_response_id")
            history = prev.conversation
        conversation = history + [m.model_dump() for m in body.input]
        msgs = ([{"role": "system", "content": body.instructions}] if body.instructions is not None else []) \
            + conversation
        if not msgs:
            raise APIError(400, "input must not be empty", "input")
        try:  # the helper the chat route renders with (off the event loop, with a time budget)
            ids, = await unless_gone(request, fe.encode_chat(msgs, add_generation_prompt=True))
        except ValueError as e:  # the template's or tokenizer's refusal (TokenizeFailed is one)
            raise APIError(400, str(e), "input") from None
        try:
            fe.check_capacity()
            params = SamplingParams(max_tokens=body.max_output_tokens,
                                    temperature=1.0 if body.temperature is None else body.temperature,
                                    top_p=1.0 if body.top_p is None else body.top_p, top_k=body.top_k or 0,
                                    seed=body.seed, ignore_eos=body.ignore_eos)
            params.max_tokens = fe.check_length(len(ids), params.max_tokens)
        except ServiceUnavailable as e:
            raise APIError(503, str(e)) from None
        except ValueError as e:
            raise APIError(400, str(e)) from None

        rid, mid, created = "resp_" + uuid.uuid4().hex, "msg_" + uuid.uuid4().hex, int(time.time())

        def response(status: str, text: str | None = None, last: Delta | None = None, out_tokens: int = 0,
                     error: dict | None = None) -> dict:
            output, usage, incomplete = [], None, None
            if status == "incomplete":
                incomplete = {"reason": "max_output_tokens"}
            if text is not None:
                output = [message(text, "completed" if status == "completed" else "incomplete")]
            if last is not None:
                usage = {"input_tokens": len(ids),
                         "input_tokens_details": {"cached_tokens": last.num_cached_tokens, "cache_write_tokens": 0},
                         "output_tokens": out_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                         "total_tokens": len(ids) + out_tokens}
            return {"id": rid, "object": "response", "created_at": created, "status": status, "error": error,
                    "incomplete_details": incomplete, "instructions": body.instructions,
                    "max_output_tokens": body.max_output_tokens, "model": fe.model_name, "output": output,
                    "parallel_tool_calls": body.parallel_tool_calls,
                    "previous_response_id": body.previous_response_id,
                    "temperature": params.temperature, "top_p": params.top_p, "tool_choice": "auto", "tools": [],
                    "text": {"format": {"type": "text"}}, "truncation": "disabled", "usage": usage,
                    "user": body.user, "metadata": body.metadata or {}, "store": body.store}

        def message(text: str | None, status: str) -> dict:
            content = [] if text is None else [{"type": "output_text", "text": text, "annotations": []}]
            return {"type": "message", "id": mid, "status": status, "role": "assistant", "content": content}

        def finish(text: str, last: Delta, out_tokens: int) -> dict:
            status = "incomplete" if last.finish_reason == "length" else "completed"
            done = response(status, text, last, out_tokens)
            if body.store:
                store.put(done, conversation + [{"role": "assistant", "content": text}])
            return done

        def run() -> AsyncIterator[Delta]:
            return deltas(fe, ids, params, cache_salt=body.cache_salt)

        async def events() -> AsyncIterator[str]:
            seq = [0]
            where = {"item_id": mid, "output_index": 0, "content_index": 0}
            yield _sse(seq, "response.created", response=response("in_progress"))
            yield _sse(seq, "response.in_progress", response=response("in_progress"))
            yield _sse(seq, "response.output_item.added", output_index=0, item=message(None, "in_progress"))
            yield _sse(seq, "response.content_part.added", **where,
                       part={"type": "output_text", "text": "", "annotations": []})
            parts, n, last = [], 0, None
            deltas = run()
            try:
                async for d in deltas:
                    n += len(d.token_ids)
                    last = d
                    if d.text:
                        parts.append(d.text)
                        yield _sse(seq, "response.output_text.delta", **where, delta=d.text, logprobs=[])
                    await asyncio.sleep(0)  # a client that left is seen before the next write (see api_server)
            except APIError as e:  # the headers are sent: the failure becomes the stream's last event
                yield _sse(seq, "response.failed",
                           response=response("failed", error={"code": "server_error", "message": e.message}))
                return
            finally:
                await deltas.aclose()  # a client gone mid-stream (Starlette closes this generator) stops the work
            text = "".join(parts)
            done = finish(text, last, n)
            item = done["output"][0]
            yield _sse(seq, "response.output_text.done", **where, text=text, logprobs=[])
            yield _sse(seq, "response.content_part.done", **where, part=item["content"][0])
            yield _sse(seq, "response.output_item.done", output_index=0, item=item)
            yield _sse(seq, "response." + done["status"], response=done)  # response.completed or .incomplete

        if body.stream:
            return StreamingResponse(events(), media_type="text/event-stream")

        async def collect() -> tuple[str, Delta, int]:
            parts, n, last = [], 0, None
            async for d in run():
                parts.append(d.text)
                n += len(d.token_ids)
                last = d
            return "".join(parts), last, n

        (text, last, n), = await unless_gone(request, collect())
        return finish(text, last, n)

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
