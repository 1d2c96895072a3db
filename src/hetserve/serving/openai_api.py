"""OpenAI's completions and chat completions (and vLLM's /tokenize and /detokenize): bodies to
engine requests (streaming.py) and their deltas back to OpenAI's shapes: n choices, echo and
prompt scoring, logprobs (legacy and chat), vLLM's prompt_logprobs, tool calls, usage, SSE chunks."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from ..sampling_params import SamplingParams
from ..structured import StructuredOutputError
from . import tool_calls
from .frontend import Delta, Frontend
from .http_errors import APIError, error_body, unless_gone
from .infill import fim_prompt, fim_stops
from .protocol import MAX_PROMPTS, ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from .streaming import EngineRequest, admit, check_model, encode_chat, events, outcome, sse_data
from .tokenizer_service import TokenizeFailed


@dataclass
class _Job:
    """One choice of a request: the engine request it runs and its output state."""

    index: int
    req: EngineRequest  # its ids are shared by the prompt's n choices (usage counts them once)
    echo: str | None = None  # completions with echo: the prompt's text, shown first
    score_only: bool = False  # echo with max_tokens 0: one token is run for the prompt's scores, none shown
    want_prompt_logprobs: bool = False  # vLLM's prompt_logprobs field was given
    text_offset: int = 0  # characters of this choice's text so far (logprobs' text_offset)


    @property
    def ids(self) -> list[int]:
        return self.req.ids

    @property
    def params(self) -> SamplingParams:
        return self.req.params

    @property
    def tools(self) -> tool_calls.Tools | None:
        return self.req.tools


def add_openai_routes(app: FastAPI, fe: Frontend) -> None:
    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest, request: Request):
        check_model(fe, body.model)
        if body.messages is not None:
            msgs = [m.model_dump(exclude_none=True) for m in body.messages]
            ids = await encode_chat(request, fe, msgs, add_generation_prompt=body.add_generation_prompt,
                                    for_context=False)
        elif body.prompt is not None:
            ids = await _encode(request, body.prompt, body.parse_special, for_context=False)
        else:
            raise APIError(400, "give either prompt or messages", "prompt")
        return {"tokens": ids, "count": len(ids), "max_model_len": fe.max_model_len}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        check_model(fe, body.model)
        _check_ids(body.tokens, "tokens")
        return {"prompt": await fe.run_blocking(fe.tokenizer.decode, body.tokens, False)}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        check_model(fe, body.model)
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
        check_model(fe, body.model)
        if not body.messages:
            raise APIError(400, "messages must not be empty", "messages")
        msgs = [m.model_dump(exclude_none=True) for m in body.messages]
        try:
            tools = tool_calls.Tools.parse(body.tools, body.tool_choice, body.parallel_tool_calls)
        except tool_calls.ToolError as e:
            raise APIError(400, str(e), e.field) from None
        ids = await encode_chat(request, fe, msgs, tools, add_generation_prompt=body.add_generation_prompt)
        top = body.top_logprobs if body.top_logprobs is not None else (0 if body.logprobs else None)
        if body.top_logprobs is not None and not body.logprobs:
            raise APIError(400, "top_logprobs requires logprobs: true", "top_logprobs")
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        return await _serve(body, request, [ids], max_tokens, top, chat=True, tools=tools)

    def _check_ids(ids: list[int], param: str) -> None:
        vocab = fe.tokenizer.vocab_size
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise APIError(400, f"token id {bad} is outside the vocabulary [0, {vocab - 1}]", param)

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
            params = [body.sampling_params(1 if score_only else max_tokens, logprobs, i % body.n, structured)
                      for i in range(len(choice_prompts))]
        except ValueError as e:
            raise APIError(400, str(e)) from None
        reqs = []
        for p, ids in zip(params, choice_prompts):
            p.stop_token_ids = sorted(set(p.stop_token_ids) | stop_ids)
            if echo and logprobs is not None and p.prompt_logprobs is None:
                p.prompt_logprobs = logprobs  # echo + logprobs scores the prompt too
            _check_ids(list(p.logit_bias), "logit_bias")
            reqs.append(admit(fe, EngineRequest(ids, p, tools, cache_salt=body.cache_salt, worker=body.worker)))
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        created = int(time.time())
        echoes = {}
        if echo:
            for ids in prompts:
                echoes[id(ids)] = await fe.run_blocking(fe.tokenizer.decode, ids, False)
        jobs = [_Job(i, r, echoes.get(id(r.ids)), score_only, body.prompt_logprobs is not None)
                for i, r in enumerate(reqs)]
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(_stream(jobs, rid, created, chat, include_usage), media_type="text/event-stream")
        return await _collect(jobs, rid, created, chat, request)

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

    async def _collect(jobs: list["_Job"], rid, created, chat, request: Request):
        outs = await unless_gone(request, *(outcome(fe, j.req) for j in jobs))
        choices, usage = [], {"prompt_tokens": 0, "completion_tokens": 0, "cached_tokens": 0}
        seen_prompts = set()
        for out, job in zip(outs, jobs):
            last = out.last
            text, toks, lps = ("", [], []) if job.score_only else (out.text, out.token_ids, out.logprobs)
            body = _choice_body(job, text, toks, lps, chat, True, out.prompt_logprobs, True)
            choice = {"index": job.index}
            finish = "length" if job.score_only else last.finish_reason
            if chat:
                choice["message"] = {"role": "assistant", "content": body.pop("content")}
                if job.tools is not None:
                    choice["message"]["tool_calls"] = out.calls
                    finish = tool_calls.finish_reason(finish, bool(out.calls))
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

    async def _stream(jobs: list["_Job"], rid, created, chat, include_usage):
        queue: asyncio.Queue = asyncio.Queue()
        obj = "chat.completion.chunk" if chat else "text_completion"

        async def pump(job: _Job):
            try:
                async with contextlib.aclosing(events(fe, job.req)) as evs:
                    async for ev in evs:
                        await queue.put((job, ev))
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
        num_calls: dict[int, int] = {}  # choices with tools: their calls so far
        remaining = len(jobs)
        try:
            if chat:
                yield chunk([{"index": j.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                              "finish_reason": None} for j in jobs])
            while remaining:
                job, ev = await queue.get()
                if isinstance(ev, APIError):
                    remaining -= 1
                    yield sse_data(error_body(ev.status, ev.message))
                    continue
                d = ev.delta
                text, toks, lps = _shown(job, d)
                usage["completion_tokens"] += len(toks)
                if d.finished and id(job.ids) not in cached_seen:
                    cached_seen.add(id(job.ids))
                    usage["cached_tokens"] += d.num_cached_tokens
                first = job.index not in started
                started.add(job.index)
                body = _choice_body(job, text, toks, lps, chat, first, d.prompt_logprobs, d.finished)
                calls = ev.calls
                if job.tools is not None:
                    body["content"] = ev.text
                    num_calls[job.index] = num_calls.get(job.index, 0) + len(calls)
                shows = text if job.tools is None else body["content"] or calls
                if shows or d.finished or body.get("logprobs") or (first and job.echo is not None):
                    c = {"index": job.index}
                    if chat:
                        content = body.pop("content")
                        c["delta"] = {"content": content} if content else {}
                        if calls:
                            base = num_calls[job.index] - len(calls)
                            c["delta"]["tool_calls"] = [{"index": base + i, **call} for i, call in enumerate(calls)]
                    c.update(body)
                    finish = "length" if job.score_only else d.finish_reason
                    if job.tools is not None:
                        finish = tool_calls.finish_reason(finish, bool(num_calls[job.index]))
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

