"""FastAPI app: OpenAI-compatible routes, SSE streaming, auth, limits, OpenAI-shaped errors."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse
from fastapi.staticfiles import StaticFiles
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..sampling_params import SamplingParams
from ..structured import StructuredOutputError
from . import tool_calls
from .anthropic import add_anthropic_routes
from .dashboard import dashboard
from .frontend import Delta, Frontend, ServiceUnavailable
from .http_errors import RETRY_AFTER_S, APIError, ClientGone, error_body, error_response, unless_gone
from .http_guard import HttpLimits
from .infill import add_infill_routes, fim_prompt, fim_stops
from .protocol import (
    MAX_PROMPTS,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from .responses import add_responses_routes
from .streaming import deltas, sse_data
from .tokenizer_service import TokenizeFailed

log = logging.getLogger("hetserve.api")

WEB_DIR = Path(__file__).parent / "web"  # the page at / (no API key: it holds no data; its calls need one)


@dataclass
class _Job:
    """One choice of a request: its prompt ids (shared by its n copies), parameters and output state."""

    index: int
    ids: list[int]
    params: SamplingParams
    echo: str | None = None  # completions with echo: the prompt's text, shown first
    score_only: bool = False  # echo with max_tokens 0: one token is run for the prompt's scores, none shown
    want_prompt_logprobs: bool = False  # vLLM's prompt_logprobs field was given
    text_offset: int = 0  # characters of this choice's text so far (logprobs' text_offset)
    tools: tool_calls.Tools | None = None  # chat with tools: the output is parsed for calls


def build_app(frontend: Frontend, api_key: str | None = None, max_body_bytes: int = 4 << 20,
              lifespan=None, http_limits: HttpLimits | None = None) -> FastAPI:
    app = FastAPI(title="hetserve", docs_url=None, redoc_url=None, lifespan=lifespan)
    fe = frontend

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError):
        return error_response(e.status, e.message, e.param, e.code, request.url.path)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, e: RequestValidationError):
        # OpenAI and vLLM answer a malformed body with 400 (the openai client's BadRequestError),
        # not pydantic's 422.
        first = e.errors()[0] if e.errors() else {}
        where = ".".join(str(x) for x in first.get("loc", ())[1:]) or None
        msg = str(first.get("msg", "invalid")).removeprefix("Value error, ")
        return error_response(400, f"invalid request: {where or 'body'}: {msg}", where, path=request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, e: StarletteHTTPException):
        return error_response(e.status_code, str(e.detail), path=request.url.path)

    @app.exception_handler(ClientGone)
    async def _gone(request: Request, _):
        log.info("client left before its answer: %s %s", request.method, request.url.path)
        return Response(status_code=499)

    @app.exception_handler(Exception)
    async def _internal(request: Request, e: Exception):
        log.exception("internal error")
        return error_response(500, "internal server error", path=request.url.path)

    def check_model(name: str | None) -> None:
        if name is not None and name != fe.model_name:
            raise APIError(404, f"model {name!r} does not exist; this server serves {fe.model_name!r}", "model",
                           "model_not_found")

    # -- routes -------------------------------------------------------------------------------
    @app.get("/health")
    async def health():
        """200 while any worker serves (a dead one only leaves the routing), else 503; the body
        lists every worker's state."""
        body = fe.health()
        if fe.healthy:
            return JSONResponse(body)
        body["error"] = error_body(503, "draining" if fe.draining else "no worker is serving")["error"]
        return JSONResponse(body, status_code=503, headers={"Retry-After": str(RETRY_AFTER_S)})

    @app.get("/", include_in_schema=False)
    async def web_page():
        return FileResponse(WEB_DIR / "index.html", headers={"Cache-Control": "no-cache"})

    @app.get("/favicon.ico", include_in_schema=False)
    async def favicon():  # what a client asks for without reading the page's <link rel="icon">
        return FileResponse(WEB_DIR / "favicon.svg", media_type="image/svg+xml")

    app.mount("/static", StaticFiles(directory=WEB_DIR, check_dir=False), name="static")

    @app.get("/v1/dashboard")
    async def live_dashboard():
        """The web page's live view: workers, recent routing decisions, latency percentiles."""
        return dashboard(fe)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": fe.model_name, "object": "model", "created": 0,
                                            "owned_by": "hetserve", "max_model_len": fe.max_model_len}]}

    @app.get("/metrics")
    async def metrics():
        return Response(fe.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest, request: Request):
        check_model(body.model)
        if body.messages is not None:
            msgs = [m.model_dump(exclude_none=True) for m in body.messages]
            ids = await _encode_chat(request, msgs, body.add_generation_prompt, for_context=False)
        elif body.prompt is not None:
            ids = await _encode(request, body.prompt, body.parse_special, for_context=False)
        else:
            raise APIError(400, "give either prompt or messages", "prompt")
        return {"tokens": ids, "count": len(ids), "max_model_len": fe.max_model_len}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        check_model(body.model)
        _check_ids(body.tokens, "tokens")
        return {"prompt": await fe.run_blocking(fe.tokenizer.decode, body.tokens, False)}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        check_model(body.model)
        if body.max_tokens == 0 and not body.echo:
            raise APIError(400, "max_tokens: 0 is only meaningful with echo (prompt scoring)", "max_tokens")
        if body.suffix is None:
            prompts = await _completion_prompts(request, body.prompt, body.parse_special)
            return await _serve(body, request, prompts, body.max_tokens, body.logprobs, chat=False)
        # Fill in the middle: each prompt is the text before the insertion, suffix the text after it.
        texts = [body.prompt] if isinstance(body.prompt, str) else body.prompt
        if body.echo or not texts or not all(isinstance(t, str) for t in texts) or len(texts) > MAX_PROMPTS:
            raise APIError(400, f"suffix needs 1 to {MAX_PROMPTS} text prompts (not token ids) and no echo", "suffix")
        prompts = [(await fim_prompt(request, fe, t, body.suffix, [], None, body.max_tokens))[0] for t in texts]
        return await _serve(body, request, prompts, body.max_tokens, body.logprobs, chat=False,
                            stop_ids=fim_stops(fe))

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        check_model(body.model)
        if not body.messages:
            raise APIError(400, "messages must not be empty", "messages")
        msgs = tool_calls.history_messages([m.model_dump(exclude_none=True) for m in body.messages])
        try:
            tools = tool_calls.Tools.parse(body.tools, body.tool_choice, body.parallel_tool_calls)
        except tool_calls.ToolError as e:
            raise APIError(400, str(e), e.field) from None
        ids = await _encode_chat(request, msgs, body.add_generation_prompt,
                                 tools=tools.template_tools if tools else None)
        top = body.top_logprobs if body.top_logprobs is not None else (0 if body.logprobs else None)
        if body.top_logprobs is not None and not body.logprobs:
            raise APIError(400, "top_logprobs requires logprobs: true", "top_logprobs")
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        return await _serve(body, request, [ids], max_tokens, top, chat=True, tools=tools)

    # -- helpers ------------------------------------------------------------------------------
    def _check_ids(ids: list[int], param: str) -> None:
        vocab = fe.tokenizer.vocab_size
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise APIError(400, f"token id {bad} is outside the vocabulary [0, {vocab - 1}]", param)

    async def _encode_chat(request: Request, msgs: list[dict], add_generation_prompt: bool,
                           for_context: bool = True, tools: list[dict] | None = None) -> list[int]:
        try:
            ids, = await unless_gone(request, fe.encode_chat(msgs, add_generation_prompt, tools,
                                                             for_context=for_context))
            return ids
        except (TokenizeFailed, ValueError) as e:
            raise APIError(400, str(e), "messages") from None

    async def _encode(request: Request, text: str, parse_special: bool, for_context: bool = True) -> list[int]:
        try:
            ids, = await unless_gone(request, fe.encode_prompt(text, parse_special, for_context))
            return ids
        except (TokenizeFailed, ValueError) as e:
            raise APIError(400, str(e), "prompt") from None

    async def _completion_prompts(request: Request, prompt, parse_special: bool) -> list[list[int]]:
        if isinstance(prompt, str):
            prompt = [prompt]
        if not prompt:
            raise APIError(400, "prompt must not be empty", "prompt")
        if isinstance(prompt[0], int):
            prompt = [prompt]
        if len(prompt) > MAX_PROMPTS:
            raise APIError(400, f"at most {MAX_PROMPTS} prompts per request", "prompt")
        out = []
        for p in prompt:
            ids = await _encode(request, p, parse_special) if isinstance(p, str) else list(p)
            if not ids:
                raise APIError(400, "prompt must not be empty", "prompt")
            _check_ids(ids, "prompt")
            out.append(ids)
        return out

    def _constraint(body, tools: tool_calls.Tools | None):
        """The request's output grammar: its structured-output fields, or its tool calls."""
        try:
            structured = body.constraint()
            if tools is None:
                return structured
            if structured is not None:
                raise StructuredOutputError(f"{structured.field} and tools both constrain the output; give one",
                                            structured.field)
            return tools.constraint(fe.tokenizer)
        except (StructuredOutputError, tool_calls.ToolError) as e:
            raise APIError(400, str(e), e.field) from None

    async def _serve(body, request: Request, prompts: list[list[int]], max_tokens, logprobs, chat: bool,
                     tools: tool_calls.Tools | None = None, stop_ids: set[int] = frozenset()):
        # n choices per prompt share its id list (usage counts each prompt once).
        echo = not chat and body.echo
        score_only = echo and max_tokens == 0  # prompt scoring: run one token, return none
        choice_prompts = [ids for ids in prompts for _ in range(body.n)]
        structured = _constraint(body, tools)
        try:
            fe.check_capacity()
            params = [body.sampling_params(1 if score_only else max_tokens, logprobs, i % body.n, structured)
                      for i in range(len(choice_prompts))]
            for p, ids in zip(params, choice_prompts):
                p.stop_token_ids = sorted(set(p.stop_token_ids) | stop_ids)
                if echo and logprobs is not None and p.prompt_logprobs is None:
                    p.prompt_logprobs = logprobs  # echo + logprobs scores the prompt too
                p.max_tokens = fe.check_length(len(ids), p.max_tokens)
                _check_ids(list(p.logit_bias), "logit_bias")
        except ServiceUnavailable as e:
            raise APIError(503, str(e)) from None
        except ValueError as e:
            raise APIError(400, str(e)) from None
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        created = int(time.time())
        echoes = {}
        if echo:
            for ids in prompts:
                echoes[id(ids)] = await fe.run_blocking(fe.tokenizer.decode, ids, False)
        jobs = [_Job(i, ids, p, echoes.get(id(ids)), score_only, body.prompt_logprobs is not None, tools=tools)
                for i, (ids, p) in enumerate(zip(choice_prompts, params))]
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(_stream(jobs, rid, created, chat, include_usage, _route(body)),
                                     media_type="text/event-stream")
        return await _collect(jobs, rid, created, chat, request, _route(body))

    def piece(t: int) -> str:
        return fe.tokenizer.decode([t], False)

    def _logprobs_entry(delta_logprobs: list[dict[int, float] | None], token_ids: list[int], chat: bool, n: int,
                        offset: int = 0):
        """OpenAI's logprobs object. Chat: each token's top_logprobs are the n most likely. Completions
        (legacy shape): the sampled token plus the top n (up to n + 1 entries), None for a prompt's
        first token (echo), and text_offset, each token's character offset in the returned text."""
        def top(lps: dict[int, float], k: int) -> list[tuple[str, float]]:
            return [(piece(t), v) for t, v in sorted(lps.items(), key=lambda kv: -kv[1])[:k]]

        if chat:
            return {"content": [
                {"token": piece(tok), "logprob": lps.get(tok), "bytes": list(piece(tok).encode()),
                 "top_logprobs": [{"token": s, "logprob": v, "bytes": list(s.encode())} for s, v in top(lps, n)]}
                for tok, lps in zip(token_ids, delta_logprobs)]}
        tokens = [piece(t) for t in token_ids]
        offsets = []
        for s in tokens:
            offsets.append(offset)
            offset += len(s)
        def top_with(lps: dict[int, float] | None, tok: int):
            if lps is None:
                return None
            out = dict(top(lps, n + 1))
            out[piece(tok)] = lps[tok]  # two tokens may print alike; the sampled one's value is shown
            return out

        return {"tokens": tokens,
                "token_logprobs": [None if lps is None else lps.get(t) for t, lps in zip(token_ids, delta_logprobs)],
                "top_logprobs": [top_with(lps, t) for t, lps in zip(token_ids, delta_logprobs)],
                "text_offset": offsets}

    def _prompt_logprobs(entries: list[dict[int, float] | None] | None, ids: list[int], n: int):
        """vLLM's prompt_logprobs: per prompt token, None for the first, else {id: {logprob, rank,
        decoded_token}} for the prompt token and the top-N (rank: 1-based among those; None for a
        prompt token outside the top N)."""
        if entries is None:
            return None
        out = []
        for tok, lps in zip(ids, entries):
            if lps is None:
                out.append(None)
                continue
            # The entry holds the top n and the prompt token; an (n + 1)-th entry is the prompt
            # token ranked below them all, at an unknown rank.
            ranked = sorted(lps.items(), key=lambda kv: -kv[1])
            out.append({str(t): {"logprob": v, "rank": i + 1 if i < n else None, "decoded_token": piece(t)}
                        for i, (t, v) in enumerate(ranked)})
        return out

    def _route(body) -> dict:
        return {"cache_salt": body.cache_salt, "worker": body.worker}

    def _run(ids, params, route: dict) -> AsyncIterator[Delta]:
        return deltas(fe, ids, params, **route)

    def _shown(job: "_Job", d: Delta) -> tuple[str, list[int], list]:
        """What a choice shows of a delta: nothing of the one token a prompt-scoring job runs."""
        return ("", [], []) if job.score_only else (d.text, d.token_ids, d.logprobs)

    def _choice_body(job: "_Job", text: str, toks: list[int], lps: list, chat: bool, first: bool,
                     prompt_lps: list | None, finished: bool) -> dict:
        """A choice's new text (or message) and logprobs; the first one of a completion with echo
        starts with the prompt, and its logprobs with the prompt's scores (None for its first token)."""
        n = job.params.logprobs
        if chat:
            return {"content": text, "logprobs": _logprobs_entry(lps, toks, True, n) if n is not None else None}
        out = {"text": text, "logprobs": None}
        if first and job.echo is not None:
            out["text"] = job.echo + text
            if n is not None:
                toks, lps = job.ids + toks, (prompt_lps or [None] * len(job.ids)) + lps
        if n is not None and (toks or finished):
            out["logprobs"] = _logprobs_entry(lps, toks, False, n, job.text_offset)
        job.text_offset += len(out["text"])
        if first and job.want_prompt_logprobs:
            out["prompt_logprobs"] = _prompt_logprobs(prompt_lps, job.ids, job.params.prompt_logprobs)
        return out

    async def _collect(jobs: list["_Job"], rid, created, chat, request: Request, route: dict):
        async def one(job: _Job):
            text, toks, lps, last, prompt_lps = [], [], [], None, None
            async for d in _run(job.ids, job.params, route):
                t, ti, lp = _shown(job, d)
                text.append(t)
                toks += ti
                lps += lp
                last = d
                prompt_lps = d.prompt_logprobs if d.prompt_logprobs is not None else prompt_lps
            return "".join(text), toks, lps, last, prompt_lps

        results = await unless_gone(request, *(one(j) for j in jobs))
        choices, usage = [], {"prompt_tokens": 0, "completion_tokens": 0, "cached_tokens": 0}
        seen_prompts = set()
        for (text, toks, lps, last, prompt_lps), job in zip(results, jobs):
            body = _choice_body(job, text, toks, lps, chat, True, prompt_lps, True)
            choice = {"index": job.index}
            finish = "length" if job.score_only else last.finish_reason
            if chat:
                choice["message"] = {"role": "assistant", "content": body.pop("content")}
                if job.tools is not None:
                    content, calls = tool_calls.parse(choice["message"]["content"], job.tools)
                    choice["message"].update(content=content, tool_calls=calls)
                    finish = tool_calls.finish_reason(finish, bool(calls))
            choice.update(body)
            choice["finish_reason"] = finish
            choice["hetserve"] = _served_by(last)
            choices.append(choice)
            usage["completion_tokens"] += len(toks)
            if id(job.ids) not in seen_prompts:  # n copies of one prompt count it once, as OpenAI does
                seen_prompts.add(id(job.ids))
                usage["prompt_tokens"] += len(job.ids)
                usage["cached_tokens"] += last.num_cached_tokens
        return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
                "model": fe.model_name, "choices": choices, "usage": _usage(usage)}

    def _served_by(d: Delta) -> dict:
        """hetserve's extension on a finished choice (the web page shows it): where it ran and what it reused."""
        return {"worker": d.worker, "cached_tokens": d.num_cached_tokens, "spec": d.spec,
                "disaggregated": {"prefill": d.prefill_worker, "decode": d.worker} if d.prefill_worker else None}

    def _usage(u: dict) -> dict:
        return {"prompt_tokens": u["prompt_tokens"], "completion_tokens": u["completion_tokens"],
                "total_tokens": u["prompt_tokens"] + u["completion_tokens"],
                "prompt_tokens_details": {"cached_tokens": u["cached_tokens"]}}

    async def _stream(jobs: list["_Job"], rid, created, chat, include_usage, route: dict):
        queue: asyncio.Queue = asyncio.Queue()
        obj = "chat.completion.chunk" if chat else "text_completion"

        async def pump(job: _Job):
            try:
                async for d in _run(job.ids, job.params, route):
                    await queue.put((job, d))
            except APIError as e:
                await queue.put((job, e))

        def chunk(choices, usage=None, served_by=None) -> str:
            body = {"id": rid, "object": obj, "created": created, "model": fe.model_name, "choices": choices}
            if usage is not None:
                body["usage"] = usage
            if served_by is not None:
                body["hetserve"] = served_by
            return sse_data(body)

        tasks = [asyncio.ensure_future(pump(j)) for j in jobs]
        unique_prompts = {id(j.ids): j.ids for j in jobs}.values()  # n copies count once
        usage = {"prompt_tokens": sum(len(ids) for ids in unique_prompts), "completion_tokens": 0,
                 "cached_tokens": 0}
        cached_seen: set[int] = set()
        started: set[int] = set()
        streams: dict[int, tool_calls.ToolStream] = {}  # choices with tools
        remaining = len(jobs)
        try:
            if chat:
                yield chunk([{"index": j.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                              "finish_reason": None} for j in jobs])
            while remaining:
                job, d = await queue.get()
                if isinstance(d, APIError):
                    remaining -= 1
                    yield sse_data(error_body(d.status, d.message))
                    continue
                text, toks, lps = _shown(job, d)
                usage["completion_tokens"] += len(toks)
                if d.finished and id(job.ids) not in cached_seen:
                    cached_seen.add(id(job.ids))
                    usage["cached_tokens"] += d.num_cached_tokens
                first = job.index not in started
                started.add(job.index)
                body = _choice_body(job, text, toks, lps, chat, first, d.prompt_logprobs, d.finished)
                calls = []
                if job.tools is not None:
                    stream = streams.setdefault(job.index, tool_calls.ToolStream(job.tools))
                    body["content"], calls = stream.feed(body["content"], final=d.finished)
                shows = text if job.tools is None else body["content"] or calls
                if shows or d.finished or body.get("logprobs") or (first and job.echo is not None):
                    c = {"index": job.index}
                    if chat:
                        content = body.pop("content")
                        c["delta"] = {"content": content} if content else {}
                        if calls:
                            base = streams[job.index].num_calls - len(calls)
                            c["delta"]["tool_calls"] = [{"index": base + i, **call} for i, call in enumerate(calls)]
                    c.update(body)
                    finish = "length" if job.score_only else d.finish_reason
                    if job.tools is not None:
                        finish = tool_calls.finish_reason(finish, bool(streams[job.index].num_calls))
                    c["finish_reason"] = finish if d.finished else None
                    yield chunk([c], served_by=_served_by(d) if d.finished else None)
                    # One loop pass per chunk: a client that left is then seen (its transport's
                    # connection_lost runs) before the next write, instead of after a burst of
                    # writes to a dead socket that asyncio logs one warning each.
                    await asyncio.sleep(0)
                if d.finished:
                    remaining -= 1
            if include_usage:
                yield chunk([], _usage(usage))
            yield "data: [DONE]\n\n"
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    add_responses_routes(app, fe)
    add_infill_routes(app, fe)
    add_anthropic_routes(app, fe)
    (http_limits or HttpLimits()).install(app, api_key, max_body_bytes)  # auth, body cap, CORS, origins
    return app
