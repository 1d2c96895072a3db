"""llama.cpp's `POST /infill`, the route editor plugins (llama.vim, llama.vscode) complete code
with: the text before and after the cursor (`input_prefix`, `input_suffix`), other files of the
repository (`input_extra`, `[{filename, text}]`) and what was typed since (`prompt`), laid out as
the model's fill-in-the-middle prompt (models/fim.py); the answer in llama.cpp's completion shape
(`content`, `stop`, `tokens_predicted`, `tokens_evaluated`, `tokens_cached`, `truncated`,
`stop_type`, `timings`), streamed as its SSE events or not. A request whose client leaves (the
user typed on) is aborted at once. `/v1/completions` with `suffix` uses the same prompt.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, Field

from .frontend import Delta, Frontend
from .http_errors import APIError, error_body, unless_gone
from .protocol import _Sampling
from .streaming import EngineRequest, admit, check_model, collect, events, sse_data
from .tokenizer_service import TokenizeFailed

MAX_EXTRA = 256  # other files in one request
DEFAULT_N_PREDICT = 256  # the context a request without n_predict leaves for its answer


class ExtraFile(BaseModel):
    filename: str = "file"
    text: str = ""


class InfillRequest(_Sampling):
    """llama.cpp's /infill body; its other fields (n_indent, samplers, cache_prompt, t_max_*,
    response_fields, id_slot, ...) are accepted and ignored. Sampling defaults are llama.cpp's."""

    input_prefix: str = ""
    input_suffix: str = ""
    input_extra: list[ExtraFile] = Field(default_factory=list, max_length=MAX_EXTRA)
    prompt: str = ""  # appended to the prefix: the text typed since input_prefix was taken
    filename: str | None = None  # hetserve: the current file's path, in the repository layout
    n_predict: int = -1  # -1: up to the context
    temperature: float | None = 0.8
    top_k: int | None = 40
    top_p: float | None = 0.95
    min_p: float | None = 0.05


async def fim_prompt(request: Request, fe: Frontend, prefix: str, suffix: str, extra: list[dict],
                     filename: str | None, max_tokens: int | None) -> tuple[list[int], bool]:
    """(ids, truncated) of a fill-in-the-middle prompt, or a 400 (a model without FIM tokens)."""
    try:
        (ids, truncated), = await unless_gone(request, fe.encode_infill(
            prefix, suffix, extra, filename, DEFAULT_N_PREDICT if max_tokens is None else max_tokens))
    except (TokenizeFailed, ValueError) as e:
        raise APIError(400, str(e), "input_prefix") from None
    return ids, truncated


def fim_stops(fe: Frontend) -> set[int]:
    return fe.tokenizer.fim.stops if fe.tokenizer.fim else set()


def add_infill_routes(app: FastAPI, fe: Frontend) -> None:
    @app.post("/infill")
    async def infill(body: InfillRequest, request: Request):
        check_model(fe, body.model)
        max_tokens = None if body.n_predict < 0 else body.n_predict
        ids, truncated = await fim_prompt(request, fe, body.input_prefix + body.prompt, body.input_suffix,
                                          [x.model_dump() for x in body.input_extra], body.filename, max_tokens)
        try:
            params = body.sampling_params(max_tokens, None, 0, body.constraint())
        except ValueError as e:
            raise APIError(400, str(e)) from None
        params.stop_token_ids = sorted(set(params.stop_token_ids) | fim_stops(fe))
        req = admit(fe, EngineRequest(ids, params, cache_salt=body.cache_salt, worker=body.worker))
        t0 = time.perf_counter()

        def summary(text: str, n: int, last: Delta, first: float) -> dict:
            end = time.perf_counter()
            prompt_n = len(ids) - last.num_cached_tokens
            prompt_ms, predicted_ms = 1e3 * (first - t0), 1e3 * (end - first)
            return {
                "index": 0, "content": text, "tokens": [], "stop": True, "model": fe.model_name,
                "tokens_predicted": n, "tokens_evaluated": len(ids), "tokens_cached": last.num_cached_tokens,
                "truncated": truncated, "has_new_line": "\n" in text,
                "stop_type": "limit" if last.finish_reason == "length" else "eos", "stopping_word": "",
                "timings": {"prompt_n": prompt_n, "prompt_ms": prompt_ms,
                            "prompt_per_token_ms": prompt_ms / max(prompt_n, 1),
                            "prompt_per_second": 1e3 * prompt_n / prompt_ms if prompt_ms > 0 else None,
                            "predicted_n": n, "predicted_ms": predicted_ms,
                            "predicted_per_token_ms": predicted_ms / max(n, 1),
                            "predicted_per_second": 1e3 * n / predicted_ms if predicted_ms > 0 else None},
            }

        if body.stream:
            async def stream() -> AsyncIterator[str]:
                parts, n, last, first = [], 0, None, None
                try:
                    async with contextlib.aclosing(events(fe, req)) as evs:  # a client gone stops the work now
                        async for ev in evs:
                            d = ev.delta
                            first = first or time.perf_counter()
                            n, last = n + len(d.token_ids), d
                            parts.append(d.text)
                            if d.text and not d.finished:
                                yield sse_data({"index": 0, "content": d.text, "tokens": d.token_ids, "stop": False,
                                                "tokens_predicted": n, "tokens_evaluated": len(ids)})
                except APIError as e:  # the headers are sent: the failure is the stream's last event
                    yield sse_data(error_body(e.status, e.message))
                    return
                final = summary("".join(parts), n, last, first)
                final["content"] = last.text  # the last delta's text, with the summary
                yield sse_data(final)

            return StreamingResponse(stream(), media_type="text/event-stream")

        out = await collect(request, fe, req)
        return summary(out.text, out.num_tokens, out.last, out.first_token_at)
