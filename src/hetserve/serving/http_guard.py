"""HTTP hardening of `hetserve serve`: API key and body cap, CORS and a cross-origin check, header limits, and a
uvicorn protocol with request deadlines and a per-client connection cap.

The server binds loopback, so every web page a local browser opens can reach it: with no --allowed-origins only
pages served by this server itself (same origin) may call it.
"""

from __future__ import annotations

import hmac
import json
from dataclasses import dataclass
from http import HTTPStatus

import h11
from starlette.middleware.cors import CORSMiddleware
from uvicorn.protocols.http.h11_impl import H11Protocol

from .http_errors import RETRY_AFTER_S, error_body, error_response


def _raw_error(status: int, message: str) -> bytes:
    """A whole HTTP/1.1 error response with `Connection: close`, for the protocol to write outside any request."""
    body = json.dumps(error_body(status, message)).encode()
    retry = f"retry-after: {RETRY_AFTER_S}\r\n" if status == 503 else ""
    return (f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\n{retry}connection: close\r\n\r\n").encode() + body


@dataclass(frozen=True)
class HttpLimits:
    allowed_origins: tuple[str, ...] = ()  # "*" allows any
    max_headers: int = 100
    max_header_bytes: int = 32 << 10
    header_timeout: float = 10.0  # seconds to receive a request's head
    body_timeout: float = 30.0  # seconds from the head to the body's end
    max_connections_per_client: int = 128

    @classmethod
    def from_args(cls, args) -> HttpLimits:
        return cls(parse_origins(args.allowed_origins), args.max_headers, args.max_header_bytes,
                   args.http_header_timeout, args.http_body_timeout, args.max_connections_per_client)

    def install(self, app, api_key: str | None, max_body_bytes: int) -> None:
        """Add the middlewares to a Starlette/FastAPI app; each add goes outside the previous one."""
        app.add_middleware(LimitsAndAuth, api_key=api_key, max_body_bytes=max_body_bytes)
        if self.allowed_origins:
            # Outside the API key check: a browser's preflight never carries Authorization, it asks whether it may.
            # Any requested header is allowed (mirrored; that includes Authorization, Content-Type and the openai JS
            # client's x-stainless-*): the origin is what is trusted.
            app.add_middleware(CORSMiddleware, allow_origins=list(self.allowed_origins), allow_headers=["*"],
                               allow_methods=["GET", "POST", "DELETE", "OPTIONS"], expose_headers=["Retry-After"])
        app.add_middleware(RequestGuard, limits=self)

    def uvicorn_kwargs(self) -> dict:
        # A subclass per server: its connections share one count per client IP.
        proto = type("GuardedH11Protocol", (GuardedH11Protocol,), {"limits": self, "per_client": {}})
        # No WebSocket routes: with ws off an upgrade never leaves this protocol (and its per-client count).
        return {"http": proto, "ws": "none", "h11_max_incomplete_event_size": self.max_header_bytes}


def parse_origins(spec: str | None) -> tuple[str, ...]:
    return tuple(o.strip().rstrip("/").lower() for o in (spec or "").split(",") if o.strip())


def _origin(scheme: str, hostport: str) -> str:
    """scheme://host[:port] as browsers serialize an Origin: lower case, no default port."""
    default = {"http": ":80", "https": ":443"}.get(scheme)
    hostport = hostport.lower()
    return f"{scheme}://{hostport.removesuffix(default) if default else hostport}"


class RequestGuard:
    """ASGI middleware, outermost: 431 for too many or too large headers, 403 for a request from a web page of an
    origin that is neither this server's nor allowed.

    CORS alone does not protect a server: a page on any site can send a "simple" cross-site POST (form or
    text/plain content type, no preflight) and the browser delivers it, only hiding the answer, so the request would
    still run (and cost compute). Browsers send Origin on every cross-origin request and on same-origin POSTs, so
    refusing unknown origins here stops those; a page served by this server (same scheme://host:port as the request's
    Host) keeps working, and clients that are not browsers send no Origin."""

    def __init__(self, app, limits: HttpLimits):
        self.app, self.limits = app, limits
        self.any_origin = "*" in limits.allowed_origins
        self.origins = frozenset(limits.allowed_origins)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = scope["headers"]
        size = sum(len(k) + len(v) + 4 for k, v in headers)  # the head as sent, "name: value\r\n"
        if len(headers) > self.limits.max_headers or size > self.limits.max_header_bytes:
            return await error_response(431, f"request header fields too large (at most {self.limits.max_headers} "
                                            f"fields, {self.limits.max_header_bytes} bytes)")(scope, receive, send)
        h = {k: v for k, v in headers if k in (b"origin", b"host")}
        origin = h.get(b"origin", b"").decode("latin-1").strip().lower()
        if origin and not self.any_origin and origin not in self.origins and \
                origin != _origin(scope["scheme"], h.get(b"host", b"").decode("latin-1")):
            return await error_response(403, f"origin {origin!r} is not allowed (see --allowed-origins)")(
                scope, receive, send)
        await self.app(scope, receive, send)


def _public(path: str) -> bool:
    """Routes without the API key: /health, and the web page's static files and icon (they hold no data; the
    page asks for the key and sends it on its API calls)."""
    return path in ("/health", "/", "/favicon.ico") or path.startswith("/static/")


class LimitsAndAuth:
    """ASGI middleware: API key on every route but the public ones (decided on the path, compared in constant time)
    and a cap on the request body size (413)."""

    def __init__(self, app, api_key: str | None, max_body_bytes: int):
        self.app, self.api_key, self.max_body = app, api_key, max_body_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        path = scope["path"]
        if self.api_key and not _public(path):
            # Bearer, or x-api-key (the Anthropic clients' header): either one, compared in constant time.
            bearer = headers.get(b"authorization", b"").decode("latin-1")
            key = headers.get(b"x-api-key", b"").decode("latin-1")
            ok = hmac.compare_digest(bearer.encode(), f"Bearer {self.api_key}".encode())
            ok |= hmac.compare_digest(key.encode(), self.api_key.encode())
            if not ok:
                return await error_response(401, "missing or invalid API key (Authorization: Bearer ... or "
                                                 "x-api-key)", path=path)(scope, receive, send)
        too_large = error_response(413, f"request body over {self.max_body} bytes", path=path)
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body:
            return await too_large(scope, receive, send)  # before reading any of it
        # A streamed (chunked) body is read here, up to the cap, and replayed to the app: over the cap it gets 413
        # before the app sees it. Bodies are capped at a few MB, so buffering one is fine.
        chunks, size, more = [], 0, True
        while more:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return
            chunks.append(msg.get("body", b""))
            size, more = size + len(chunks[-1]), msg.get("more_body", False)
            if size > self.max_body:
                return await too_large(scope, receive, send)
        body = [{"type": "http.request", "body": b"".join(chunks), "more_body": False}]

        async def replay():
            return body.pop() if body else await receive()  # then disconnects, as before

        await self.app(scope, replay, send)


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with deadlines and a per-client connection cap.

    A request's head must arrive within header_timeout of the connection opening or of the previous response, and
    its body within body_timeout of the head: deadlines, not idle timers, so a client trickling a byte at a time
    cannot hold a connection (uvicorn's keep-alive timer restarts on every byte and a new connection has none). On
    expiry: 408 where no answer was started, then close. Connections from one IP beyond the cap get 503 and close.
    """

    limits: HttpLimits  # these two are set on the per-server subclass (HttpLimits.uvicorn_kwargs)
    per_client: dict[str, int]
    _phase: str | None = None  # "head" or "body": what the running deadline waits for
    _timer = None
    _ip: str | None = None  # counted in per_client

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        ip = self.client[0] if self.client else None
        if ip is not None:
            if self.per_client.get(ip, 0) >= self.limits.max_connections_per_client:
                transport.write(_raw_error(503, "too many connections from this client"))
                transport.close()
                return
            self.per_client[ip], self._ip = self.per_client.get(ip, 0) + 1, ip
        self._sync_deadline()

    def connection_lost(self, exc) -> None:
        self._set_phase(None)
        if self._ip is not None:
            left = self.per_client.pop(self._ip) - 1
            if left:
                self.per_client[self._ip] = left
            self._ip = None
        super().connection_lost(exc)

    def handle_events(self) -> None:
        # Every change of the peer's h11 state (a head or a body's end received, a new cycle started) happens in
        # here, called on data and after each response.
        super().handle_events()
        self._sync_deadline()

    def send_400_response(self, msg: str) -> None:
        if len(self.conn.trailing_data[0]) > self.limits.max_header_bytes:  # h11: head over its buffer cap
            self.transport.write(_raw_error(431, f"request head over {self.limits.max_header_bytes} bytes"))
            self.transport.close()
        else:
            super().send_400_response(msg)

    def _sync_deadline(self) -> None:
        if not self.transport.is_closing():
            self._set_phase({h11.IDLE: "head", h11.SEND_BODY: "body"}.get(self.conn.their_state))

    def _set_phase(self, phase: str | None) -> None:
        if phase == self._phase:
            return  # the running deadline stands
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._phase = phase
        if phase is not None:
            timeout = self.limits.header_timeout if phase == "head" else self.limits.body_timeout
            self._timer = self.loop.call_later(timeout, self._expired)

    def _expired(self) -> None:
        phase, self._phase, self._timer = self._phase, None, None
        if self.transport.is_closing():
            return
        cycle = self.cycle if phase == "body" else None
        if cycle is not None and not cycle.response_started:
            cycle.disconnected = True  # the app's receive() returns http.disconnect, its sends are dropped
            cycle.message_event.set()
            self.transport.write(_raw_error(408, f"request body not received within {self.limits.body_timeout} s"))
        elif phase == "head" and self.conn.trailing_data[0]:  # part of a head came; an idle connection just closes
            self.transport.write(_raw_error(408, f"request head not received within {self.limits.header_timeout} s"))
        self.transport.close()
