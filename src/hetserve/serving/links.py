"""How the frontend reaches a worker: one interface, two transports. Both carry the same
msgpack-typed frames (serving/ipc.py), never pickle.

LocalLink: a child process on this host over private Unix sockets (ZMQ).
RayLink: a Ray actor (serving/ray_worker.py) on any node of a Ray cluster. Frames travel as
plain bytes in Ray actor calls (Ray serializes bytes as bytes); the actor runs the same worker
loop as a local process, on Unix sockets inside its own node, and a pump here forwards its
outgoing frames into the frontend's inbox, where they are decoded and checked like any other.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import subprocess
import sys
import threading

import zmq
import zmq.asyncio

log = logging.getLogger("hetserve.links")


class LocalLink:
    def __init__(self, ctx: zmq.asyncio.Context, spec: dict):
        self.socket = ctx.socket(zmq.PUSH)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.SNDHWM, 0)  # no cap: a send to a live worker is never refused
        self.socket.bind(spec["to_worker"])
        self.proc = subprocess.Popen([sys.executable, "-m", "hetserve.serving.worker",
                                      json.dumps({**spec, "parent_pid": os.getpid()})])
        self.node = "local"

    async def send(self, raw: bytes) -> None:
        """Never waits. A frame no process can take (the worker died, its socket is closed for a
        restart) is dropped: a waiting send would hang its request (and fail once the socket
        closes), while the monitor ends a dead worker's requests with the reason."""
        try:
            await self.socket.send(raw, zmq.NOBLOCK)
        except zmq.ZMQError as e:
            log.warning("a frame for a worker that is gone was dropped (%s)", e)

    def exit_reason(self) -> str | None:
        """Why the worker is gone, or None while it runs."""
        code = self.proc.poll()
        return None if code is None else f"exit code {code}"

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    async def wait_exit(self, deadline: float) -> None:
        loop = asyncio.get_running_loop()
        while self.proc.poll() is None and loop.time() < deadline:
            await asyncio.sleep(0.05)
        self.kill()

    def restarted(self) -> bool:
        return False

    def close(self) -> None:
        """Its process is gone: unbind its socket (the pool starts a new one behind another)."""
        self.kill()
        self.socket.close(linger=0)


class RayLink:
    """A worker in a Ray actor. Ray restarts a dead actor up to `max_restarts` times; a restarted
    one loads the model again and says Ready, and the frontend lets it rejoin."""

    def __init__(self, ctx: zmq.asyncio.Context, spec: dict, inbox: str, ray_options: dict):
        from .ray_worker import start_actor

        self.actor = start_actor(spec, ray_options)
        self.node = "?"  # set by locate()
        self._push = ctx.socket(zmq.PUSH)  # into the frontend's own inbox, like a local worker's frames
        self._push.setsockopt(zmq.LINGER, 0)
        self._push.connect(inbox)
        self.dead: str | None = None
        self._restarts = 0
        self._rejoined = False  # a restarted actor spoke again; restarted() reports it once
        self.max_restarts = ray_options.get("max_restarts", 0)
        self._pump = asyncio.get_event_loop().create_task(self._pump_frames())

    async def locate(self) -> str:
        """The id of the node Ray placed the actor on (waits for the placement)."""
        self.node = await self.actor.node.remote()
        return self.node

    async def _pump_frames(self) -> None:
        import ray

        while True:
            try:
                frames = await self.actor.take.remote(0.2)
            except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError) as e:
                if self.dead is None:
                    self.dead = f"its Ray actor died ({type(e).__name__}: {str(e).splitlines()[0][:200]})"
                if self._restarts >= self.max_restarts:
                    return
                await asyncio.sleep(0.5)  # Ray is restarting it: ask again
                continue
            except Exception as e:  # e.g. the cluster went away
                self.dead = f"its Ray actor is unreachable ({type(e).__name__}: {str(e)[:200]})"
                return
            if self.dead is not None and frames:  # a restarted actor speaks again
                self._restarts += 1
                self.dead = None
                self._rejoined = True
            for f in frames:
                await self._push.send(f)

    def restarted(self) -> bool:
        """True once after a restarted actor spoke again (the frontend then accepts its new Ready)."""
        r, self._rejoined = self._rejoined, False
        return r

    async def send(self, raw: bytes) -> None:
        if self.dead is None:
            self.actor.deliver.remote(raw)  # in order: one caller, one executing thread for delivery

    def exit_reason(self) -> str | None:
        return self.dead

    def kill(self) -> None:
        import ray

        self._pump.cancel()
        try:
            ray.kill(self.actor, no_restart=True)
        except Exception:  # already gone
            pass

    async def wait_exit(self, deadline: float) -> None:
        import ray

        loop = asyncio.get_running_loop()
        try:
            await asyncio.wait_for(self.actor.stopped.remote(), max(deadline - loop.time(), 0.1))
        except (asyncio.TimeoutError, ray.exceptions.RayError):
            pass
        self.kill()


def connect_ray(address: str | None) -> None:
    """Join the Ray cluster at `address` (`auto`, `ray://host:port`, host:port), or start a local
    one (None). Ray's own security applies: see docs/server.md, "Securing the cluster"."""
    import signal

    import ray

    if not ray.is_initialized():
        # ray.init replaces the SIGTERM handler with sys.exit; the server's own (drain, then
        # exit within --shutdown-timeout) must stay.
        handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
        ray.init(address=address, namespace="hetserve", log_to_driver=False, include_dashboard=False
                 if address is None else None, ignore_reinit_error=True)
        if threading.current_thread() is threading.main_thread():  # (the Python API runs its loop on another)
            for s, h in handlers.items():
                signal.signal(s, h)


def ray_options(req: dict, restarts: int) -> dict:
    """ray.remote options for a worker's resource request (devices.py): CPUs, a GPU, and a node,
    given as a node id (hex, as `ray list nodes` prints it) or a custom resource that node has."""
    opts = {"num_cpus": req["num_cpus"], "num_gpus": req["num_gpus"], "max_restarts": restarts,
            "max_task_retries": 0}
    node = req.get("node")
    if node:
        if len(node) == 56 and all(c in "0123456789abcdef" for c in node):
            from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

            opts["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node, soft=False)
        else:
            opts["resources"] = {node: 0.001}
    return opts
