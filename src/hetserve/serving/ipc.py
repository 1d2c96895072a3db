"""Typed messages between the API process and worker processes: msgpack over ZMQ, never pickle.

Each message is a dataclass; on the wire it is a msgpack map with a "type" field naming
the class and only plain values (ints, floats, strings, lists, maps). Decoding checks the
type name against the receiver's set of message types (each direction has its own), the
field names and every field's value against the dataclass's annotations, so a malformed,
unknown or misdirected message is an error, not code execution or a wedged loop.

Sockets live in a private directory (0700) as Unix domain sockets, so only this user
can connect.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import tempfile
import types
import typing
from dataclasses import dataclass, field
from typing import Any

import msgpack

from ..disagg.transfer import KVExport


class IPCError(ValueError):
    pass


@dataclass
class AddRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: dict[str, Any]  # SamplingParams fields
    cache_salt: str | None = None
    prefill_only: bool = False  # disaggregated: stop after the first token, park, send a KVTransfer


@dataclass
class KVTransfer:
    """A prefilled request's KV pages and state: prefill worker -> frontend -> decode worker."""

    worker: str  # the prefill worker, which holds the pages until the frontend releases them
    export: KVExport
    export_s: float = 0.0  # seconds the prefill worker spent copying the KV out


@dataclass
class TransferAck:
    """The decode worker installed a KVTransfer (ok) or refused it (error); sent before any
    update of that request."""

    worker: str
    request_id: str
    ok: bool
    error: str | None = None
    import_s: float = 0.0


@dataclass
class Abort:
    request_id: str
    stopped: bool = False  # ended by a stop string in the frontend: a completion, not an abort


@dataclass
class Shutdown:
    pass


@dataclass
class Ready:
    worker: str
    pid: int
    vocab_size: int
    max_model_len: int
    num_pages: int
    page_size: int
    model_id: str = ""  # prefix-cache root key: the router hashes prompts with it
    max_num_seqs: int = 8
    profile: dict | None = None  # measured at start-up (router.Profile.to_json), unless given
    kv_bytes_per_token: int = 0  # what a KV transfer moves per computed token


@dataclass
class RequestUpdate:
    request_id: str
    new_token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None
    logprobs: list[list[list[float]]] = field(default_factory=list)  # per token: [[token, logprob], ...]
    prompt_logprobs: list[list[list[float]]] | None = None  # per prompt token, the first one's empty
    num_cached_tokens: int = 0
    queue_time_s: float | None = None  # first scheduled - arrival, sent with the first update
    error: str | None = None  # the worker refused or failed this request
    spec: dict[str, float] | None = None  # when it finishes while speculating: drafts proposed and accepted


@dataclass
class WorkerState:
    running: int
    waiting: int
    pages_used: int
    pages_total: int
    preemptions: int
    prefix_cache: dict[str, int] = field(default_factory=dict)
    spec_decode: dict[str, float] = field(default_factory=dict)  # flat: proposed, accepted, ..., k_<K> rounds
    queued_ids: list[str] = field(default_factory=list)  # waiting in the scheduler (or held)
    running_prefill: dict[str, int] = field(default_factory=dict)  # running id -> prompt tokens left
    published: list[bytes] = field(default_factory=list)  # page hashes cached since the last state
    evicted: list[bytes] = field(default_factory=list)  # page hashes dropped since the last state
    chunk_budget: int = 0  # prompt tokens a step may carry while requests decode (--max-decode-stall)
    steps: list[list] = field(default_factory=list)  # [prompt tokens, decode rows, seconds] of steps run since

    def __post_init__(self) -> None:
        # The router trusts these, so they are checked here rather than deep in its code.
        if not isinstance(self.queued_ids, list) or not all(isinstance(x, str) for x in self.queued_ids):
            raise TypeError("queued_ids must be a list of strings")
        rp = self.running_prefill
        if not isinstance(rp, dict) or not all(isinstance(k, str) and type(v) is int and v >= 0
                                               for k, v in rp.items()):
            raise TypeError("running_prefill must map request ids to token counts")
        if type(self.chunk_budget) is not int or self.chunk_budget < 0:
            raise TypeError("chunk_budget must be a non-negative integer")
        for name in ("published", "evicted"):
            v = getattr(self, name)
            if not isinstance(v, list) or not all(isinstance(h, bytes) and len(h) == 32 for h in v):
                raise TypeError(f"{name} must be a list of 32-byte page hashes")
        if not isinstance(self.steps, list) or not all(
                isinstance(x, list) and len(x) == 3 and type(x[0]) is int and type(x[1]) is int and x[0] >= 0
                and x[1] >= 0 and isinstance(x[2], float) and 0.0 <= x[2] < 3600.0 for x in self.steps):
            raise TypeError("steps must be [prompt tokens, decode rows, seconds] triples")


