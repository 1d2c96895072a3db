"""`hetserve serve`'s HTTP hardening end to end: CORS and the origin check, header limits, a streamed body over the
cap, request deadlines against slow clients, the per-client connection cap."""

from __future__ import annotations

import json
import select
import socket
import time

import httpx
import pytest
from test_server import Server

ALLOWED = "http://allowed.example"
PER_CLIENT = 8


@pytest.fixture(scope="module")
def server(tiny_qwen2):
    """One server with all the short settings."""
    s = Server(tiny_qwen2, "--kv-cache-memory", "8MiB", "--allowed-origins", ALLOWED, "--http-header-timeout", "1",
               "--http-body-timeout", "1", "--max-connections-per-client", str(PER_CLIENT))
    yield s
    assert s.stop() == 0


def connect(server) -> socket.socket:
    return socket.create_connection(("127.0.0.1", server.port), timeout=60)  # only an upper bound on each wait


def read_response(s: socket.socket) -> tuple[int | None, dict, bytes]:
    """(status, headers, body) of one response; status None if the connection closed without one."""
    data = b""
    while b"\r\n\r\n" not in data:
        try:
            got = s.recv(65536)
        except ConnectionResetError:
            got = b""
        if not got:
            return None, {}, data
        data += got
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    while len(body) < int(headers.get("content-length", 0)):
        body += s.recv(65536)
    return int(lines[0].split()[1]), headers, body


def trickle_until_answer(s: socket.socket, limit_s: float = 10) -> float:
    """Send a byte every 0.2 s (an idle timer would never fire) until the server answers; returns the seconds.
    The server's deadlines here are 1 s: `limit_s` is that plus room for a loaded host's timer lag, far
    below forever (an idle timer, reset by each byte, never answers)."""
    t0 = time.monotonic()
    while not select.select([s], [], [], 0.2)[0]:
        s.sendall(b"x")
        assert time.monotonic() - t0 < limit_s, "the server kept a trickling connection open"
    return time.monotonic() - t0


