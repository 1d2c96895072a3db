"""The in-process Python API: `LLM(model=...).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator, Sequence
from typing import Any

from tqdm import tqdm

from .core.loading import load_engine
from .core.output_processor import RequestOutput, RequestState
from .core.request import Request, RequestStatus
from .models import registry
from .models.tokenizer import PROMPT_PARSES_SPECIAL
from .sampling_params import SamplingParams

Prompt = str | Sequence[int]


class LLM:
    """One engine on one device, run in this process; or, with several `devices`, one worker
    process per device behind the server's router (as `hetserve serve` runs them).

    Every engine setting is a keyword argument named like its CLI flag
    (`--max-num-seqs` is `max_num_seqs`). `devices` takes `--inference-device` values
    (`["cpu:threads=1", "cuda"]`, with optional ",key=value" overrides); with several, `engine`
    is None, `route_policy` / `route_log` / `profiles` (profile JSON objects) work as on
    `serve`, and `close()` stops the workers. `ray:` devices run in Ray actors on the cluster at
    `ray_address` (None: a local one), restarted up to `ray_restarts` times; a local worker
    process that dies is started again up to `worker_restarts` times."""

    def __init__(self, model: str = registry.DEFAULT_MODEL, device: str = "cpu", dtype: str = "float32",
                 devices: list[str] | None = None, route_policy: str | None = None, route_log: str | None = None,
                 profiles: list[dict] | None = None, ray_address: str | None = None, ray_restarts: int = 0,
                 worker_restarts: int = 3, **engine_kwargs: Any):
        self._ids = itertools.count()
        self._routed = None
        if devices and (len(devices) > 1 or any(d.startswith("ray:") for d in devices)):
            from .serving.routed_llm import RoutedEngine

            self._routed = RoutedEngine(model, list(devices), dtype, engine_kwargs, route_policy=route_policy,
                                        route_log=route_log, profiles=profiles, max_queued_requests=1 << 30,
                                        ray_address=ray_address, ray_restarts=ray_restarts,
                                        worker_restarts=worker_restarts)
            fe = self._routed.frontend
            self.path, self.tokenizer = fe.model_path, fe.tokenizer
            self.model = self.config = self.engine = None
            return
        if devices:  # one device: in this process, with its overrides
            from .serving.devices import parse_devices

            spec = parse_devices(list(devices), engine_kwargs, dtype)[0]
            if spec.threads:
                import torch

                torch.set_num_threads(spec.threads)
            device, dtype, engine_kwargs = spec.device, spec.dtype, spec.engine
        loaded = load_engine(model, device, dtype, **engine_kwargs)
        self.path, self.tokenizer, self.model = loaded.path, loaded.tokenizer, loaded.model
        self.config, self.engine = loaded.config, loaded.engine

    def close(self) -> None:
        """Stop the worker processes (several devices); nothing to do for one."""
        if self._routed is not None:
            self._routed.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def perplexity(self, prompt: Prompt, chunk: int = 32) -> float:
        """Teacher-forced perplexity of a text (or token ids) under this engine's weights, fed
        `chunk` tokens per forward (chunks up to quant_max_rows run the int8/int4 kernels)."""
        from .models.perplexity import from_logprobs

        return from_logprobs(self.token_logprobs(prompt, chunk))

    def token_logprobs(self, prompt: Prompt, chunk: int = 32):
        """log p(token i | tokens before it) for every token of a text but the first, as
        `perplexity` scores them (models/perplexity.py)."""
        from .models.perplexity import token_logprobs

        return token_logprobs(self.model, self.encode(prompt), chunk)

    # -- prompts ----------------------------------------------------------------------------------
    def encode(self, prompt: Prompt, parse_special: bool = PROMPT_PARSES_SPECIAL) -> list[int]:
        """Text is a raw prompt, tokenized as the server's completions do (special-token spellings
        are special tokens unless parse_special=False); lists are token ids."""
        if isinstance(prompt, str):
            return self.tokenizer.encode_prompt(prompt, parse_special)
        return [int(t) for t in prompt]

    def _add(self, prompt_ids: list[int], params: SamplingParams) -> RequestState:
        req = Request(f"req-{next(self._ids)}", prompt_ids, params)
        self.engine.add_request(req)
        return RequestState(self.tokenizer, params, req)

    # -- generation -------------------------------------------------------------------------------
    def generate(self, prompts: Prompt | Sequence[Prompt], params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Run all prompts together (continuous batching); outputs come back in prompt order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        if self._routed is not None:
            ids = [self.encode(p) for p in prompts]
            return self._routed.generate(ids, [SamplingParams(**vars(sp)) for sp in params],
                                         [f"req-{next(self._ids)}" for _ in ids])
        # Copy params: the engine resolves max_tokens per request.
        states = [self._add(self.encode(p), SamplingParams(**vars(sp))) for p, sp in zip(prompts, params)]
        by_id = {s.req.request_id: s for s in states}
        outputs = {s.req.request_id: self._output(s) for s in states}
        done, generated, t0 = 0, 0, time.monotonic()
        with tqdm(total=len(states), desc="generate", unit="req", disable=not use_tqdm) as bar:
            try:
                while self.engine.has_unfinished_requests():
                    for eo in self.engine.step():
                        st = by_id[eo.request_id]
                        generated += len(eo.new_token_ids)
                        if self._apply(st, eo.new_token_ids, eo.finished, eo.finish_reason, outputs[eo.request_id]):
                            done += 1
                            bar.update(1)
                    bar.set_postfix_str(f"{generated / max(time.monotonic() - t0, 1e-9):.1f} tok/s", refresh=False)
            except BaseException:
                for rid in outputs:
                    self.engine.abort(rid)
                raise
        return [outputs[s.req.request_id] for s in states]

    def stream(self, prompt: Prompt, params: SamplingParams | None = None) -> Iterator[str]:
        """Yield text deltas of one request as they are generated; the final RequestOutput is
        available as `self.last_output` afterwards."""
        if self._routed is not None:
            for item in self._routed.stream(self.encode(prompt), SamplingParams(**vars(params or SamplingParams())),
                                            f"req-{next(self._ids)}"):
                if isinstance(item, str):
                    yield item
                else:
                    self.last_output = item
            return
        st = self._add(self.encode(prompt), SamplingParams(**vars(params or SamplingParams())))
        out = self._output(st)
        try:
            while not out.finished:
                for eo in self.engine.step():
                    if eo.request_id != st.req.request_id:
                        continue
                    before = len(out.text)
                    self._apply(st, eo.new_token_ids, eo.finished, eo.finish_reason, out, stream=True)
                    if len(out.text) > before:
                        yield out.text[before:]
        finally:
            if not out.finished:
                self.engine.abort(st.req.request_id)
            self.last_output = out

    def chat(self, messages: list[dict] | list[list[dict]], params: SamplingParams | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True) -> list[RequestOutput]:
        """One conversation (a list of messages) or several; renders the model's chat template."""
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        ids = [self.tokenizer.encode_chat(c, add_generation_prompt=add_generation_prompt) for c in convs]
        return self.generate(ids, params, use_tqdm=use_tqdm)

    # -- bookkeeping ------------------------------------------------------------------------------
    @staticmethod
    def _output(st: RequestState) -> RequestOutput:
        return RequestOutput(st.req.request_id, st.req.prompt_token_ids)

    def _apply(self, st: RequestState, token_ids: list[int], finished: bool, reason: str | None,
               out: RequestOutput, stream: bool = False) -> bool:
        """Fold one engine output into the request's output; True when it just finished."""
        delta = st.add(token_ids, finished)
        out.text += delta
        req = st.req
        if st.stopped_by is not None and not finished:
            self.engine.abort(req.request_id, RequestStatus.FINISHED_STOPPED)  # free its pages now
            finished, reason = True, "stop"
        out.token_ids = req.output_token_ids
        out.logprobs = req.logprobs
        if req.params.prompt_logprobs is not None:
            out.prompt_logprobs = req.prompt_logprobs
        out.num_cached_tokens = req.num_cached_tokens
        if not finished:
            return False
        out.finished, out.finish_reason = True, reason
        if st.stopped_by is not None:
            out.stop_reason = st.stopped_by
        elif reason == "stop" and out.token_ids:
            out.stop_reason = out.token_ids[-1]
        m = req.metrics
        out.metrics = {
            "arrival_time": m.arrival_time,
            "first_scheduled_time": m.first_scheduled_time,
            "first_token_time": m.first_token_time,
            "finished_time": m.finished_time or time.monotonic(),
            "num_prompt_tokens": req.num_prompt_tokens,
            "num_output_tokens": req.num_output_tokens,
            "num_preemptions": m.num_preemptions,
        }
        if req.spec is not None:  # proposed, accepted, acceptance_rate, mean_accepted_length, rounds, k_histogram
            out.metrics["spec_decode"] = req.spec.as_dict()
        return True
