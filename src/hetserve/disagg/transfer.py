"""KV export/import of one request between two EngineCores.

The exporter's request is parked after its prefill and first token (EngineCore.add_request
with prefill_only=True): its pages stay referenced, it is no longer scheduled. `export_request`
copies the KV of its computed tokens out, token by token in position order (so the two
pools' page sizes and page placement need not agree), as raw bytes per layer with dtype and
shape, plus the token ids, sampling parameters, generator state and page hashes. Nothing is
pickled: every field is a plain value or bytes.

`import_request` checks the payload against the receiver's model (layers, KV heads, head
size, byte counts), converts the dtype where the workers differ, allocates pages in the
receiver's pool (NoRoomYet when they are not free now or max_num_seqs requests run there,
TransferError when the payload is wrong or the request can never fit; the receiver's pool is
untouched either way),
copies the KV in, publishes the full pages to its prefix cache and hands the request to the
scheduler as a running, decoding request. The exporter frees its pages with
`engine.abort(request_id, FINISHED_STOPPED)` once the receiver has acknowledged (that also
publishes them to the exporter's prefix cache), or with FINISHED_ABORTED on failure.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field

import torch

from ..core.request import Request, RequestStatus
from ..layers import kv_quant
from ..sampling_params import SamplingParams

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "int8": torch.int8}


class TransferError(RuntimeError):
    """A KV transfer that cannot be installed (does not fit, or does not match this model)."""


class NoRoomYet(TransferError):
    """The pages are not free now (the request would fit the pool): the receiver may retry after
    its running requests free pages, or give up."""


@dataclass
class KVExport:
    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    params: dict  # SamplingParams fields
    cache_salt: str | None
    num_computed_tokens: int  # tokens whose KV is in k / v (the prompt; the first output token is not)
    page_size: int  # the exporter's page size (hashes are over pages of this size)
    dtype: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    # per layer: [num_computed_tokens, kv_heads, head_dim] (int8: q8_0 rows of head_dim / 32 * 34)
    k: list[bytes] = field(default_factory=list)
    v: list[bytes] = field(default_factory=list)
    page_hashes: list[bytes] = field(default_factory=list)  # full pages of the computed tokens
    generator_state: bytes | None = None  # seeded sampling continues the same random stream
    num_cached_tokens: int = 0

    @property
    def nbytes(self) -> int:
        return sum(len(b) for b in self.k) + sum(len(b) for b in self.v)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _slots(block_ids: list[int], page_size: int, n: int) -> torch.Tensor:
    pos = torch.arange(n)
    return torch.tensor(block_ids, dtype=torch.long)[pos // page_size] * page_size + pos % page_size


def _raw(t: torch.Tensor) -> bytes:
    return t.contiguous().cpu().view(torch.uint8).numpy().tobytes()


def export_request(engine, request_id: str) -> KVExport:
    """The KV and state of a request parked after its prefill (see EngineCore.parked)."""
    req = engine.parked.get(request_id)
    if req is None:
        raise TransferError(f"request {request_id!r} is not parked for export here")
    n = req.num_computed_tokens
    ps = engine.pool.page_size
    slots = _slots(req.block_ids, ps, n).to(engine.model.device)
    ks, vs = [], []
    with torch.inference_mode():
        for k_cache, v_cache in engine.runner.kv_caches:
            ks.append(_raw(k_cache[slots]))
            vs.append(_raw(v_cache[slots]))
    k0 = engine.runner.kv_caches[0][0]
    hashes = engine.scheduler._hashes(req)[:n // ps] if engine.prefix_cache is not None else []
    gen = _raw(req.generator.get_state()) if req.generator is not None else None
    return KVExport(req.request_id, list(req.prompt_token_ids), list(req.output_token_ids),
                    req.params.to_wire(),
                    req.cache_salt, n, ps, str(k0.dtype).removeprefix("torch."), len(engine.runner.kv_caches),
                    k0.shape[1], engine.model.config.head_dim, ks, vs, list(hashes), gen, req.num_cached_tokens)


def _tensor(raw: bytes, dtype: torch.dtype, shape: tuple[int, ...], what: str) -> torch.Tensor:
    want = dtype.itemsize
    for s in shape:
        want *= s
    if not isinstance(raw, (bytes, bytearray)) or len(raw) != want:
        raise TransferError(f"{what}: expected {want} bytes for {list(shape)} {dtype}, got "
                            f"{len(raw) if isinstance(raw, (bytes, bytearray)) else type(raw).__name__}")
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype).reshape(shape)


def check(engine, x: KVExport) -> None:
    """Everything about the payload that can be checked before touching the pool."""
    cache = engine.runner.kv_caches
    k0 = cache[0][0]
    if x.dtype not in DTYPES:
        raise TransferError(f"unknown KV dtype {x.dtype!r}")
    head_dim = engine.model.config.head_dim
    if (x.num_layers, x.num_kv_heads, x.head_dim) != (len(cache), k0.shape[1], head_dim):
        raise TransferError(f"KV layout {x.num_layers} layers x {x.num_kv_heads} heads x {x.head_dim} does not "
                            f"match this model's {len(cache)} x {k0.shape[1]} x {head_dim}")
    if DTYPES[x.dtype] == torch.int8 and head_dim % kv_quant.BLOCK:
        raise TransferError(f"an int8 KV payload needs a head size that is a multiple of {kv_quant.BLOCK}")
    if len(x.k) != x.num_layers or len(x.v) != x.num_layers:
        raise TransferError("need one K and one V buffer per layer")
    if not 0 < x.num_computed_tokens <= len(x.prompt_token_ids) + len(x.output_token_ids) - 1:
        raise TransferError(f"num_computed_tokens={x.num_computed_tokens} does not fit the request's tokens")
    if not x.output_token_ids:
        raise TransferError("a transferred request has its first token already")
    if x.request_id in engine.requests:
        raise TransferError(f"duplicate request id {x.request_id!r}")


def import_request(engine, x: KVExport, now: float | None = None) -> Request:
    """Install an exported request; it decodes from the next step on. Raises TransferError,
    with the pool untouched, when the payload is wrong or its pages do not fit."""
    check(engine, x)
    try:
        params = SamplingParams(**x.params)
    except TypeError as e:
        raise TransferError(f"bad sampling parameters: {e}") from None
    req = Request(x.request_id, x.prompt_token_ids, params, arrival_time=now, cache_salt=x.cache_salt)
    req.all_token_ids += list(x.output_token_ids)
    # The same admission rule as a new request (params.max_tokens is already resolved).
    engine.max_tokens_for(req.num_prompt_tokens, params.max_tokens)
    if x.generator_state is not None:
        req.generator = torch.Generator()
        req.generator.set_state(torch.frombuffer(bytearray(x.generator_state), dtype=torch.uint8))
    n = x.num_computed_tokens
    src_dtype = DTYPES[x.dtype]
    shape = (n, x.num_kv_heads, kv_quant.row_elems(src_dtype, x.head_dim))
    cache = engine.runner.kv_caches
    ks = [_tensor(b, src_dtype, shape, f"layer {i} K") for i, b in enumerate(x.k)]
    vs = [_tensor(b, src_dtype, shape, f"layer {i} V") for i, b in enumerate(x.v)]
    ps = engine.pool.page_size
    if engine.prefix_cache is not None and x.page_hashes and x.page_size == ps:
        ours = engine.scheduler._hashes(req)[:len(x.page_hashes)]
        if ours != list(x.page_hashes):
            raise TransferError("page hashes differ from this worker's: the workers serve different models "
                                "(or cache salts)")
        req.page_hashes = []  # recomputed lazily; the check above is all they are for
    running = len(engine.scheduler.running)
    if running >= engine.config.max_num_seqs:  # the receiver's batch cap holds for imports too
        raise NoRoomYet(f"the KV transfer of {x.request_id!r} waits: {running} requests running here "
                        f"(max_num_seqs={engine.config.max_num_seqs})")
    need = engine.pool.pages_for(n + 1)  # the computed tokens and the next token's KV
    if need > engine.pool.num_free:
        raise NoRoomYet(f"the KV transfer of {x.request_id!r} needs {need} pages of {ps} tokens, "
                            f"{engine.pool.num_free} free here")
    total = engine.pool.pages_for(req.num_prompt_tokens + params.max_tokens)
    req.block_ids = engine.pool.allocate(need, total_hint=total)
    slots = _slots(req.block_ids, ps, n).to(cache[0][0].device)
    with torch.inference_mode():
        for (k_cache, v_cache), k, v in zip(cache, ks, vs):
            for rows, dst, keys in ((k, k_cache, True), (v, v_cache, False)):
                # the sender's rows as they are, or converted to this cache's dtype
                dst[slots] = (rows if rows.dtype == dst.dtype else kv_quant.convert(rows, dst.dtype, keys)).to(dst.device)
    req.num_computed_tokens = n
    req.num_cached_tokens = x.num_cached_tokens
    req.status = RequestStatus.RUNNING
    req.metrics.first_scheduled_time = req.metrics.first_token_time = time.monotonic()
    engine.install(req)
    return req
