"""Threads and cores for the local workers of one `serve` (or routed LLM), and for the API process.

torch gives every process a thread per core, so two CPU workers left at their default ran four
compute threads on a 2-core machine, each kernel's threads waiting on the other worker's: 6.3 and
16.3 output tok/s in two runs, against 28.5 and 29.0 placed as below (0.5B, 8 requests of 256 +
128 tokens, 4 at a time; docs/benchmarks.md, "Server"). So the cores this process may use (its
affinity mask) are shared out among the local CPU workers:

- a worker's `threads` stand as given; the workers without them split the cores the others
  leave, at least one thread each;
- where the threads fit the cores, each CPU worker is pinned to its own block of cores (its
  OpenMP threads then never share one with another worker's), and the cores no CPU worker holds
  are the API process's (`serve` moves it and its tokenizer processes there, off the engines'
  cores);
- where they do not fit, nothing is pinned (a warning says so), as before.

A single CPU worker without `threads` keeps torch's default and the whole mask. GPU workers keep
the whole mask (they are not counted), Ray workers are placed by Ray on their node.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass

from .devices import WorkerSpec

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Placement:
    threads: int | None  # torch threads (None: torch's default)
    cores: tuple[int, ...] | None  # the CPUs the worker is pinned to (None: left as it is)


def available_cores() -> list[int]:
    """The CPUs this process may run on."""
    return sorted(os.sched_getaffinity(0))


def place(specs: Sequence[WorkerSpec], cores: Sequence[int]) -> tuple[list[Placement], tuple[int, ...]]:
    """Each spec's placement, and the cores left for the API process (empty: it keeps its mask)."""
    cores = tuple(cores)
    local_cpu = [i for i, s in enumerate(specs) if s.ray is None and s.device == "cpu"]
    # Local GPU workers get the whole mask back, whatever the API process (their parent) is given.
    out = [Placement(s.threads, None if s.ray is not None or i in local_cpu else cores) for i, s in enumerate(specs)]
    if not local_cpu or (len(local_cpu) == 1 and specs[local_cpu[0]].threads is None):
        return out, ()
    given = sum(specs[i].threads or 0 for i in local_cpu)
    defaults = [i for i in local_cpu if specs[i].threads is None]
    left = max(len(cores) - given, 0)
    threads = {i: specs[i].threads for i in local_cpu}
    for k, i in enumerate(defaults):
        threads[i] = max(1, left // len(defaults) + (k < left % len(defaults)))
    total = sum(threads.values())
    if total > len(cores):
        log.warning("%d CPU worker threads on %d cores: the workers are not pinned and will share cores",
                    total, len(cores))
        return [Placement(threads[i], None) if i in threads else p for i, p in enumerate(out)], ()
    start = 0
    for i in local_cpu:
        out[i] = Placement(threads[i], cores[start:start + threads[i]])
        start += threads[i]
    return out, cores[start:]


def pin_process(cores: Sequence[int]) -> None:
    """Every thread of this process onto `cores` (sched_setaffinity moves only the thread that
    calls it; threads and processes started later inherit the caller's mask)."""
    mask = set(cores)
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), mask)
        except (ProcessLookupError, PermissionError):  # a thread that ended meanwhile
            pass


def describe(specs: Sequence[WorkerSpec], placements: Sequence[Placement], api_cores: Sequence[int]) -> str:
    """One line for the start-up log: the pinned CPU workers and the API process ('' if none)."""
    parts = [f"worker {s.name}: {p.threads} thread{'s' * (p.threads != 1)} on cores {list(p.cores)}"
             for s, p in zip(specs, placements) if s.device == "cpu" and p.cores]
    if api_cores:
        parts.append(f"API process on cores {list(api_cores)}")
    return "; ".join(parts)
