"""The server's frontend (worker processes + router) driven from synchronous Python code.

`LLM(..., devices=[...])` with several devices uses this: one worker process per device,
exactly as `hetserve serve` starts them, and the frontend's event loop on a background
thread. Calls block until their requests finish.
"""

from __future__ import annotations

import asyncio
import atexit
import queue
import threading
from collections.abc import Iterator

from ..core.output_processor import RequestOutput
from ..sampling_params import SamplingParams
from .frontend import Frontend


class RoutedEngine:
    def __init__(self, model: str, devices: list[str], dtype: str, engine_kwargs: dict, **frontend_kwargs):
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="hetserve-frontend", daemon=True)
        self._thread.start()
        self.frontend = Frontend(model, engine_kwargs, devices=devices, dtype=dtype, **frontend_kwargs)
        self._call(self.frontend.start())
        atexit.register(self.close)  # stop the workers and remove the socket directory even without close()

    def _call(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    async def _one(self, prompt_ids: list[int], params: SamplingParams, rid: str, sink=None) -> RequestOutput:
        out = RequestOutput(rid, list(prompt_ids))
        async for d in self.frontend.generate(prompt_ids, params, request_id=rid):
            out.text += d.text
            out.token_ids += d.token_ids
            out.logprobs += d.logprobs
            if d.prompt_logprobs is not None:
                out.prompt_logprobs = d.prompt_logprobs
            out.num_cached_tokens = d.num_cached_tokens
            if sink is not None and d.text:
                sink.put(d.text)
            if d.finished:
                out.finished, out.finish_reason = True, d.finish_reason
        return out

    def generate(self, prompts: list[list[int]], params: list[SamplingParams], rids: list[str]) -> list[RequestOutput]:
        async def all_of():
            return await asyncio.gather(*[self._one(p, sp, r) for p, sp, r in zip(prompts, params, rids)])

        return self._call(all_of())

    def stream(self, prompt: list[int], params: SamplingParams, rid: str) -> Iterator[str | RequestOutput]:
        """Text deltas, then the final RequestOutput."""
        sink: queue.Queue = queue.Queue()
        fut = asyncio.run_coroutine_threadsafe(self._one(prompt, params, rid, sink), self._loop)
        fut.add_done_callback(lambda _: sink.put(None))
        try:
            while (item := sink.get()) is not None:
                yield item
            yield fut.result()
        finally:
            fut.cancel()  # a consumer that stops early aborts the request in its worker

    def close(self) -> None:
        if self._thread.is_alive() and not self._loop.is_closed():
            atexit.unregister(self.close)
            self._call(self.frontend.shutdown())
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
