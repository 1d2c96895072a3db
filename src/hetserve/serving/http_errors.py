"""Errors of the HTTP server in the shape of the API called (OpenAI's, or Anthropic's on its
routes): their JSON bodies, status types and Retry-After; and the end of a request whose client
left. Shared by the routes and the HTTP hardening below them (http_guard.py)."""

from __future__ import annotations

import asyncio

from fastapi import Request
from fastapi.responses import JSONResponse

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          413: "request_too_large", 422: "invalid_request_error", 500: "internal_error",
          503: "service_unavailable"}
RETRY_AFTER_S = 1  # what a 503 (queue full, no worker) tells clients to wait before retrying


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": _TYPES.get(status, "error"), "param": param,
                      "code": code if code is not None else status}}


# Anthropic's error types by status (its Messages API's envelope: {"type": "error", "error": {type, message}})
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
                    503: "overloaded_error"}
ANTHROPIC_PATHS = ("/v1/messages",)  # the routes that answer in Anthropic's shape


def anthropic_error_body(status: int, message: str) -> dict:
    return {"type": "error", "error": {"type": _ANTHROPIC_TYPES.get(status, "api_error"), "message": message}}


def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                   path: str = "") -> JSONResponse:
    """The error in the shape of the API that was called (`path`): Anthropic's, else OpenAI's."""
    headers = {"Retry-After": str(RETRY_AFTER_S)} if status == 503 else None
    body = anthropic_error_body(status, message) if path.startswith(ANTHROPIC_PATHS) else \
        error_body(status, message, param, code)
    return JSONResponse(body, status_code=status, headers=headers)


class ClientGone(Exception):
    """The client closed the connection before its answer: nothing to send, one log line."""


async def unless_gone(request: Request, *work):
    """The results of `work` (awaitables run together); a client that leaves first cancels all of it and gets
    ClientGone. Starlette cancels only a stream whose client leaves, so this awaits the ASGI disconnect message
    itself: an answer stops at once, not at the next poll (a 0.2 s poll let a short answer run to its end), and an
    abandoned tokenizer job that is still queued never runs (it must not hold the tokenizer for the others)."""
    tasks = [asyncio.ensure_future(w) for w in work]

    async def disconnected():  # the body is read by now: the next message is the disconnect
        while (await request.receive())["type"] != "http.disconnect":
            pass

    listener = asyncio.ensure_future(disconnected())
    try:
        pending = {listener, *tasks}
        while pending - {listener}:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            if listener in done:
                raise ClientGone()
            for t in done:
                t.result()  # the first failure ends the whole (the others are cancelled below)
        return [t.result() for t in tasks]
    finally:
        for t in (listener, *tasks):
            t.cancel()
        await asyncio.gather(listener, *tasks, return_exceptions=True)
