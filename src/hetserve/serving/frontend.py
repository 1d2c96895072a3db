"""The API process side of serving: tokenization off the event loop, routing each request to
a worker (serving/worker_pool.py starts and watches them), incremental detokenization and stop
strings, per-request streams, KV transfers between disaggregated workers, metrics.

Each request gets an asyncio queue that the output loop fills from worker messages.
A request that is cancelled (client gone) or ends by a stop string is aborted in its
worker at once, so its pages are freed within one engine step.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import os
import shutil
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import zmq
import zmq.asyncio

from ..core.engine import resolve_max_tokens
from ..core.output_processor import RequestState
from ..models import registry
from ..models.config import ModelConfig
from ..models.gguf_loader import GGUFFile
from ..models.tokenizer import Tokenizer
from ..sampling_params import SamplingParams
from . import ipc
from .dashboard import LiveStats
from .devices import parse_devices
from .metrics import Metrics
from .router import NoWorker, OutputLengths, Profile, Router, WorkerView, choose_split
from .tokenizer_service import TokenizeBudgetExceeded, TokenizeFailed, TokenizerPool
from .worker_pool import WorkerHandle, WorkerPool

log = logging.getLogger("hetserve.frontend")


class ServiceUnavailable(RuntimeError):
    pass


class RequestFailed(RuntimeError):
    pass


@dataclass
class Delta:
    """New output of one request since the last delta."""

    text: str
    token_ids: list[int]
    logprobs: list[dict[int, float]]
    finished: bool = False
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    prompt_logprobs: list[dict[int, float] | None] | None = None  # with the first delta, when asked for
    worker: str = ""  # the worker that produced it (the decode worker of a split request)
    prefill_worker: str | None = None  # disaggregated: the worker that ran the prefill
    spec: dict[str, float] | None = None  # with the last delta of a speculating request: proposed, accepted
    stopped_by: str | None = None  # with the last delta: the stop string that ended it, if one did


@dataclass
class _Stream:
    worker: WorkerHandle
    state: RequestState
    queue: asyncio.Queue
    arrival: float
    num_prompt_tokens: int
    num_output_tokens: int = 0
    first_token_time: float | None = None
    last_token_time: float | None = None
    done: bool = False
    decode: "WorkerHandle | None" = None  # disaggregated: the worker that decodes after the transfer
    holder: "WorkerHandle | None" = None  # the prefill worker while it holds the request's pages
    transfer_start: float = 0.0
    transfer_bytes: int = 0
    prefill_worker: str | None = None


def parse_disaggregate(value: str | None, workers: list[str]) -> tuple[str, str] | str | None:
    """`prefill=WORKER,decode=WORKER` -> (prefill, decode) worker names; `auto` -> "auto" (the
    router splits a request when its profiles say the transfer is repaid)."""
    if not value:
        return None
    if value == "auto":
        return "auto"
    parts = dict(p.split("=", 1) for p in value.split(",") if "=" in p)
    if set(parts) != {"prefill", "decode"} or len(value.split(",")) != 2:
        raise ValueError(f"--disaggregate {value!r}: expected prefill=WORKER,decode=WORKER")
    for role, name in parts.items():
        if name not in workers:
            raise ValueError(f"--disaggregate {role}={name}: no such worker (workers: {', '.join(workers)})")
    return parts["prefill"], parts["decode"]


class Frontend:
    def __init__(self, model: str, engine_kwargs: dict, devices: list[str] | None = None,
                 dtype: str = "float32", max_queued_requests: int = 256, startup_timeout: float = 600.0,
                 route_policy: str | None = None, route_log: str | None = None,
                 profiles: list[dict] | None = None, measure_profiles: bool = True,
                 disaggregate: str | None = None, transfer_bytes_per_s: float = 1e9,
                 tokenizer_processes: int = 2, tokenize_timeout: float = 10.0, worker_timeout: float = 15.0,
                 ray_address: str | None = None, ray_restarts: int = 0, worker_restarts: int = 3,
                 infill_suffix_tokens: int | None = 256, profile_refine: bool = True,
                 profile_probe_s: float = 2.0):
        """profiles: router.Profile JSON objects, matched to workers by their --inference-device
        value; a worker without one measures a short profile at start-up (measure_profiles), or
        else counts as fast as the others (the cost policy then balances work only).
        ray_address: the Ray cluster of `ray:` devices (None: a local one is started);
        ray_restarts: times Ray restarts a dead worker actor, which then rejoins;
        worker_restarts: times a dead local worker is started again (after a back-off), likewise;
        infill_suffix_tokens: the text after the cursor a fill-in-the-middle prompt keeps (None: all);
        profile_refine: the router follows each worker's speed from the steps it reports (False: the
        profiles as given or measured at start-up are trusted for the server's life); profile_probe_s:
        an idle worker times a short run this often so that the router sees it recover (0: never)."""
        self.model_path = str(registry.resolve(model))
        self.model_name = model if model in registry.MODELS else os.path.basename(self.model_path)
        # A file the workers cannot load is one line here, not a worker's traceback at start-up.
        with GGUFFile(self.model_path) as f:
            self.tokenizer = Tokenizer.from_gguf_metadata(f.metadata)
            ModelConfig.from_gguf(self.model_path, f.metadata, f.tensors)
        if draft := engine_kwargs.get("speculative_model"):
            with GGUFFile(registry.resolve(draft)) as f:
                ModelConfig.from_gguf(f.path, f.metadata, f.tensors)
        self.engine_kwargs = engine_kwargs
        self.infill_suffix_tokens = infill_suffix_tokens
        self.profile_refine = profile_refine
        self.output_lengths = OutputLengths()  # what a request without max_tokens is priced at
        self.dtype = dtype
        self.devices = devices or ["cpu"]
        self.specs = parse_devices(self.devices, engine_kwargs, dtype)
        self.route_policy = route_policy or ("cost" if len(self.specs) > 1 else "least-loaded")
        if self.route_policy.startswith("force:") and self.route_policy[6:] not in [w.name for w in self.specs]:
            raise ValueError(f"--route-policy {self.route_policy}: no such worker (workers: "
                             f"{', '.join(w.name for w in self.specs)})")
        self.profiles = {}
        for p in profiles or []:
            prof = Profile.from_json(p)
            if prof.device not in self.devices:
                raise ValueError(f"a profile is for --inference-device {prof.device!r}, which is not served "
                                 f"(devices: {', '.join(self.devices)})")
            self.profiles[prof.device] = prof
        self.disaggregate = parse_disaggregate(disaggregate, [w.name for w in self.specs])
        self.transfer_bytes_per_s = transfer_bytes_per_s  # the auto split's estimate of KV transfer speed
        self.router: Router | None = None
        self._route_log = open(route_log, "a", buffering=1) if route_log else None
        self.live = LiveStats()  # what the web page's dashboard shows
        self.max_queued_requests = max_queued_requests
        self.startup_timeout = startup_timeout
        self.metrics = Metrics()
        self.streams: dict[str, _Stream] = {}
        self.draining = False
        self._ids = itertools.count()
        # Small decodes (a logprob's token, a prompt to echo) run on one thread off the event loop;
        # encoding and template rendering run in tokenizer processes with a time budget.
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenize")
        self._tasks: list[asyncio.Task] = []
        self._background: set[asyncio.Future] = set()
        self._dir = ipc.private_socket_dir()
        self.tokenizers = TokenizerPool(self.model_path, self._dir, tokenizer_processes, tokenize_timeout)
        self.template_error: str | None = None  # the model's template failed its load-time check
        self._ctx = zmq.asyncio.Context()
        self._inbox = self._ctx.socket(zmq.PULL)
        # One worker needs no profile: there is nothing to choose between.
        needs_profile = {ws.spec for ws in self.specs if ws.spec not in self.profiles} \
            if measure_profiles and len(self.specs) > 1 else set()
        probe_s = profile_probe_s if profile_refine and len(self.specs) > 1 else 0.0  # one worker: no choice
        self.pool = WorkerPool(self.specs, self.model_path, model, self._dir, needs_profile, ray_address,
                               ray_restarts, worker_timeout, worker_restarts, startup_timeout, probe_s)
        self.workers, self._named = self.pool.workers, self.pool.named

    # -- lifecycle ------------------------------------------------------------------------------
    async def start(self) -> None:
        await self.tokenizers.start()
        try:  # one bounded rendering at load: a template that never ends is known before any request
            await self.tokenizers.call("check_template")
        except TokenizeBudgetExceeded as e:
            self.template_error = f"the model's chat template failed its load-time check: {e}"
            log.error("%s; chat requests will be refused", self.template_error)
        except TokenizeFailed as e:  # e.g. a template that refuses system turns: chats may still work
            log.warning("the model's chat template did not render a probe conversation: %s", e)
        inbox = f"ipc://{self._dir}/out"
        self._inbox.bind(inbox)
        await self.pool.start(self._ctx, inbox)
        self._tasks.append(asyncio.create_task(self._output_loop()))
        await self.pool.wait_ready(self.startup_timeout)
        self.router = Router(self.route_policy, [self._view(w) for w in self.workers])
        self._tasks.append(asyncio.create_task(self._monitor()))

    def _view(self, w: WorkerHandle) -> WorkerView:
        r = w.ready
        profile = self.profiles.get(w.spec.spec)
        if profile is None and r.profile:
            profile = Profile(r.profile["prefill"], r.profile["decode"], w.spec.spec, self.model_name)
        if profile is None:
            profile = Profile.flat(1.0, 1.0, w.spec.spec)  # unknown speed: all workers count as equal
        return WorkerView(w.name, profile, r.model_id, r.page_size, r.max_num_seqs, r.num_pages * r.page_size,
                          refine=self.profile_refine)

    def worker_profiles(self) -> dict[str, dict]:
        """Each worker's profile: as given or measured at start-up (with the spread of its rounds
        where measured), and as the router prices it now (refined from the worker's steps)."""
        out = {}
        for v in self.router.workers if self.router else []:
            w = self._named[v.name]
            measured = w.ready.profile if w.ready else None
            out[v.name] = {**v.profile.to_json(), "spread": (measured or {}).get("spread"),
                           "current": {**v.current_profile().to_json(), "speed": v.speed.to_json()}}
        return out

    @property
    def healthy(self) -> bool:
        """Serving while any worker is: a dead worker only leaves the routing."""
        return any(w.alive for w in self.workers) and not self.draining

    @property
    def max_model_len(self) -> int:
        return min(w.ready.max_model_len for w in self.workers if w.ready)

    @property
    def _largest_pool(self) -> ipc.Ready:
        return max((w.ready for w in self.workers if w.ready), key=lambda r: r.num_pages * r.page_size)

    async def shutdown(self, timeout: float = 10.0) -> None:
        """Abort what is left, stop the workers, wait for them (kill if they hang)."""
        for t in self._tasks[1:]:  # the monitor: workers exiting now are not deaths
            t.cancel()
        for rid in list(self.streams):
            self._fail(rid, "the server is shutting down")
        await self.pool.stop(timeout)
        for t in self._tasks:
            t.cancel()
        if self._route_log:
            self._route_log.close()
        self._ctx.destroy(linger=0)
        self.tokenizers.shutdown()
        self._pool.shutdown(wait=False)
        shutil.rmtree(self._dir, ignore_errors=True)

    # -- requests -------------------------------------------------------------------------------
    async def run_blocking(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    async def encode_prompt(self, text: str, parse_special: bool, for_context: bool = True) -> list[int]:
        """TokenizeFailed (a 400) for bad input, an overrun budget or, for_context, a prompt over the
        context (/tokenize counts any text: for_context=False)."""
        return self._within_context(await self.tokenizers.call(
            "encode_prompt", text=text, parse_special=parse_special,
            limit=self.max_model_len if for_context else None))

    async def encode_infill(self, prefix: str, suffix: str, extra: list[dict], filename: str | None,
                            max_tokens: int) -> tuple[list[int], bool]:
        """A fill-in-the-middle prompt (models/fim.py) cut to leave max_tokens of the context, its
        suffix to infill_suffix_tokens: (ids, truncated). TokenizeFailed (a 400) for bad input or a
        model without FIM tokens."""
        ids, truncated = await self.tokenizers.call("encode_infill", prefix=prefix, suffix=suffix, extra=extra,
                                                    filename=filename, budget=self.max_model_len - max_tokens,
                                                    max_suffix=self.infill_suffix_tokens)
        return ids, truncated

    async def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                          tools: list[dict] | None = None, for_context: bool = True) -> list[int]:
        if self.template_error:
            raise TokenizeFailed(self.template_error)
        return self._within_context(await self.tokenizers.call(
            "encode_chat", messages=messages, add_generation_prompt=add_generation_prompt, tools=tools,
            limit=self.max_model_len if for_context else None))

    def _within_context(self, ids) -> list[int]:
        if isinstance(ids, dict):
            raise TokenizeFailed(f"the prompt is {ids['too_long']} tokens, more than the model's context of "
                                 f"{self.max_model_len} tokens")
        return ids

    def check_capacity(self) -> None:
        if not self.healthy:
            raise ServiceUnavailable("the server is draining or a worker is down")
        queued = sum(1 for s in self.streams.values() if s.first_token_time is None)
        if queued >= self.max_queued_requests:
            raise ServiceUnavailable(f"too many queued requests ({queued}); retry later")

    def check_length(self, prompt_len: int, max_tokens: int | None) -> int:
        """Resolve max_tokens; ValueError with the numbers if the request can never run."""
        pool = self._largest_pool
        return resolve_max_tokens(prompt_len, max_tokens, self.max_model_len, pool.num_pages, pool.page_size,
                                  pool.kv_bytes_per_token)

    def _pick_worker(self, rid: str, prompt_ids: list[int], max_tokens: int, cache_salt: str | None,
                     pin: str | None, auto_split: bool = False,
                     max_tokens_given: bool = True) -> tuple[WorkerHandle, str | None]:
        """The worker that runs (or prefills) the request, and the decode worker when it is split.
        A request without max_tokens has its decode priced at the expected output length."""
        if pin is not None and pin not in [w.name for w in self.workers]:
            raise ValueError(f"no worker named {pin!r} (workers: {', '.join(w.name for w in self.workers)})")
        expected, source = (max_tokens, "max_tokens") if max_tokens_given else self.output_lengths.estimate()
        expected = min(expected, max_tokens)
        try:
            d = self.router.route(rid, prompt_ids, max_tokens, cache_salt, pin,
                                  expected=None if max_tokens_given else expected)
        except NoWorker as e:
            raise ServiceUnavailable(str(e)) from None
        choice, split = d.worker, None
        if auto_split:
            live = {w.name for w in self.workers if w.alive}
            split = choose_split([c for c in d.candidates if c.worker in live], len(prompt_ids),
                                 min(w.ready.kv_bytes_per_token for w in self.workers if w.ready),
                                 self.transfer_bytes_per_s)
            if split is not None and split.prefill != choice:  # move the placement to the prefill side
                placed = self.router.view(choice).requests.pop(rid)
                self.router.view(split.prefill).requests[rid] = placed
                choice = split.prefill
        self._log_route({
            "time": round(time.time(), 4), "request_id": rid, "prompt_tokens": len(prompt_ids),
            "max_tokens": max_tokens, "decode_estimate": {"tokens": expected, "source": source},
            "policy": d.policy, "choice": choice,
            "candidates": [{**c.as_dict(), "node": self._node(c.worker)} for c in d.candidates],
            **({"split": split.as_dict()} if split else {})})
        return self._named[choice], split.decode if split else None

    def _node(self, worker: str) -> str:
        """Where a worker runs: `local`, or its Ray node's id."""
        return self._named[worker].link.node

    def _log_route(self, entry: dict) -> None:
        """A routing decision or KV transfer: to --route-log and the dashboard's recent list."""
        self.live.route(entry)
        if self._route_log:
            self._route_log.write(json.dumps(entry) + "\n")

    async def generate(self, prompt_ids: list[int], params: SamplingParams, cache_salt: str | None = None,
                       request_id: str | None = None, worker: str | None = None,
                       max_tokens_given: bool | None = None) -> AsyncIterator[Delta]:
        """Stream the deltas of one request. Cancelling the consumer aborts it in the worker.
        worker: run it on this worker whatever the route policy (cache warming, diagnostics);
        max_tokens_given: whether the client set max_tokens (default: params.max_tokens is set)."""
        vocab = self.tokenizer.vocab_size
        if any(not 0 <= t < vocab for t in prompt_ids):
            raise ValueError(f"token ids must be in [0, {vocab - 1}]")
        if max_tokens_given is None:
            max_tokens_given = params.max_tokens is not None
        self.check_capacity()
        params.max_tokens = self.check_length(len(prompt_ids), params.max_tokens)
        rid = request_id or f"req-{next(self._ids)}"
        if rid in self.streams:
            raise ValueError(f"duplicate request id {rid!r}")
        wire = params.to_wire()
        ipc.encode(ipc.AddRequest(rid, list(prompt_ids), wire, cache_salt))  # fails here, before taking anything
        fixed = self.disaggregate if worker is None and isinstance(self.disaggregate, tuple) else None
        auto = worker is None and self.disaggregate == "auto"
        w, decode = self._pick_worker(rid, prompt_ids, params.max_tokens, cache_salt,
                                      fixed[0] if fixed else worker, auto_split=auto,
                                      max_tokens_given=max_tokens_given)
        # From here on the router holds a placement and (below) the stream a queue slot: every way
        # out of this generator, an error, a cancel or the end, goes through the finally below.
        st = _Stream(w, RequestState(self.tokenizer, params), asyncio.Queue(), time.monotonic(), len(prompt_ids))
        self.streams[rid] = st
        w.requests.add(rid)
        try:
            if fixed:
                decode = fixed[1]
            if decode is not None and decode != w.name:
                st.decode = self._named[decode]
                if not st.decode.alive:
                    st.done = True
                    raise ServiceUnavailable(f"decode worker {decode} is down")
                st.holder, st.prefill_worker = w, w.name
            await w.link.send(ipc.encode(ipc.AddRequest(rid, list(prompt_ids), wire, cache_salt,
                                                          prefill_only=st.decode is not None)))
            while True:
                item = await st.queue.get()
                if isinstance(item, Exception):
                    raise item
                yield item
                if item.finished:
                    return
        finally:
            try:
                if not st.done:  # cancelled or failed on our side: stop the work in the worker now
                    await self._abort(rid, stopped=False)
            finally:
                self._forget(rid)

    async def _abort(self, rid: str, stopped: bool) -> None:
        st = self.streams.get(rid)
        if st is None or st.done:
            return
        st.done = True
        if st.worker.alive:
            await st.worker.link.send(ipc.encode(ipc.Abort(rid, stopped)))
        await self._release(rid, st, stopped=False)

    async def _release(self, rid: str, st: _Stream, stopped: bool) -> None:
        """Free the prefill worker's pages of a disaggregated request (stopped: the transfer
        succeeded, so they count as computed and go to its prefix cache)."""
        p, st.holder = st.holder, None
        if p is not None:
            p.requests.discard(rid)
            if p.alive:
                await p.link.send(ipc.encode(ipc.Abort(rid, stopped)))

    def _forget(self, rid: str) -> None:
        st = self.streams.pop(rid, None)
        if st is not None:
            st.worker.requests.discard(rid)
            self.router.finished(st.worker.name, rid)

    def _fail(self, rid: str, message: str) -> None:
        st = self.streams.get(rid)
        if st is not None and not st.done:
            st.done = True
            st.queue.put_nowait(RequestFailed(message))
            if st.worker.alive:  # e.g. the prefill worker died after the transfer: stop the decode
                self._spawn(st.worker.link.send(ipc.encode(ipc.Abort(rid, False))))
            self._spawn(self._release(rid, st, stopped=False))

    def _spawn(self, awaitable) -> None:
        """Run a send in the background, holding a reference until it is done."""
        fut = asyncio.ensure_future(awaitable)
        self._background.add(fut)
        fut.add_done_callback(self._background.discard)

    # -- worker messages -------------------------------------------------------------------------
    async def _output_loop(self) -> None:
        """Every frame is validated against the messages a worker may send; one that does not
        validate, or that names no live worker, is dropped and logged, and nothing it carries can
        stop this loop."""
        while True:
            raw = await self._inbox.recv()
            try:
                msg = ipc.decode(raw, ipc.TO_FRONTEND)
                w = self._named.get(msg.worker)
                if w is not None and w.dead and w.link.restarted():
                    self.pool.rejoining(w)
                if w is None or w.dead:
                    raise ipc.IPCError(f"{type(msg).__name__} from {'unknown' if w is None else 'dead'} "
                                       f"worker {msg.worker!r}")
                if isinstance(msg, ipc.Ready) and w.alive:
                    raise ipc.IPCError(f"a second Ready from worker {w.name}")
                if not isinstance(msg, ipc.Ready) and not w.alive:
                    if isinstance(msg, ipc.Heartbeat):  # beats start before the model is loaded
                        w.last_seen = time.monotonic()
                        continue
                    raise ipc.IPCError(f"{type(msg).__name__} from worker {w.name} before its Ready")
                w.last_seen = time.monotonic()
                await self._handle(w, msg, raw)
            except ipc.IPCError as e:
                log.error("dropped a message on the worker socket: %s", e)
            except Exception:
                log.exception("a worker message could not be applied; dropped")

    async def _handle(self, w: WorkerHandle, msg, raw: bytes) -> None:
        if isinstance(msg, ipc.Heartbeat):
            return
        if isinstance(msg, ipc.KVTransfer):
            await self._relay(msg, raw)
            return
        if isinstance(msg, ipc.TransferAck):
            await self._acked(msg)
            return
        if isinstance(msg, ipc.Ready):
            w.ready, w.alive = msg, True
            self.metrics.worker_up(w.name, True)
            if self.router is not None:  # a restarted worker rejoins the routing, its cache empty
                self.router.view(w.name).rejoin()
                log.warning("worker %s is back (%s)", w.name, w.spec.spec)
            return
        w.state = s = msg.state  # Outputs
        self.metrics.worker_state(w.name, s)
        if self.router is not None:
            view = self.router.view(w.name)
            view.apply_state(s.queued_ids, s.running_prefill, s.published, s.evicted)
            for prompt_tokens, decode_rows, seconds in s.steps:
                view.observe(prompt_tokens, decode_rows, seconds)
        for u in msg.updates:
            self._apply(w, u)

    def _apply(self, w: WorkerHandle, u: ipc.RequestUpdate) -> None:
        st = self.streams.get(u.request_id)
        if st is None or st.done or st.worker is not w:  # only the worker running it speaks for it
            return
        if u.error is not None:
            st.done = True
            st.queue.put_nowait(ValueError(u.error))
            return
        now = time.monotonic()
        if u.new_token_ids:
            if st.first_token_time is None:
                st.first_token_time = now
                self.metrics.ttft(w.name, now - st.arrival)
                self.live.ttft(now - st.arrival)
                self.live.tokens(w.name, prefill=max(st.num_prompt_tokens - u.num_cached_tokens, 0))
            else:
                self.metrics.itl(w.name, (now - st.last_token_time) / len(u.new_token_ids))
                self.live.itl((now - st.last_token_time) / len(u.new_token_ids))
                self.live.tokens(w.name, decode=len(u.new_token_ids))
            st.last_token_time = now
        if u.queue_time_s is not None:
            self.metrics.queue_time(w.name, u.queue_time_s)
        st.num_output_tokens += len(u.new_token_ids)
        self.router.progress(w.name, u.request_id, st.num_output_tokens)
        text = st.state.add(u.new_token_ids, u.finished)
        finished, reason = u.finished, u.finish_reason
        if st.state.stopped_by is not None and not finished:
            finished, reason = True, "stop"
            asyncio.get_running_loop().create_task(self._abort(u.request_id, stopped=True))
        if finished:
            st.done = True
            self.metrics.e2e(w.name, now - st.arrival)
            if reason in ("stop", "length"):
                self.output_lengths.finished(st.num_output_tokens)
        st.queue.put_nowait(Delta(
            text=text, token_ids=list(u.new_token_ids),
            logprobs=[{int(t): float(lp) for t, lp in entry} for entry in u.logprobs],
            finished=finished, finish_reason=reason, num_prompt_tokens=st.num_prompt_tokens,
            num_output_tokens=st.num_output_tokens, num_cached_tokens=u.num_cached_tokens,
            prompt_logprobs=None if u.prompt_logprobs is None else
            [{int(t): float(lp) for t, lp in entry} or None for entry in u.prompt_logprobs],
            worker=w.name, prefill_worker=st.prefill_worker, spec=u.spec,
            stopped_by=st.state.stopped_by if finished else None))

    async def _relay(self, msg: ipc.KVTransfer, raw: bytes) -> None:
        """Forward a prefill worker's KV to the request's decode worker (the same bytes)."""
        rid = msg.export.request_id
        st = self.streams.get(rid)
        p = self._named.get(msg.worker)
        if st is None or st.done or st.decode is None or st.holder is not p:
            if p is not None and p.alive:  # nobody waits for it: free the pages
                await p.link.send(ipc.encode(ipc.Abort(rid, False)))
            return
        d = st.decode
        if not d.alive:
            self._fail(rid, f"decode worker {d.name} is down; the KV transfer of {rid} was dropped")
            return
        st.transfer_start = time.monotonic() - msg.export_s
        st.worker = d
        d.requests.add(rid)
        placed = self.router.view(p.name).requests.pop(rid, None)
        if placed is not None:
            self.router.view(d.name).requests[rid] = placed
        st.transfer_bytes = msg.export.nbytes
        await d.link.send(raw)

    async def _acked(self, msg: ipc.TransferAck) -> None:
        rid = msg.request_id
        st = self.streams.get(rid)
        if st is None:
            return
        nbytes = st.transfer_bytes
        p = st.holder
        seconds = time.monotonic() - st.transfer_start
        if msg.ok:
            await self._release(rid, st, stopped=True)
            self.metrics.kv_transfer(p.name if p else "", msg.worker, seconds, nbytes)
        else:
            self._fail(rid, msg.error or "the KV transfer failed")
        self._log_route({
            "time": round(time.time(), 4), "request_id": rid, "event": "kv_transfer",
            "prefill": p.name if p else None, "decode": msg.worker, "ok": msg.ok, "error": msg.error,
            "bytes": nbytes, "transfer_s": round(seconds, 6), "import_s": round(msg.import_s, 6)})

    async def _monitor(self) -> None:
        """A worker that exits or goes silent: its requests end promptly with an error, it leaves
        the routing, /health and /metrics say so; a local one is started again after a back-off
        and rejoins on its Ready (_handle)."""
        while True:
            for w, reason in self.pool.lost():
                self._worker_died(w, reason)
            for w in self.pool.start_due():
                self.metrics.worker_restarted(w.name)
                log.warning("worker %s: started again (restart %d of %d)", w.name, w.restarts,
                            self.pool.worker_restarts)
            await asyncio.sleep(0.1)

    def _worker_died(self, w: WorkerHandle, reason: str) -> None:
        w.alive, w.dead, w.reason = False, reason, reason
        self.router.view(w.name).alive = False
        self.metrics.worker_down(w.name)
        log.error("%s", reason)
        for rid in list(w.requests):
            self._fail(rid, reason)
        if self.pool.schedule_restart(w):
            log.warning("worker %s will be started again in %.0f s", w.name, w.restart_at - time.monotonic())

    def health(self) -> dict:
        """/health's body: the server's state and each worker's."""
        status = "draining" if self.draining else "ok" if self.healthy else "unavailable"
        return {"status": status, "workers": self.pool.health()}
