"""Tokenization and chat-template rendering in processes of their own, with a time budget.

The `tokenizers` library holds Python's global lock while it encodes, and a chat template is
untrusted code from the model file that may loop for ever. Run in the API process, either
stalls the event loop (every stream, /health) and, on one shared thread, queues every other
request behind it. So the API process sends this work to tokenizer processes (msgpack over a
private ZMQ socket, never pickle): a job that overruns its budget gets its process killed and
restarted and a clear error; a job whose client left before it started is dropped unrun.

Started as `python -m hetserve.serving.tokenizer_service MODEL_PATH ADDRESS PARENT_PID`.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import subprocess
import sys
from dataclasses import dataclass, field
from typing import NoReturn

import msgpack
import zmq
import zmq.asyncio

from .process_exit import exit_with_parent

log = logging.getLogger("hetserve.tokenizer")

# A conversation the load-time template check renders (a system turn, two user turns, an answer).
_PROBE = [{"role": "system", "content": "You are helpful."}, {"role": "user", "content": "Hi"},
          {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Thanks"}]


class TokenizeFailed(ValueError):
    """The job's input or the model's template is at fault: a 400 for the client."""


class TokenizeBudgetExceeded(TokenizeFailed):
    pass


# -- the tokenizer process --------------------------------------------------------------------

def _capped(ids: list[int], limit: int | None):
    """Ids over `limit` stay here: only their count goes back (a prompt far over the context would
    otherwise cost the API process's event loop the unpacking of millions of ids to refuse it)."""
    return {"too_long": len(ids)} if limit is not None and len(ids) > limit else ids


def _ops(tok):
    return {
        "encode_prompt": lambda text, parse_special, limit=None: _capped(tok.encode_prompt(text, parse_special),
                                                                         limit),
        "encode_chat": lambda messages, add_generation_prompt=True, tools=None, limit=None: _capped(
            tok.encode_chat(messages, add_generation_prompt=add_generation_prompt, tools=tools), limit),
        "encode_infill": lambda prefix, suffix, extra, filename, budget, max_suffix=None: list(
            tok.encode_infill(prefix, suffix, extra, filename, budget=budget, max_suffix=max_suffix)),
        "decode": lambda ids, skip_special_tokens=True: tok.decode(ids, skip_special_tokens),
        "check_template": lambda: len(tok.encode_chat(_PROBE, add_generation_prompt=True)),
    }


def serve(model_path: str, address: str) -> NoReturn:
    """Answers jobs until the process is killed: by the API process (a job over its budget, the
    shutdown) or by exit_with_parent once the API process is gone."""
    from ..models.gguf_loader import GGUFFile
    from ..models.tokenizer import Tokenizer

    with GGUFFile(model_path) as f:
        tok = Tokenizer.from_gguf_metadata(f.metadata)
    ops = _ops(tok)
    sock = zmq.Context().socket(zmq.PAIR)
    sock.connect(address)
    sock.send(msgpack.packb({"ready": os.getpid()}))
    while True:
        try:
            job = msgpack.unpackb(sock.recv(), raw=False)
            reply = {"id": job["id"], "result": ops[job["op"]](**job["args"])}
        except (ValueError, TypeError, KeyError, RecursionError) as e:  # ChatTemplateError is a ValueError
            reply = {"id": job.get("id") if isinstance(job, dict) else None, "error": str(e)}
        sock.send(msgpack.packb(reply, use_bin_type=True))


# -- the API process side ---------------------------------------------------------------------

@dataclass
class _Job:
    op: str
    args: dict
    future: asyncio.Future
    id: int = 0


@dataclass
class _Process:
    index: int
    proc: subprocess.Popen | None = None
    sock: zmq.asyncio.Socket | None = None
    busy: _Job | None = None
    restarts: int = 0
    task: asyncio.Task | None = field(default=None, repr=False)


class TokenizerPool:
    """`await pool.call("encode_prompt", text=...)`: jobs in arrival order over `processes` processes.
    `timeout` is each job's budget once a process has taken it."""

    def __init__(self, model_path: str, socket_dir: str, processes: int = 2, timeout: float = 10.0,
                 start_timeout: float = 120.0):
        self.model_path, self.dir, self.timeout, self.start_timeout = model_path, socket_dir, timeout, start_timeout
        self._ctx = zmq.asyncio.Context()
        self._procs = [_Process(i) for i in range(max(1, processes))]
        self._queue: collections.deque[_Job] = collections.deque()
        self._wake = asyncio.Event()
        self._ids = 0
        self.dropped = 0  # jobs whose caller left before they started
        self.timeouts = 0

    async def start(self) -> None:
        await asyncio.gather(*(self._spawn(p) for p in self._procs))
        for p in self._procs:
            p.task = asyncio.create_task(self._serve(p))

    async def _spawn(self, p: _Process) -> None:
        address = f"ipc://{self.dir}/tok{p.index}"
        p.sock = self._ctx.socket(zmq.PAIR)
        p.sock.setsockopt(zmq.LINGER, 0)
        p.sock.bind(address)
        p.proc = subprocess.Popen([sys.executable, "-m", "hetserve.serving.tokenizer_service", self.model_path,
                                   address, str(os.getpid())])
        try:
            await asyncio.wait_for(p.sock.recv(), self.start_timeout)
        except asyncio.TimeoutError:
            raise RuntimeError(f"tokenizer process {p.index} did not start in {self.start_timeout:.0f} s") from None

    def _kill(self, p: _Process) -> None:
        if p.proc is not None and p.proc.poll() is None:
            p.proc.kill()
            p.proc.wait()
        if p.sock is not None:
            p.sock.close(linger=0)

    async def call(self, op: str, **args):
        self._ids += 1
        job = _Job(op, args, asyncio.get_running_loop().create_future(), self._ids)
        self._queue.append(job)
        self._wake.set()
        try:
            return await job.future
        except asyncio.CancelledError:
            if job in self._queue:  # not started: drop it (its client is gone)
                self._queue.remove(job)
                self.dropped += 1
            raise

    async def _serve(self, p: _Process) -> None:
        while True:
            while not self._queue:
                self._wake.clear()
                await self._wake.wait()
            job = self._queue.popleft()
            if job.future.done():
                continue
            p.busy = job
            try:
                await p.sock.send(msgpack.packb({"id": job.id, "op": job.op, "args": job.args}, use_bin_type=True))
                reply = None
                while reply is None or reply.get("id") != job.id:  # a killed predecessor's reply is never read
                    reply = msgpack.unpackb(await asyncio.wait_for(p.sock.recv(), self.timeout), raw=False)
            except asyncio.TimeoutError:
                self.timeouts += 1
                what = "chat template rendering" if job.op == "encode_chat" else "tokenization"
                log.warning("%s ran past its %.1f s budget; restarting tokenizer process %d", what, self.timeout,
                            p.index)
                if not job.future.done():
                    job.future.set_exception(TokenizeBudgetExceeded(
                        f"{what} took longer than the server's budget of {self.timeout:g} s"))
                await self._restart(p)
                continue
            except Exception as e:  # the process died under the job, or the socket failed
                log.error("tokenizer process %d failed: %s; restarting it", p.index, e)
                if not job.future.done():
                    job.future.set_exception(RuntimeError("the tokenizer process failed"))
                await self._restart(p)
                continue
            finally:
                p.busy = None
            if not job.future.done():
                if "error" in reply:
                    job.future.set_exception(TokenizeFailed(reply["error"]))
                else:
                    job.future.set_result(reply["result"])

    async def _restart(self, p: _Process) -> None:
        self._kill(p)
        p.restarts += 1
        await self._spawn(p)

    def shutdown(self) -> None:
        for p in self._procs:
            if p.task is not None:
                p.task.cancel()
            self._kill(p)
        for job in self._queue:
            if not job.future.done():
                job.future.cancel()
        self._queue.clear()
        self._ctx.destroy(linger=0)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    exit_with_parent(int(argv[2]))  # the API process is gone: do not linger as an orphan
    try:
        serve(argv[0], argv[1])
    except KeyboardInterrupt:
        return 0


if __name__ == "__main__":
    sys.exit(main())
