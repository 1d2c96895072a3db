"""`hetserve serve`: start the workers, run uvicorn, drain on SIGTERM.

SIGTERM (or Ctrl-C): stop accepting work (/health 503, new requests 503), let requests in
flight finish for up to --shutdown-timeout seconds, end the rest with a final error event,
stop the workers and exit 0. A second signal exits at once.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import sys
import time

from ..flags import add_engine_flags, add_model_flag, engine_kwargs

log = logging.getLogger("hetserve.server")


def _server_class():
    import uvicorn  # imported here so that the other CLI commands start fast

    return type("_Server", (_DrainOnSignal, uvicorn.Server), {})


class _DrainOnSignal:
    def __init__(self, config, frontend, shutdown_timeout: float):
        super().__init__(config)
        self.frontend = frontend
        self.shutdown_timeout = shutdown_timeout
        self._draining_task = None
        self.exit_deadline: float | None = None

    def handle_exit(self, sig, frame) -> None:
        if self.frontend.draining or self._draining_task is not None:
            return super().handle_exit(sig, frame)
        self.frontend.draining = True
        loop = asyncio.get_event_loop()
        self._draining_task = loop.create_task(self._drain())

    async def _drain(self) -> None:
        # The whole exit fits in --shutdown-timeout: requests get it less a reserve for what comes
        # after them (final error events, uvicorn's graceful close, stopping the workers).
        self.exit_deadline = time.monotonic() + self.shutdown_timeout
        deadline = self.exit_deadline - min(3.0, self.shutdown_timeout / 2)
        while self.frontend.streams and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for rid in list(self.frontend.streams):
            self.frontend._fail(rid, "the server is shutting down")
        await asyncio.sleep(0.2)  # let streams write their final error event
        self.should_exit = True


def run(args) -> int:
    import uvicorn

    from . import placement
    from .api_server import build_app
    from .frontend import Frontend
    from .http_guard import HttpLimits
    from .process_exit import exit_now

    kw = engine_kwargs(args)
    devices = kw.pop("device") or ["cpu"]
    dtype = kw.pop("dtype")
    api_key = args.api_key or os.environ.get("HETSERVE_API_KEY") or None
    profiles = []
    for path in args.profile:
        with open(path) as f:
            profiles.append(json.load(f))
    frontend = Frontend(args.model, kw, devices=devices, dtype=dtype, max_queued_requests=args.max_queued_requests,
                        route_policy=args.route_policy, route_log=args.route_log, profiles=profiles,
                        measure_profiles=args.startup_profile, disaggregate=args.disaggregate,
                        transfer_bytes_per_s=args.kv_transfer_rate, tokenizer_processes=args.tokenizer_processes,
                        tokenize_timeout=args.tokenize_timeout, worker_timeout=args.worker_timeout,
                        ray_address=args.ray_address, ray_restarts=args.ray_restarts,
                        worker_restarts=args.worker_restarts,
                        infill_suffix_tokens=args.infill_suffix_tokens or None,
                        profile_refine=args.profile_refine == "on", profile_probe_s=args.profile_probe_s)
    pool = frontend.pool
    if pool.api_cores:  # off the CPU workers' cores, with the tokenizer processes it starts
        placement.pin_process(pool.api_cores)
    if placed := placement.describe(pool.specs, pool.placements, pool.api_cores):
        print(f"hetserve: {placed}", file=sys.stderr, flush=True)

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        try:
            await frontend.start()
        except RuntimeError as e:  # a worker stopped while loading (it has printed why) or timed out
            print(f"error: {e}", file=sys.stderr, flush=True)
            await frontend.shutdown(timeout=5.0)
            exit_now(3)  # one line, not uvicorn's traceback of a failed startup
        print(f"hetserve: serving {frontend.model_name} on http://{args.host}:{args.port} "
              f"({', '.join(devices)}; route policy {frontend.route_policy})", file=sys.stderr, flush=True)
        if len(frontend.workers) > 1:
            for name, prof in frontend.worker_profiles().items():
                rates = lambda pts: ", ".join(f"{n}: {r:.1f}" for n, r in pts)  # noqa: E731
                spread = prof.get("spread")
                sure = f" (rounds agree within {100 * spread['worst']:.0f}%)" if spread else ""
                print(f"hetserve: worker {name} ({prof['device']}): prefill tok/s {{{rates(prof['prefill'])}}}, "
                      f"decode tok/s by batch {{{rates(prof['decode'])}}}{sure}", file=sys.stderr, flush=True)
        yield
        end = server.exit_deadline
        await frontend.shutdown(timeout=10.0 if end is None else max(0.5, end - time.monotonic() - 0.2))

    limits = HttpLimits.from_args(args)
    app = build_app(frontend, api_key=api_key, max_body_bytes=args.max_body_bytes, lifespan=lifespan,
                    http_limits=limits)

    config = uvicorn.Config(app, host=args.host, port=args.port, log_level="warning", access_log=False,
                            timeout_graceful_shutdown=1, **limits.uvicorn_kwargs())
    server = _server_class()(config, frontend, args.shutdown_timeout)
    server.run()
    if server.exit_deadline is not None:  # drained on a signal: the exit is within --shutdown-timeout
        exit_now(0)
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    add_model_flag(p)
    p.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' (or set HETSERVE_API_KEY)")
    p.add_argument("--max-queued-requests", type=int, default=256, help="beyond this many waiting requests: 503")
    p.add_argument("--max-body-bytes", type=int, default=4 << 20, help="larger request bodies get 413")
    p.add_argument("--allowed-origins", default="", metavar="ORIGIN,...",
                   help="web origins (scheme://host:port, or *) whose pages may call the server (CORS); requests "
                        "from other origins get 403 (default: none, only pages served by this server)")
    p.add_argument("--max-headers", type=int, default=100, help="requests with more header fields get 431")
    p.add_argument("--max-header-bytes", type=int, default=32 << 10, help="larger request heads get 431")
    p.add_argument("--http-header-timeout", type=float, default=10.0,
                   help="seconds a connection has to send a request's head, from connecting or from the "
                        "previous response (then 408 and close)")
    p.add_argument("--http-body-timeout", type=float, default=30.0,
                   help="seconds from a request's head to the end of its body (then 408 and close)")
    p.add_argument("--max-connections-per-client", type=int, default=128,
                   help="connections from one IP address beyond this get 503 and are closed")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="on SIGTERM, seconds until the server has exited (requests in flight get most of it)")
    p.add_argument("--tokenizer-processes", type=int, default=2,
                   help="processes that tokenize and render chat templates, off the event loop")
    p.add_argument("--tokenize-timeout", type=float, default=10.0,
                   help="seconds one tokenization or template rendering may take (then 400, process restarted)")
    p.add_argument("--infill-suffix-tokens", type=int, default=256,
                   help="tokens of the text after the cursor a fill-in-the-middle prompt keeps (it is computed "
                        "again at every keystroke; llama.cpp keeps about a quarter of its batch); 0: all")
    p.add_argument("--worker-timeout", type=float, default=15.0,
                   help="a worker silent for this long (no heartbeat) is declared dead: its requests fail (503)")
    p.add_argument("--worker-restarts", type=int, default=3,
                   help="times a dead local worker is started again, after a back-off (1 s, doubling to 30 s); "
                        "it loads the model and rejoins with an empty cache (0: a dead worker stays dead)")
    g = p.add_argument_group("Ray (ray:cpu, ray:cuda devices)")
    g.add_argument("--ray-address", default=None,
                   help="the Ray cluster of ray: workers: auto, ray://host:port or host:port (default: start a local one)")
    g.add_argument("--ray-restarts", type=int, default=0,
                   help="times Ray restarts a dead worker actor; a restarted worker loads the model and rejoins")
    r = p.add_argument_group("routing (several --inference-device values)")
    r.add_argument("--route-policy", default=None,
                   help="cost (default with several workers), round-robin, least-loaded or force:<worker> "
                        "(workers are named cpu0, cuda1, ... by kind and position)")
    r.add_argument("--route-log", default=None, help="append one JSON line per routed request to this file")
    r.add_argument("--profile", action="append", default=[],
                   help="a worker profile from `hetserve profile` (repeatable; matched by --inference-device)")
    r.add_argument("--startup-profile", action=argparse.BooleanOptionalAction, default=True,
                   help="workers without --profile measure a short profile at start-up (a few seconds; "
                        "one worker of the machine at a time, in rounds until they agree within 10%%)")
    r.add_argument("--profile-refine", choices=("on", "off"), default="on",
                   help="on: the router follows each worker's speed from the steps it runs (a decayed "
                        "average, at most 25%% a step); off: the start-up or given profiles are trusted as they are")
    r.add_argument("--profile-probe-s", type=float, default=2.0,
                   help="an idle worker times a short run this often, so that the router sees a worker it "
                        "stopped sending work to recover (0: never)")
    r.add_argument("--disaggregate", default=None, metavar="prefill=WORKER,decode=WORKER",
                   help="prefill every request on one worker and decode it on another (the KV pages move "
                        "between them), e.g. prefill=cpu0,decode=cpu1; or auto: the router splits a request "
                        "when the workers' profiles say the estimated KV transfer is repaid")
    r.add_argument("--kv-transfer-rate", type=float, default=1e9,
                   help="bytes/s the auto split assumes a KV transfer moves (default 1e9)")
    add_engine_flags(p, multi_device=True)
    p.set_defaults(func=run)
