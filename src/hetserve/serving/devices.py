"""`--inference-device` values -> one worker spec each.

    cpu | cpu:threads=N | cuda | cuda:N | gpu      then optional ",key=value" overrides
    ray:cpu | ray:cpu:threads=N | ray:cuda         a worker in a Ray actor on any node
                                                   (",node=ID-or-RESOURCE" pins it)

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
    ray: dict | None = None  # a Ray worker's resource request: num_cpus, num_gpus, node


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
    if kind == "float":
        try:
            return float(value)
        except ValueError:
            raise ValueError(f"{key}={value!r}: expected a number") from None
    return value


def override_fields() -> dict[str, str]:
    """The keys a `key=value` engine override may set, with their types: every EngineConfig
    field but the device, and the model's dtype."""
    return {f.name: f.type for f in dataclasses.fields(EngineConfig) if f.name != "device"} | {"dtype": "str"}


def parse_override(item: str, fields: dict[str, str], what: str) -> tuple[str, object]:
    """One `key=value` (dashes or underscores) -> (field, value converted to the field's type)."""
    key, sep, val = item.partition("=")
    key = key.strip().replace("-", "_")
    if not sep or key not in fields:
        raise ValueError(f"{what}: unknown override {item!r}; valid keys: {', '.join(sorted(fields))}")
    return key, _convert(key, val.strip(), fields[key])


def parse_devices(values: list[str], engine_kwargs: dict, dtype: str = "float32") -> list[WorkerSpec]:
    fields = override_fields() | {"threads": "int", "node": "str"}
    named = set()
    for v in values:
        m = _BASE.fullmatch(v.split(",")[0].strip())  # local GPUs named: `gpu` takes another
        if m and m.group(3) == "cuda":
            named.add(int(m.group(4) or 0))
    specs = []
    for i, value in enumerate(values):
        base, *overrides = [p.strip() for p in value.split(",")]
        on_ray = base.startswith("ray:")
        m = _BASE.fullmatch(base.removeprefix("ray:"))
        if m is None or (on_ray and m.group(4) is not None):
            raise ValueError(f"--inference-device {value!r}: expected cpu, cpu:threads=N, cuda, cuda:N or gpu "
                             "(or ray:cpu, ray:cpu:threads=N, ray:cuda), then optional ,key=value overrides")
        threads = int(m.group(2)) if m.group(2) else None
        if threads == 0:
            raise ValueError(f"--inference-device {value!r}: threads must be >= 1")
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
        if on_ray:  # Ray picks the GPU: the actor sees only the one it was given, as cuda:0
            device = device.split(":")[0] + (":0" if device.startswith("cuda") else "")
        kw, wdtype, node = dict(engine_kwargs), dtype, None
        for o in overrides:
            key, val = parse_override(o, fields, f"--inference-device {value!r}")
            if key == "dtype":
                wdtype = val
            elif key == "node":
                if not on_ray:
                    raise ValueError(f"--inference-device {value!r}: node= places Ray workers only")
                node = val
            elif key == "threads":
                if val < 1:
                    raise ValueError(f"--inference-device {value!r}: threads must be >= 1")
                threads = val
            else:
                kw[key] = val
        EngineConfig(device=device, **{k: v for k, v in kw.items() if k != "device"})  # fail here, not in a worker
        kind = ("ray-" if on_ray else "") + device.split(":")[0]
        name = f"{kind}{i}" if len(values) > 1 else kind
        ray = {"num_cpus": threads or 1, "num_gpus": 1 if device.startswith("cuda") else 0, "node": node} \
            if on_ray else None
        specs.append(WorkerSpec(value, name, device, wdtype, threads, kw, ray))
    return specs
