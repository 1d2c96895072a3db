"""The one request model every API adapter shares (chat completions, completions, Responses,
Anthropic's Messages, infill): each turns its body into an `EngineRequest` (prompt ids, sampling
parameters, tools, where it may run), admits it here, and reads it back as `events` (streamed) or
an `Outcome` (whole). Sampling checks, tool-call splitting and parsing, the abort on a client
that left, and the mapping of failures to API errors live here once; the adapters only shape
bodies and events. Also SSE framing."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from fastapi import Request

from ..sampling_params import SamplingParams
from . import tool_calls
from .frontend import Delta, Frontend, RequestFailed, ServiceUnavailable
from .http_errors import APIError, unless_gone
from .tokenizer_service import TokenizeFailed

# Characters JSON leaves unescaped but line splitters that follow str.splitlines (httpx's
# aiter_lines among them) break lines at: escaped, so an SSE event is always one line.
_LINE_BREAKS = str.maketrans({"\u2028": "\\u2028", "\u2029": "\\u2029", "\x85": "\\u0085"})


def sse_data(body: dict) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False).translate(_LINE_BREAKS)}\n\n"


@dataclass
class EngineRequest:
    """What every API's body becomes: a prompt, how to sample it, the tools its output is parsed
    for, and where it may run (vLLM's cache_salt; hetserve's worker pin)."""

    ids: list[int]
    params: SamplingParams
    tools: tool_calls.Tools | None = None
    cache_salt: str | None = None
    worker: str | None = None
    max_tokens_given: bool | None = None  # whether the client set a limit (admit: params.max_tokens before)


@dataclass
class Event:
    """One delta of a request as an API shows it: its text (tool-call markup taken out) and the
    tool calls completed in it."""

    delta: Delta
    text: str
    calls: list[dict] = field(default_factory=list)


@dataclass
class Outcome:
    """A whole answer: its text (None when it is only tool calls) and tool calls, its tokens and
    their logprobs where asked, the last delta (finish reason, cached tokens, where it ran), the
    prompt's logprobs where asked, and when its first token came (time.perf_counter)."""

    text: str | None
    calls: list[dict]
    token_ids: list[int]
    logprobs: list[dict[int, float]]
    last: Delta
    prompt_logprobs: list | None
    first_token_at: float

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


def check_model(fe: Frontend, name: str | None) -> None:
    if name is not None and name != fe.model_name:
        raise APIError(404, f"model {name!r} does not exist; this server serves {fe.model_name!r}", "model",
                       "model_not_found")


async def encode_chat(request: Request, fe: Frontend, messages: list[dict], tools: tool_calls.Tools | None = None,
                      add_generation_prompt: bool = True, for_context: bool = True, param: str = "messages") -> list[int]:
    """A conversation (OpenAI's roles; tool calls and results as tool_calls.history_messages
    reads them) through the model's template, off the event loop; a 400 naming `param` when the
    template or tokenizer refuses it; a client that leaves stops the wait."""
    try:
        ids, = await unless_gone(request, fe.encode_chat(
            tool_calls.history_messages(messages), add_generation_prompt,
            tools.template_tools if tools else None, for_context=for_context))
    except (TokenizeFailed, ValueError) as e:
        raise APIError(400, str(e), param) from None
    return ids


def admit(fe: Frontend, req: EngineRequest) -> EngineRequest:
    """Whether the server takes the request now (a 503 while draining, a worker down or the queue
    full) and ever can (a 400 with the numbers); its max_tokens resolved against the context."""
    if req.max_tokens_given is None:  # the router prices an open-ended request's decode otherwise
        req.max_tokens_given = req.params.max_tokens is not None
    try:
        fe.check_capacity()
        req.params.max_tokens = fe.check_length(len(req.ids), req.params.max_tokens)
    except ServiceUnavailable as e:
        raise APIError(503, str(e)) from None
    except ValueError as e:
        raise APIError(400, str(e)) from None
    return req


def tool_constraint(fe: Frontend, tools: tool_calls.Tools | None):
    """The grammar a request's tools put on its output (a 400 for tools that cannot be one)."""
    if tools is None:
        return None
    try:
        return tools.constraint(fe.tokenizer)
    except tool_calls.ToolError as e:
        raise APIError(400, str(e), e.field) from None


async def deltas(fe: Frontend, req: EngineRequest) -> AsyncIterator[Delta]:
    """One request's deltas: a failure is an APIError (503 for a worker or the server unavailable,
    400 for what the request asked), and a consumer that stops (a cancel, a client gone) aborts
    the request now, not when the generator is collected."""
    try:
        async with contextlib.aclosing(fe.generate(req.ids, req.params, cache_salt=req.cache_salt,
                                                   worker=req.worker, max_tokens_given=req.max_tokens_given)) as gen:
            async for d in gen:
                yield d
    except (ServiceUnavailable, RequestFailed) as e:
        raise APIError(503, str(e)) from None
    except ValueError as e:
        raise APIError(400, str(e)) from None


async def events(fe: Frontend, req: EngineRequest) -> AsyncIterator[Event]:
    """The request's deltas with its tool calls split out as they complete. After each event the
    loop runs once before the next is made, so that a client that left is seen (its transport's
    connection_lost runs) before the next write, instead of after a burst of writes to a dead
    socket that asyncio logs one warning each. The consumer's own stop aborts the request."""
    split = tool_calls.ToolStream(req.tools) if req.tools is not None else None
    async with contextlib.aclosing(deltas(fe, req)) as gen:
        async for d in gen:
            text, calls = split.feed(d.text, final=d.finished) if split else (d.text, [])
            yield Event(d, text, calls)
            await asyncio.sleep(0)


async def outcome(fe: Frontend, req: EngineRequest) -> Outcome:
    """The whole answer; its tool calls parsed from the whole text (tool_calls.parse reads the
    forms a model writes besides the tagged one)."""
    parts, toks, lps, last, prompt_lps, first = [], [], [], None, None, None
    async for d in deltas(fe, req):
        first = first or time.perf_counter()
        parts.append(d.text)
        toks += d.token_ids
        lps += d.logprobs
        last = d
        prompt_lps = d.prompt_logprobs if d.prompt_logprobs is not None else prompt_lps
    text, calls = "".join(parts), []
    if req.tools is not None:
        text, calls = tool_calls.parse(text, req.tools)
    return Outcome(text, calls, toks, lps, last, prompt_lps, first or time.perf_counter())


async def collect(request: Request, fe: Frontend, req: EngineRequest) -> Outcome:
    """The whole answer; a client that leaves aborts it (several at once: unless_gone over
    `outcome`s, as the OpenAI routes do for n choices)."""
    out, = await unless_gone(request, outcome(fe, req))
    return out
