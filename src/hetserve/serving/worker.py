"""A worker process: one device, one EngineCore, driven by typed messages over ZMQ.

Started as `python -m hetserve.serving.worker SPEC_JSON` (no pickle, no fork of the API
process). The loop drains incoming messages between steps, so an abort lands within
one step, and sends every step's new tokens with the worker's state.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
import threading
import time
from typing import NoReturn

import zmq

from .. import trace
from . import ipc, placement
from .process_exit import exit_now, exit_with_parent

log = logging.getLogger("hetserve.worker")


def _update(req, out, first: bool):
    m = req.metrics
    return ipc.RequestUpdate(
        request_id=out.request_id,
        new_token_ids=out.new_token_ids,
        finished=out.finished,
        finish_reason=out.finish_reason,
        logprobs=[_pairs(d) for d in out.new_logprobs],
        prompt_logprobs=None if out.prompt_logprobs is None else [_pairs(d or {}) for d in out.prompt_logprobs],
        num_cached_tokens=req.num_cached_tokens,
        queue_time_s=(m.first_scheduled_time - m.arrival_time) if first and m.first_scheduled_time else None,
        spec={"proposed": req.spec.proposed, "accepted": req.spec.accepted} if out.finished and req.spec else None,
    )


def _pairs(logprobs: dict[int, float]) -> list[list[float]]:
    return [[t, lp] for t, lp in logprobs.items()]  # msgpack maps here have string keys


def _state(engine) -> ipc.WorkerState:
    s = engine.scheduler
    published, evicted = engine.prefix_cache.drain_changes() if engine.prefix_cache else ([], [])
    compiling = list(engine.structured.compiling) if engine.structured else []  # waiting for their grammar
    return ipc.WorkerState(running=len(s.running), waiting=len(s.waiting) + len(engine.held) + len(compiling),
                           pages_used=engine.pool.num_used, pages_total=engine.pool.num_blocks,
                           preemptions=s.num_preemptions, prefix_cache=engine.prefix_cache_stats(),
                           queued_ids=[r.request_id for r in s.waiting] + list(engine.held) + compiling,
                           running_prefill={r.request_id: max(r.num_prompt_tokens - r.num_computed_tokens, 0)
                                            for r in s.running},
                           published=published, evicted=evicted,
                           spec_decode=_flat_spec(engine.spec_stats()),
                           chunk_budget=s.decoding_budget)


def _flat_spec(stats: dict) -> dict[str, float]:
    """Speculation counters with string keys (msgpack maps here have string keys): k_<K> per draft length."""
    hist = stats.pop("k_histogram", {})
    return {**stats, **{f"k_{k}": n for k, n in hist.items()}}


HEARTBEAT_S = 1.0


def _heartbeat(ctx: zmq.Context, address: str, name: str) -> None:
    """From its own thread and socket, so a long step or model load never delays it."""
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    beat = ipc.encode(ipc.Heartbeat(name))
    while True:
        sock.send(beat)
        time.sleep(HEARTBEAT_S)


def serve(spec: dict) -> int:
    parent = spec["parent_pid"]  # the API process (a local worker) or the node's raylet (a Ray actor)
    exit_with_parent(parent)  # while it imports, loads, builds kernels, or is stuck: never an orphan
    import torch

    from ..core import profiling
    from ..core.engine import RequestRejected
    from ..core.loading import load_engine
    from ..core.request import Request, RequestStatus
    from ..disagg import NoRoomYet, TransferError, export_request, import_request
    from ..sampling_params import SamplingParams

    name = spec["name"]
    if spec.get("cores"):  # before the engine starts its threads, which inherit the mask (placement.py)
        placement.pin_process(spec["cores"])
    if spec.get("threads"):
        torch.set_num_threads(int(spec["threads"]))
    ctx = zmq.Context()
    inbox = ctx.socket(zmq.PULL)
    inbox.connect(spec["to_worker"])
    outbox = ctx.socket(zmq.PUSH)
    outbox.connect(spec["from_worker"])
    outbox.setsockopt(zmq.LINGER, 2000)
    threading.Thread(target=_heartbeat, args=(ctx, spec["from_worker"], name), daemon=True).start()

    # A worker that measures its profile loads and measures holding the machine's profiling lock:
    # workers sharing the machine then neither load nor measure beside its measurement.
    measuring = bool(spec.get("measure_profile"))
    with profiling.machine_lock() if measuring else contextlib.nullcontext():
        try:
            loaded = load_engine(spec["model"], spec.get("device", "cpu"), spec.get("dtype", "float32"), name=name,
                                 **spec["engine"])
        except ValueError as e:  # a model or option it cannot load: one line (the API process names the exit)
            print(f"error: worker {name}: {e}", file=sys.stderr, flush=True)
            return 2
        engine = loaded.engine
        profile = profiling.measure_stable(engine) if measuring else None
    if engine.prefix_cache is not None:
        engine.prefix_cache.track_changes = True  # from here on the router hears of every page
    model_id = engine.prefix_cache.model_id if engine.prefix_cache else ""
    outbox.send(ipc.encode(ipc.Ready(name, os.getpid(), loaded.model.config.vocab_size, engine.max_model_len,
                                     engine.pool.num_blocks, engine.pool.page_size, model_id,
                                     engine.config.max_num_seqs, profile, loaded.model.kv_bytes_per_token())))
    live: dict[str, Request] = {}
    poller = zmq.Poller()
    poller.register(inbox, zmq.POLLIN)

    steps: list[list] = []  # [prompt tokens, decode rows, seconds] of the steps since the last state

    def send(updates):
        state = _state(engine)
        state.steps = steps[-64:]
        steps.clear()
        outbox.send(ipc.encode(ipc.Outputs(name, updates, state)))

    probe_s = spec.get("probe_s") or 0.0  # an idle worker probes its speed this often, a size at a time
    last_work, probes = time.monotonic(), 0
    # The step being timed, reported with the next one's start: a worker whose core is shared with
    # another process loses its time between steps too, and short steps alone would not show it.
    timed: tuple | None = None

    exported: set[str] = set()  # parked requests whose KV went out, held until the frontend releases them
    incoming: list = []  # KV transfers waiting for free pages (this worker's running requests free them)

    def install(msg) -> bool:
        """Try to install a KV transfer; False: no room yet and worth waiting for."""
        t0 = time.perf_counter()
        try:
            req = import_request(engine, msg.export)
            live[req.request_id] = req
            ack = ipc.TransferAck(name, msg.export.request_id, True)
        except NoRoomYet as e:
            if engine.has_unfinished_requests():
                return False
            ack = ipc.TransferAck(name, msg.export.request_id, False, f"KV transfer refused by {name}: {e}")
        except (TransferError, RequestRejected, ValueError, TypeError) as e:
            ack = ipc.TransferAck(name, msg.export.request_id, False, f"KV transfer refused by {name}: {e}")
        ack.import_s = time.perf_counter() - t0
        outbox.send(ipc.encode(ack))  # before any update of this request
        return True

    while True:
        if os.getppid() != parent:  # within a step, and with a clean end (the watch's is abrupt)
            return 0
        busy = engine.has_unfinished_requests()
        events = dict(poller.poll(0 if busy else 100))
        updates = []
        changed = False  # a message freed or took pages: report the state even when idle
        while inbox in events:
            changed = True
            try:
                msg = ipc.decode(inbox.recv(), ipc.TO_WORKER)
            except ipc.IPCError as e:
                log.error("worker %s: dropped a bad message: %s", name, e)
                msg = None
            if isinstance(msg, ipc.Shutdown):
                for rid in list(live):
                    engine.abort(rid)
                send([])
                trace.stop()
                return 0
            if isinstance(msg, ipc.AddRequest):
                try:
                    req = Request(msg.request_id, msg.prompt_token_ids, SamplingParams(**msg.params),
                                  cache_salt=msg.cache_salt)
                    engine.add_request(req, prefill_only=msg.prefill_only)
                    live[req.request_id] = req
                except (RequestRejected, ValueError, TypeError) as e:
                    updates.append(ipc.RequestUpdate(msg.request_id, [], finished=True, finish_reason="error",
                                                     error=str(e)))
            elif isinstance(msg, ipc.KVTransfer):
                incoming.append(msg)
            elif isinstance(msg, ipc.Abort):
                live.pop(msg.request_id, None)
                exported.discard(msg.request_id)
                incoming[:] = [m for m in incoming if m.export.request_id != msg.request_id]
                engine.abort(msg.request_id, RequestStatus.FINISHED_STOPPED if msg.stopped
                             else RequestStatus.FINISHED_ABORTED)
            events = dict(poller.poll(0))
        while incoming and install(incoming[0]):  # in arrival order
            incoming.pop(0)
        if engine.has_unfinished_requests():
            t0 = time.perf_counter()
            if timed is not None:  # the previous step, start to start: time off the CPU between steps counts
                steps.append([*timed[0], t0 - timed[1]])
            outs = engine.step()
            timed = (engine.last_step, t0) if engine.last_step is not None else None
            last_work = time.monotonic()
            for out in outs:
                req = live.get(out.request_id)
                if req is None:
                    continue
                updates.append(_update(req, out, first=req.num_output_tokens == len(out.new_token_ids)))
                if out.finished:
                    del live[out.request_id]
        if timed is not None and not engine.has_unfinished_requests():  # the last step of a busy spell
            steps.append([*timed[0], time.perf_counter() - timed[1]])
            timed = None
        if probe_s and not engine.has_unfinished_requests() and not incoming \
                and time.monotonic() - last_work >= probe_s:
            # Idle for a while: a short timed run at one of the profile's sizes (random ids) tells
            # the router how fast this worker is now, so that one it stopped sending work to while
            # it was slowed wins work back once it has recovered.
            steps.extend(profiling.probe(engine, *profiling.PROBES[probes % len(profiling.PROBES)]))
            probes += 1
            last_work, changed = time.monotonic(), True
        if updates or busy or changed:
            send(updates)
        for rid in [r for r in engine.parked if r not in exported]:
            t0 = time.perf_counter()
            x = export_request(engine, rid)
            exported.add(rid)
            outbox.send(ipc.encode(ipc.KVTransfer(name, x, time.perf_counter() - t0)))


def main(argv: list[str] | None = None) -> NoReturn:
    argv = sys.argv[1:] if argv is None else argv
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    spec = json.loads(argv[0])
    try:
        code = serve(spec)
    except KeyboardInterrupt:
        code = 0
    exit_now(code)  # the API process waits for this exit within its --shutdown-timeout


if __name__ == "__main__":
    main()
