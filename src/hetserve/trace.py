"""Chrome/Perfetto trace spans and NVTX ranges.

`span(name, **args)` is a context manager used around each step, forward, layer, matmul...
When tracing is off (the default) it returns one shared no-op context manager: the cost is
a global lookup and a call. When on, it records a begin and an end event on the calling
thread, and on CUDA also pushes an NVTX range that is popped exactly when the scope exits
(never deciding anything from push/pop's return values, which differ between NVTX
implementations). `instant` and `counter` add request events and counter tracks.

Each process writes one file, `trace-<name>-<pid>.json`, that Perfetto and
chrome://tracing open.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import threading
import time
from typing import Any

log = logging.getLogger(__name__)

MAX_EVENTS = 2_000_000  # about 200 MB of JSON; beyond it recording stops with a warning
_NULL = contextlib.nullcontext()


class Tracer:
    def __init__(self, directory: str, name: str, nvtx=None):
        self.path = os.path.join(directory, f"trace-{name}-{os.getpid()}.json")
        os.makedirs(directory, exist_ok=True)
        self.events: list[dict] = [{"ph": "M", "name": "process_name", "pid": os.getpid(), "tid": 0,
                                    "args": {"name": f"hetserve {name}"}}]
        self.nvtx = nvtx
        self._t0 = time.perf_counter_ns()
        self._pid = os.getpid()
        self._full = False
        self._lock = threading.Lock()

    def _now_us(self) -> float:
        return (time.perf_counter_ns() - self._t0) / 1000.0

    def _add(self, ev: dict) -> None:
        with self._lock:
            if len(self.events) >= MAX_EVENTS:
                if not self._full:
                    self._full = True
                    log.warning("trace %s reached %d events; recording stopped", self.path, MAX_EVENTS)
                return
            self.events.append(ev)

    @contextlib.contextmanager
    def span(self, name: str, args: dict[str, Any] | None = None):
        tid = threading.get_ident()
        self._add({"ph": "B", "name": name, "ts": self._now_us(), "pid": self._pid, "tid": tid,
                   **({"args": args} if args else {})})
        if self.nvtx is not None:
            self.nvtx.range_push(name)
        try:
            yield
        finally:
            if self.nvtx is not None:
                self.nvtx.range_pop()
            self._add({"ph": "E", "name": name, "ts": self._now_us(), "pid": self._pid, "tid": tid})

    def instant(self, name: str, args: dict[str, Any] | None = None) -> None:
        self._add({"ph": "i", "s": "p", "name": name, "ts": self._now_us(), "pid": self._pid,
                   "tid": threading.get_ident(), **({"args": args} if args else {})})

    def counter(self, name: str, values: dict[str, float]) -> None:
        self._add({"ph": "C", "name": name, "ts": self._now_us(), "pid": self._pid, "tid": 0, "args": values})

    def write(self) -> str:
        with self._lock:
            data = {"traceEvents": list(self.events), "displayTimeUnit": "ms"}
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(data, f)
        os.replace(tmp, self.path)
        return self.path


_tracer: Tracer | None = None


def start(directory: str, name: str, device: str = "cpu", nvtx=None) -> Tracer:
    """Turn tracing on for this process; the file is written at exit (and by `stop`)."""
    global _tracer
    if nvtx is None and str(device).startswith("cuda"):
        import torch

        nvtx = torch.cuda.nvtx
    _tracer = Tracer(directory, name, nvtx)
    atexit.register(stop)
    return _tracer


def stop() -> str | None:
    global _tracer
    t, _tracer = _tracer, None
    return t.write() if t is not None else None


def enabled() -> bool:
    return _tracer is not None


def span(name: str, **args: Any):
    t = _tracer
    if t is None:
        return _NULL
    return t.span(name, args)


def instant(name: str, **args: Any) -> None:
    if _tracer is not None:
        _tracer.instant(name, args)


def counter(name: str, **values: float) -> None:
    if _tracer is not None:
        _tracer.counter(name, values)
