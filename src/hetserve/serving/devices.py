"""`--inference-device` values -> one worker spec each.

    cpu | cpu:threads=N | cuda | cuda:N | gpu      then optional ",key=value" overrides

`gpu` takes the lowest accelerator index that no other value in the list names. Overrides
set this worker's dtype, threads or any engine setting (`cpu:threads=1,dtype=float32,
max_num_seqs=4`); the rest comes from the command line's engine flags.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

from ..core.config import EngineConfig

_BASE = re.compile(r"(cpu)(?::threads=(\d+))?|(cuda|gpu)(?::(\d+))?")
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


@dataclass
class WorkerSpec:
    spec: str  # the value as given, which also names the profile that fits it
    name: str
    device: str  # torch device string
    dtype: str
    threads: int | None
    engine: dict  # EngineConfig keyword arguments, overrides applied


def _convert(key: str, value: str, kind):
    if kind == "bool":
        if value.lower() not in _TRUE + _FALSE:
            raise ValueError(f"{key}={value!r}: expected true or false")
        return value.lower() in _TRUE
    if kind in ("int", "int | None"):
        try:
            return int(value)
        except ValueError:
            raise ValueError(f"{key}={value!r}: expected an integer") from None
    return value


def parse_devices(values: list[str], engine_kwargs: dict, dtype: str = "float32") -> list[WorkerSpec]:
    fields = {f.name: f.type for f in dataclasses.fields(EngineConfig)} | {"dtype": "str", "threads": "int"}
    fields.pop("device")
    named = set()
    for v in values:
        m = _BASE.fullmatch(v.split(",")[0].strip())
        if m and m.group(3) == "cuda":
            named.add(int(m.group(4) or 0))
    specs = []
    for i, value in enumerate(values):
        base, *overrides = [p.strip() for p in value.split(",")]
        m = _BASE.fullmatch(base)
        if m is None:
            raise ValueError(f"--inference-device {value!r}: expected cpu, cpu:threads=N, cuda, cuda:N or gpu, "
                             "then optional ,key=value overrides")
        threads = int(m.group(2)) if m.group(2) else None
        if m.group(1):
            device = "cpu"
        elif m.group(3) == "cuda":
            device = f"cuda:{int(m.group(4) or 0)}"
        else:
            if m.group(4) is not None:
                raise ValueError(f"--inference-device {value!r}: gpu takes no index (use cuda:N)")
            index = next(k for k in range(len(values) + len(named) + 1) if k not in named)
            named.add(index)
            device = f"cuda:{index}"
        kw, wdtype = dict(engine_kwargs), dtype
        for o in overrides:
            key, sep, val = o.partition("=")
            key = key.strip().replace("-", "_")
            if not sep or key not in fields:
                raise ValueError(f"--inference-device {value!r}: unknown override {o!r}; valid keys: "
                                 f"{', '.join(sorted(fields))}")
            val = _convert(key, val.strip(), fields[key])
            if key == "dtype":
                wdtype = val
            elif key == "threads":
                if val < 1:
                    raise ValueError(f"--inference-device {value!r}: threads must be >= 1")
                threads = val
            else:
                kw[key] = val
        EngineConfig(device=device, **{k: v for k, v in kw.items() if k != "device"})  # fail here, not in a worker
        kind = device.split(":")[0]
        name = f"{kind}{i}" if len(values) > 1 else kind
        specs.append(WorkerSpec(value, name, device, wdtype, threads, kw))
    return specs
