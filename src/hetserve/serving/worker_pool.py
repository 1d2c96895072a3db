"""The frontend's workers: each one started (a local child process or a Ray actor, through
serving/links.py), waited for until it says Ready, watched for exits and silence, restarted
(a local one, up to --worker-restarts times, after a back-off; Ray restarts its own actors),
and stopped. What a worker's death means for its requests and the routing is the frontend's to
decide; this only tells it which worker is gone and why, and when one starts again.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import zmq.asyncio

from ..models import registry
from . import ipc, placement
from .devices import WorkerSpec
from .links import LocalLink, RayLink, connect_ray, ray_options


@dataclass
class WorkerHandle:
    name: str
    spec: WorkerSpec
    link: LocalLink | RayLink | None = None  # how frames reach it (serving/links.py)
    ready: ipc.Ready | None = None
    state: ipc.WorkerState | None = None
    alive: bool = False
    requests: set[str] = field(default_factory=set)
    last_seen: float = 0.0  # monotonic time of its last message (heartbeats included)
    dead: str | None = None  # why it left the routing
    start: dict = field(default_factory=dict)  # what a local worker was started with, to start it again
    restarts: int = 0  # times this local worker was started again
    restart_at: float | None = None  # monotonic time its next start is due (a local worker that died)
    reason: str | None = None  # why it last died (kept while a restarted worker loads)

    @property
    def status(self) -> str:
        if self.alive:
            return "up"
        if self.restart_at is not None or (self.restarts and not self.dead):
            return "restarting"  # waiting out its back-off, or loading the model again
        return "dead" if self.dead else "loading"


RESTART_BACKOFF_S = 1.0  # before a dead local worker's first restart; doubled for each one after
MAX_RESTART_BACKOFF_S = 30.0


class WorkerPool:
    def __init__(self, specs: list[WorkerSpec], model_path: str, model_arg: str, socket_dir: str,
                 needs_profile: set[str], ray_address: str | None, ray_restarts: int, worker_timeout: float,
                 worker_restarts: int = 0, load_timeout: float = 600.0, probe_s: float = 0.0):
        """needs_profile: the --inference-device values whose workers measure a routing profile at
        start-up; ray_restarts: times Ray restarts a dead worker actor, which then rejoins;
        worker_restarts: times a dead local worker is started again (it loads the model anew);
        load_timeout: how long a restarted one may be silent while it loads; probe_s: an idle
        worker times a short probe run this often, for the router's refined profile (0: never)."""
        self.specs, self.model_path, self.model_arg, self._dir = specs, model_path, model_arg, socket_dir
        self.needs_profile = needs_profile
        self.probe_s = probe_s
        self.ray_address, self.ray_restarts, self.worker_timeout = ray_address, ray_restarts, worker_timeout
        self.worker_restarts, self.load_timeout = worker_restarts, load_timeout
        self._ctx: zmq.asyncio.Context | None = None
        self.workers: list[WorkerHandle] = []
        self.named: dict[str, WorkerHandle] = {}  # the same workers by name (routing, every frame)
        # Threads and cores of the local workers; api_cores: those left for the API process.
        self.placements, self.api_cores = placement.place(specs, placement.available_cores())

    async def start(self, ctx: zmq.asyncio.Context, inbox: str) -> None:
        """Start every worker; each sends its frames to `inbox`."""
        self._ctx = ctx
        if any(ws.ray for ws in self.specs):
            connect_ray(self.ray_address)
        for i, (ws, pl) in enumerate(zip(self.specs, self.placements)):
            spec = {"name": ws.name, "model": self.model_path, "device": ws.device, "dtype": ws.dtype,
                    "threads": pl.threads, "cores": list(pl.cores) if pl.cores else None, "engine": ws.engine,
                    "to_worker": f"ipc://{self._dir}/in{i}", "from_worker": inbox,
                    "measure_profile": ws.spec in self.needs_profile, "probe_s": self.probe_s}
            w = WorkerHandle(ws.name, ws)
            if ws.ray:
                # A remote node resolves the model from its own cache (a registry name is pulled
                # and verified there); a path must exist on that node.
                spec["model"] = self.model_arg if self.model_arg in registry.MODELS else self.model_path
                w.link = RayLink(ctx, spec, inbox, ray_options(ws.ray, self.ray_restarts))
                await w.link.locate()
            else:
                w.start = spec
                w.link = LocalLink(ctx, spec)
            self.workers.append(w)
            self.named[w.name] = w

    async def wait_ready(self, timeout: float) -> None:
        """Until every worker has said Ready (the frontend's output loop records it)."""
        deadline = time.monotonic() + timeout
        while not all(w.ready for w in self.workers):
            for w in self.workers:
                if w.link.exit_reason() is not None:
                    raise RuntimeError(f"worker {w.name} stopped while loading ({w.link.exit_reason()})")
            if time.monotonic() > deadline:
                raise RuntimeError("workers did not load the model in time")
            await asyncio.sleep(0.05)

    def lost(self) -> list[tuple[WorkerHandle, str]]:
        """Live workers that exited or went silent for worker_timeout seconds (stopped, hung), and
        restarted ones that did so while loading (silent for load_timeout), with why; a silent one
        is killed, since a stopped process that resumed would speak for requests it no longer has."""
        now, gone = time.monotonic(), []
        for w in self.workers:
            reloading = not w.alive and w.restarts and not w.dead
            if not (w.alive or reloading):
                continue
            if w.link.exit_reason() is not None:
                gone.append((w, f"worker {w.name} died{' while loading' if reloading else ''} "
                                f"({w.link.exit_reason()})"))
            elif now - w.last_seen > (self.load_timeout if reloading else self.worker_timeout):
                gone.append((w, f"worker {w.name} stopped responding (no heartbeat for {now - w.last_seen:.0f} s)"))
                w.link.kill()
        return gone

    def schedule_restart(self, w: WorkerHandle) -> bool:
        """A local worker that died starts again after a back-off (1 s, doubling up to 30 s) while
        it has restarts left; True if it will."""
        if w.spec.ray or w.restarts >= self.worker_restarts:
            return False
        w.restart_at = time.monotonic() + min(RESTART_BACKOFF_S * 2 ** w.restarts, MAX_RESTART_BACKOFF_S)
        return True

    def start_due(self) -> list[WorkerHandle]:
        """Start again the local workers whose back-off has passed: a new process on the same
        cores, behind a new socket (no frame of the old one can reach it), that loads the model
        and says Ready; its routing profile is the one it had."""
        now, started = time.monotonic(), []
        for w in self.workers:
            if w.restart_at is None or now < w.restart_at:
                continue
            w.link.close()
            w.restarts, w.restart_at = w.restarts + 1, None
            try:
                w.link = LocalLink(self._ctx, {**w.start, "to_worker": f"{w.start['to_worker']}.{w.restarts}",
                                               "measure_profile": False})
            except (OSError, zmq.ZMQError) as e:  # no process or socket to be had: it stays dead
                w.dead = w.reason = f"worker {w.name} could not be started again ({e})"
                continue
            self.rejoining(w)
            started.append(w)
        return started

    @staticmethod
    def rejoining(w: WorkerHandle) -> None:
        """A restarted worker (a new local process, or a Ray actor that speaks again): take its new
        Ready (it loads the model anew). The last Ready stays until then: the server's limits
        (context, largest KV pool) are read from it while no worker is up."""
        w.dead, w.state, w.last_seen = None, None, time.monotonic()

    async def stop(self, timeout: float) -> None:
        """Ask the live workers to shut down, wait for them until `timeout` (then kill them)."""
        for w in self.workers:
            if w.alive:
                await w.link.send(ipc.encode(ipc.Shutdown()))
        deadline = asyncio.get_running_loop().time() + timeout
        for w in self.workers:
            if w.alive:
                await w.link.wait_exit(deadline)
            else:  # loading or dead: nothing to finish
                w.link.kill()
            w.alive = False

    def health(self) -> list[dict]:
        """Each worker's entry of /health."""
        rows = []
        for w in self.workers:
            s = w.state if w.alive else None
            reason = w.dead or (w.reason if w.status == "restarting" else None)
            rows.append({"name": w.name, "device": w.spec.spec, "node": w.link.node if w.link else None,
                         "pid": w.ready.pid if w.ready else None, "state": w.status, "restarts": w.restarts,
                         **({"reason": reason} if reason else {}),
                         "running": s.running if s else 0, "waiting": s.waiting if s else 0,
                         "kv_pages_used": s.pages_used if s else 0,
                         "kv_pages_total": w.ready.num_pages if w.ready else 0})
        return rows