@dataclass
class Outputs:
    worker: str
    updates: list[RequestUpdate]
    state: WorkerState


@dataclass
class Heartbeat:
    """Sent by a worker's own thread every second, whatever its engine is doing: a worker that
    stops sending (stopped, hung, on a lost node) is declared dead after --worker-timeout."""

    worker: str


MESSAGES = {cls.__name__: cls for cls in (AddRequest, Abort, Shutdown, Ready, Outputs, KVTransfer, TransferAck,
                                          Heartbeat)}
TO_WORKER = frozenset({AddRequest, Abort, Shutdown, KVTransfer})
TO_FRONTEND = frozenset({Ready, Outputs, KVTransfer, TransferAck, Heartbeat})
_NESTED = {"updates": RequestUpdate, "state": WorkerState, "export": KVExport}


@functools.cache
def _hints(cls) -> dict:
    return typing.get_type_hints(cls)


def _fits(value, hint) -> bool:
    """Does a decoded value match a field annotation (plain types, unions, list/dict of them)?"""
    if hint is Any:
        return True
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_fits(value, h) for h in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if origin is list:
        (item,) = typing.get_args(hint) or (Any,)
        return isinstance(value, list) and all(_fits(v, item) for v in value)
    if origin is dict or hint is dict:
        key, val = typing.get_args(hint) or (Any, Any)
        return isinstance(value, dict) and all(_fits(k, key) and _fits(v, val) for k, v in value.items())
    return isinstance(value, hint)  # a plain type or a nested message dataclass


def encode(msg) -> bytes:
    if type(msg).__name__ not in MESSAGES:
        raise IPCError(f"not a message type: {type(msg).__name__}")
    return msgpack.packb({"type": type(msg).__name__, **dataclasses.asdict(msg)}, use_bin_type=True)


def _build(cls, data: dict):
    if not isinstance(data, dict):
        raise IPCError(f"{cls.__name__}: expected a map")
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = set(data) - names
    if unknown:
        raise IPCError(f"{cls.__name__}: unknown fields {sorted(unknown)}")
    kwargs = {}
    hints = _hints(cls)
    for k, v in data.items():
        nested = _NESTED.get(k)
        if nested is not None:
            v = [_build(nested, x) for x in v] if isinstance(v, list) else _build(nested, v)
        if not _fits(v, hints[k]):
            raise IPCError(f"{cls.__name__}.{k}: {type(v).__name__} does not fit {hints[k]}")
        kwargs[k] = v
    try:
        return cls(**kwargs)
    except TypeError as e:
        raise IPCError(f"{cls.__name__}: {e}") from None


def decode(raw: bytes, accept: frozenset = frozenset(MESSAGES.values())):
    """The message in `raw`, which must be one of the `accept` types (the receiver's direction)."""
    try:
        data = msgpack.unpackb(raw, raw=False, strict_map_key=True)
    except Exception as e:  # msgpack raises several exception types on bad input
        raise IPCError(f"undecodable message: {e}") from None
    if not isinstance(data, dict) or data.get("type") not in MESSAGES:
        raise IPCError(f"unknown message type: {data.get('type') if isinstance(data, dict) else type(data)}")
    cls = MESSAGES[data.pop("type")]
    if cls not in accept:
        raise IPCError(f"{cls.__name__} is not a message this side receives")
    return _build(cls, data)


def private_socket_dir() -> str:
    """A fresh directory only this user can enter; the sockets inside inherit that protection."""
    d = tempfile.mkdtemp(prefix="hetserve-ipc-")
    os.chmod(d, 0o700)
    return d
