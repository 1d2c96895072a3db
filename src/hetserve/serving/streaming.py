"""What every route streams through: SSE framing, and one request's engine stream with its
failures as API errors."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator

from ..sampling_params import SamplingParams
from .frontend import Delta, Frontend, RequestFailed, ServiceUnavailable
from .http_errors import APIError

# Characters JSON leaves unescaped but line splitters that follow str.splitlines (httpx's
# aiter_lines among them) break lines at: escaped, so an SSE event is always one line.
_LINE_BREAKS = str.maketrans({"\u2028": "\\u2028", "\u2029": "\\u2029", "\x85": "\\u0085"})


def sse_data(body: dict) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False).translate(_LINE_BREAKS)}\n\n"


async def deltas(fe: Frontend, ids: list[int], params: SamplingParams, **route) -> AsyncIterator[Delta]:
    """One request's deltas for a route: a failure is an APIError (503 for a worker or the server
    unavailable, 400 for what the request asked), and a consumer that stops (a cancel, a client
    gone) aborts the request now, not when the generator is collected."""
    try:
        async with contextlib.aclosing(fe.generate(ids, params, **route)) as gen:
            async for d in gen:
                yield d
    except (ServiceUnavailable, RequestFailed) as e:
        raise APIError(503, str(e)) from None
    except ValueError as e:
        raise APIError(400, str(e)) from None