def preflight(url: str, origin: str) -> httpx.Response:
    return httpx.options(url + "/v1/chat/completions", headers={
        "Origin": origin, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type"})


def assert_cors_ok(r: httpx.Response) -> None:
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ALLOWED
    allowed = {h.strip().lower() for h in r.headers["access-control-allow-headers"].split(",")}
    assert {"authorization", "content-type"} <= allowed and "POST" in r.headers["access-control-allow-methods"]


def test_preflight(server):
    assert_cors_ok(preflight(server.url, ALLOWED))
    other = preflight(server.url, "http://evil.example")
    assert other.status_code == 403 and "access-control-allow-origin" not in other.headers


def test_preflight_with_api_key(tiny_qwen2):
    s = Server(tiny_qwen2, "--kv-cache-memory", "8MiB", "--api-key", "sekret", "--allowed-origins", ALLOWED)
    try:
        assert_cors_ok(preflight(s.url, ALLOWED))  # a preflight carries no key: it must not get 401
        r = httpx.get(s.url + "/v1/models", headers={"Origin": ALLOWED})
        assert r.status_code == 401 and r.headers["access-control-allow-origin"] == ALLOWED  # the page can read it
        r = httpx.get(s.url + "/v1/models", headers={"Origin": ALLOWED, "Authorization": "Bearer sekret"})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ALLOWED
        assert httpx.get(s.url + "/v1/models", headers={"Origin": "http://evil.example"}).status_code == 403
    finally:
        assert s.stop() == 0


def test_cross_origin_refused_same_origin_works(server):
    body = {"prompt": "x", "max_tokens": 1}
    url = server.url + "/v1/completions"
    for origin in ("http://evil.example", "null", f"http://localhost:{server.port}"):
        r = httpx.post(url, json=body, headers={"Origin": origin}, timeout=60)
        assert r.status_code == 403 and r.json()["error"]["code"] == 403, origin
    # a "simple" request (text/plain, no preflight): a browser sends it cross-site, and it must not run
    r = httpx.post(url, content=json.dumps(body), headers={"Origin": "http://evil.example",
                                                           "Content-Type": "text/plain"})
    assert r.status_code == 403
    assert httpx.post(url, json=body, headers={"Origin": server.url}, timeout=60).status_code == 200  # served here
    r = httpx.post(url, json=body, headers={"Origin": ALLOWED}, timeout=60)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ALLOWED
    assert httpx.post(url, json=body, timeout=60).status_code == 200  # no Origin: not a browser


def test_header_limits(server):
    r = httpx.get(server.url + "/v1/models", headers=[(f"x-h{i}", "v") for i in range(1000)])
    assert r.status_code == 431 and r.json()["error"]["code"] == 431
    with connect(server) as s:  # a head over the byte cap that never ends: h11's buffer cap
        s.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (40 << 10))
        status, _, body = read_response(s)
    assert status == 431 and json.loads(body)["error"]["code"] == 431


def test_chunked_body_over_cap_gets_413(server):
    chunk = b"a" * (1 << 16)
    frame = b"%x\r\n%s\r\n" % (len(chunk), chunk)
    sent = 0
    with connect(server) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Transfer-Encoding: chunked\r\n\r\n")
        while sent < 50 << 20 and not select.select([s], [], [], 0)[0]:  # stop when the answer comes
            s.sendall(frame)
            sent += len(chunk)
        status, _, body = read_response(s)
    assert status == 413 and json.loads(body)["error"]["type"] == "request_too_large"
    # Answered long before the 50 MB were sent (how far past the 4 MiB cap depends on the socket buffers
    # and the scheduling of a loaded machine: 9.6 MB seen).
    assert sent < 32 << 20


def test_header_trickle_and_idle_connection_closed(server):
    with connect(server) as s:
        s.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n")
        trickle_until_answer(s)
        status, headers, body = read_response(s)
        assert status == 408 and headers["connection"] == "close" and json.loads(body)["error"]["code"] == 408
        try:
            assert s.recv(1) == b""
        except ConnectionResetError:  # closed with trickled bytes unread: a reset, closed all the same
            pass
    with connect(server) as s:  # connected, nothing sent: closed without an answer
        t0 = time.monotonic()
        assert s.recv(1) == b"" and time.monotonic() - t0 < 10  # the 1 s deadline, room for a loaded host
    assert httpx.get(server.url + "/v1/models").status_code == 200


def test_body_trickle_gets_408(server):
    with connect(server) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 1000\r\n\r\n{")
        trickle_until_answer(s)
        status, _, body = read_response(s)
    assert status == 408 and json.loads(body)["error"]["code"] == 408
    assert httpx.get(server.url + "/v1/models").status_code == 200


def test_connections_per_client_capped(tiny_qwen2):
    # A server of its own with the default head deadline (10 s): the module's 1 s one closes idle connections,
    # which on a stalled host could free the PER_CLIENT before the extra one tries
    server = Server(tiny_qwen2, "--kv-cache-memory", "8MiB", "--max-connections-per-client", str(PER_CLIENT))
    try:
        deadline = time.monotonic() + 60  # until the server has seen its start-up checks' connections go: polled
        while True:
            socks = [connect(server) for _ in range(PER_CLIENT)]
            for s in socks:
                s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            statuses = [read_response(s)[0] for s in socks]
            if statuses == [200] * PER_CLIENT or time.monotonic() > deadline:
                break
            for s in socks:
                s.close()
            time.sleep(0.1)
        try:
            assert statuses == [200] * PER_CLIENT
            with connect(server) as extra:
                status = read_response(extra)[0]
                assert status in (503, None) and extra.recv(1) == b""
        finally:
            for s in socks:
                s.close()
        deadline = time.monotonic() + 60  # the closes are seen in the server's own time: polled
        while True:
            try:
                status = httpx.get(server.url + "/health", timeout=60).status_code
            except httpx.HTTPError as e:  # over the cap: closed without an answer
                status = e
            if status == 200 or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert status == 200
    finally:
        assert server.stop() == 0
