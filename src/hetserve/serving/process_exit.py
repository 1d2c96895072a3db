"""Ending a serving process without the interpreter's teardown.

Python's finalization frees every module; with torch loaded that takes 0.2-1 s (0.6-0.9 s measured
on a 2-core Zen 1 EPYC), time that counts against --shutdown-timeout twice: once in each worker
the API process waits for, once in the API process itself. A process that has finished its work
runs its atexit handlers (Ray's shutdown, multiprocessing's joins), flushes its output and leaves.

A child of the API process (a worker, a tokenizer process) also ends when the API process is gone,
however it went (kill -9 included), whatever the child is doing then: loading a model, building
kernels, stepping, or running a template that never ends. A Ray worker ends so with its node's
raylet.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import threading
import time
from typing import NoReturn

log = logging.getLogger("hetserve.process")


def exit_now(code: int) -> NoReturn:
    atexit._run_exitfuncs()  # what a normal exit would run first (the interpreter's own list)
    logging.shutdown()
    _flush()
    os._exit(code)


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe or stream: nothing left to say
            pass


def exit_with_parent(parent: int, interval_s: float = 0.5) -> None:
    """End this process within `interval_s` of its parent's end. The watch runs on a thread of its
    own because the main thread may be anywhere (a model load, a kernel build, a runaway template);
    it compares against the pid the parent passed down, so a parent gone before this process got
    here counts too (its orphans are re-parented to init or a subreaper, never back to that pid)."""
    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(interval_s)
        log.warning("parent process %d is gone: exiting", parent)
        _flush()
        os._exit(0)  # not exit_now: the main thread may hold what atexit handlers need; no one waits

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()
