"""A worker as a Ray actor: the same worker loop as a local process (serving/worker.py), on a
thread of the actor, reached through methods that carry msgpack frames as bytes.

The actor resolves the model on its own node (a registry name: pulled into that node's cache
and sha256-verified; a path: must exist there): weights never cross the wire. Its spec travels
as JSON text, its frames as bytes: Ray never unpickles anything of ours.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import threading

import ray
import zmq

from . import ipc

log = logging.getLogger("hetserve.ray_worker")

MAX_FRAMES = 256  # per take: a burst of outputs crosses in a few calls, not one huge one


class RayWorker:
    def __init__(self, spec_json: str):
        from .worker import serve

        spec = json.loads(spec_json)
        self._dir = ipc.private_socket_dir()
        self._ctx = zmq.Context()
        self._in = self._ctx.socket(zmq.PUSH)
        self._in.bind(f"ipc://{self._dir}/in")
        self._out = self._ctx.socket(zmq.PULL)
        self._out.bind(f"ipc://{self._dir}/out")
        # parent_pid: the actor's process is its node's raylet's child, so a node that is gone
        # (removed, its raylet killed) takes the worker with it, rather than leaving it serving
        # through direct actor calls that outlive the raylet.
        spec.update(to_worker=f"ipc://{self._dir}/in", from_worker=f"ipc://{self._dir}/out", parent_pid=os.getppid())
        self._done = threading.Event()

        def run():
            code = 1
            try:
                code = serve(spec)  # 0 on Shutdown; the frontend then kills the actor for good
            except BaseException:
                log.exception("worker %s failed", spec["name"])
            finally:
                self._done.set()
                shutil.rmtree(self._dir, ignore_errors=True)
            if code:  # a failed load or loop (a model it cannot load has said why in one line):
                os._exit(code)  # the actor dies with it (Ray may restart it)

        threading.Thread(target=run, daemon=True, name="hetserve-worker").start()

    @ray.method(concurrency_group="control")
    def node(self) -> str:
        return ray.get_runtime_context().get_node_id()

    @ray.method(concurrency_group="deliver")
    def deliver(self, raw: bytes) -> None:
        self._in.send(raw)

    @ray.method(concurrency_group="take")
    def take(self, timeout_s: float) -> list[bytes]:
        """The worker's frames so far, waiting up to timeout_s for the first."""
        frames = []
        if self._out.poll(int(timeout_s * 1000)):
            while len(frames) < MAX_FRAMES:
                try:
                    frames.append(self._out.recv(zmq.NOBLOCK))
                except zmq.Again:
                    break
        return frames

    @ray.method(concurrency_group="control")
    def stopped(self) -> bool:
        return self._done.wait(30)


def start_actor(spec: dict, options: dict):
    """Create the actor with the worker's resource request (options: ray.remote options)."""
    # Each method group on a thread of its own: a take waiting for frames never holds up a
    # delivery, and deliveries keep their order (one thread, one caller).
    cls = ray.remote(concurrency_groups={"deliver": 1, "take": 1, "control": 1})(RayWorker)
    return cls.options(**options).remote(json.dumps(spec))
