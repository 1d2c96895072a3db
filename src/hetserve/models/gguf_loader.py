"""A small, validating GGUF reader.

Layout (little-endian): magic "GGUF", u32 version, u64 tensor_count,
u64 kv_count, then kv_count (key string, u32 value type, value) records, then
tensor_count (name string, u32 n_dims, u64 ne[n_dims], u32 ggml type, u64 data
offset) records, padding to ``general.alignment`` and the tensor data.  Strings
are a u64 byte length followed by UTF-8 bytes.

Everything is checked against the file size before it is trusted: a hostile
count or length must fail fast with a GGUFError, never reach an allocation,
loop or slice proportional to it.  We parse straight out of an mmap with
precompiled structs; token vocabularies (150k+ strings) are the hot spot, so
string arrays get a tight dedicated loop and numeric arrays go through numpy.
"""

from __future__ import annotations

import math
import mmap
import os
import struct
from dataclasses import dataclass
from typing import Any, NoReturn

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT, Keys
from gguf import GGMLQuantizationType, GGUFValueType as V

from .gguf_quants import SUPPORTED_TYPES, dequantize, tensor_nbytes

__all__ = ["GGUFError", "GGUFFile", "TensorInfo"]

_MAGIC = b"GGUF"  # gguf.GGUF_MAGIC (0x46554747) as it appears on disk
_SUPPORTED_VERSIONS = (2, 3)
_MAX_DIMS = 4  # GGML_MAX_DIMS
# Arrays of arrays are legal but nothing uses deep nesting; bounding it keeps
# recursion (and the total work a small file can demand) in check.
_MAX_ARRAY_DEPTH = 8

_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_HEADER = struct.Struct("<4sIQQ")

# Scalar value types: (struct for a single value, numpy dtype for arrays).
_SCALARS: dict[int, tuple[struct.Struct, np.dtype]] = {
    V.UINT8: (struct.Struct("<B"), np.dtype("<u1")),
    V.INT8: (struct.Struct("<b"), np.dtype("<i1")),
    V.UINT16: (struct.Struct("<H"), np.dtype("<u2")),
    V.INT16: (struct.Struct("<h"), np.dtype("<i2")),
    V.UINT32: (struct.Struct("<I"), np.dtype("<u4")),
    V.INT32: (struct.Struct("<i"), np.dtype("<i4")),
    V.FLOAT32: (struct.Struct("<f"), np.dtype("<f4")),
    V.BOOL: (struct.Struct("<B"), np.dtype("<u1")),
    V.UINT64: (struct.Struct("<Q"), np.dtype("<u8")),
    V.INT64: (struct.Struct("<q"), np.dtype("<i8")),
    V.FLOAT64: (struct.Struct("<d"), np.dtype("<f8")),
}
# Fewest bytes one value of each type can occupy on disk, used to reject
# counts the rest of the file cannot possibly hold before acting on them.
_MIN_VALUE_SIZE = {t: s.size for t, (s, _) in _SCALARS.items()}
_MIN_VALUE_SIZE[V.STRING] = 8  # length only
_MIN_VALUE_SIZE[V.ARRAY] = 4 + 8  # element type + count
_MIN_KV_SIZE = 8 + 4 + 1  # empty key, type, smallest value
_MIN_TENSOR_INFO_SIZE = 8 + 4 + 8 + 4 + 8  # empty name, n_dims, one dim, type, offset


class GGUFError(ValueError):
    """A GGUF file is malformed or uses something we do not support."""


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # torch order: reversed ggml ne
    qtype: GGMLQuantizationType
    offset: int  # absolute file offset of the data
    nbytes: int


class GGUFFile:
    """A parsed and validated GGUF file whose tensor data stays memory-mapped."""

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        self.version = 0
        self.metadata: dict[str, Any] = {}
        self.tensors: dict[str, TensorInfo] = {}
        self.alignment = GGUF_DEFAULT_ALIGNMENT
        self._mm: mmap.mmap | None = None
        self._data: np.ndarray | None = None
        try:
            with open(self.path, "rb") as f:
                self._size = os.fstat(f.fileno()).st_size
                if self._size < _HEADER.size:
                    self._check_magic(f.read(4))
                    self._fail(f"truncated: file is {self._size} bytes, a GGUF header needs {_HEADER.size}")
                # Copy-on-write: numpy/torch views are writable (no torch
                # warnings), yet nothing ever reaches the file.
                self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
            self._parse()
            self._data = np.frombuffer(self._mm, dtype=np.uint8)
        except GGUFError:
            self.close()
            raise
        except (struct.error, IndexError, OverflowError, UnicodeDecodeError) as e:
            # Safety net: the checks below should make these unreachable.
            self.close()
            raise GGUFError(f"{self.path}: malformed GGUF ({type(e).__name__}: {e})") from e
        except BaseException:
            self.close()
            raise

    # -- public API ---------------------------------------------------------

    def raw(self, name: str) -> np.ndarray:
        """The tensor's bytes as a uint8 view into the mapping (no copy)."""
        info = self.tensors[name]
        if self._data is None:
            self._fail("file is closed")
        return self._data[info.offset:info.offset + info.nbytes]

    def load_tensor(self, name: str) -> torch.Tensor:
        """The tensor dequantized to float32, in torch-order shape.

        The result owns its memory, so it outlives ``close()``.
        """
        info = self.tensors[name]
        t = dequantize(torch.from_numpy(self.raw(name)), info.qtype, info.shape)
        if info.qtype == GGMLQuantizationType.F32:
            t = t.clone()  # dequantize returns a view of the mapping for F32
        return t

    def close(self) -> None:
        self._data = None
        mm, self._mm = self._mm, None
        if mm is not None:
            try:
                mm.close()
            except BufferError:
                # Views from raw() are still alive; the mapping is released
                # when the last of them is garbage collected.
                pass

    def __enter__(self) -> GGUFFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"GGUFFile({self.path!r}, version={self.version}, tensors={len(self.tensors)}, kvs={len(self.metadata)})"

    # -- parsing ------------------------------------------------------------

    def _fail(self, msg: str) -> NoReturn:
        raise GGUFError(f"{self.path}: {msg}")

    def _check_magic(self, magic: bytes) -> None:
        if len(magic) < 4:
            self._fail(f"truncated: file is {self._size} bytes, too short for the GGUF magic")
        if magic != _MAGIC:
            self._fail(f"bad magic {magic!r}, expected {_MAGIC!r}: not a GGUF file")

    def _need(self, pos: int, n: int, what: str) -> None:
        if n > self._size - pos:
            self._fail(f"truncated: {what} at offset {pos} needs {n} bytes, only {self._size - pos} left")

    def _parse(self) -> None:
        mm = self._mm
        magic, version, n_tensors, n_kv = _HEADER.unpack_from(mm, 0)
        self._check_magic(magic)
        if version not in _SUPPORTED_VERSIONS:
            swapped = int.from_bytes(version.to_bytes(4, "little"), "big")
            if swapped in _SUPPORTED_VERSIONS:
                self._fail(f"big-endian GGUF (version {swapped}) is not supported")
            self._fail(f"unsupported GGUF version {version} (supported: 2, 3)")
        self.version = version
        pos = _HEADER.size
        left = self._size - pos
        if n_kv * _MIN_KV_SIZE + n_tensors * _MIN_TENSOR_INFO_SIZE > left:
            self._fail(
                f"truncated or corrupt: header claims {n_kv} metadata entries and {n_tensors} tensors, "
                f"which cannot fit in the remaining {left} bytes"
            )

        for i in range(n_kv):
            key, pos = self._read_str(pos, f"metadata key #{i}")
            if key in self.metadata:
                self._fail(f"duplicate metadata key {key!r}")
            self._need(pos, 4, f"value type of {key!r}")
            (vtype,) = _U32.unpack_from(mm, pos)
            self.metadata[key], pos = self._read_value(pos + 4, vtype, key, 0)

        alignment = self.metadata.get(Keys.General.ALIGNMENT, GGUF_DEFAULT_ALIGNMENT)
        if type(alignment) is not int or alignment <= 0 or alignment & (alignment - 1):
            self._fail(f"{Keys.General.ALIGNMENT} must be a positive power of two, got {alignment!r}")
        self.alignment = alignment

        # Re-check now that the kv section's true size is known.
        if n_tensors * _MIN_TENSOR_INFO_SIZE > self._size - pos:
            self._fail(f"truncated: {n_tensors} tensor infos cannot fit in the remaining {self._size - pos} bytes")
        pending = []
        names: set[str] = set()
        for i in range(n_tensors):
            name, pos = self._read_str(pos, f"tensor name #{i}")
            if name in names:
                self._fail(f"duplicate tensor name {name!r}")
            names.add(name)
            self._need(pos, 4, f"n_dims of tensor {name!r}")
            (n_dims,) = _U32.unpack_from(mm, pos)
            pos += 4
            if not 1 <= n_dims <= _MAX_DIMS:
                self._fail(f"tensor {name!r}: n_dims is {n_dims}, must be 1..{_MAX_DIMS}")
            self._need(pos, 8 * n_dims + 4 + 8, f"dims/type/offset of tensor {name!r}")
            ne = struct.unpack_from(f"<{n_dims}Q", mm, pos)
            pos += 8 * n_dims
            (type_id,) = _U32.unpack_from(mm, pos)
            (offset,) = _U64.unpack_from(mm, pos + 4)
            pos += 12
            pending.append((name, ne, type_id, offset))

        # Tensor data starts at the next alignment boundary after the infos.
        data_start = -(-pos // alignment) * alignment
        for name, ne, type_id, offset in pending:
            self.tensors[name] = self._tensor_info(name, ne, type_id, offset, data_start)

    def _tensor_info(self, name: str, ne: tuple[int, ...], type_id: int, offset: int, data_start: int) -> TensorInfo:
        where = f"tensor {name!r}"
        if any(d == 0 for d in ne):
            self._fail(f"{where}: zero dimension in {list(ne)}")
        if any(d >= 1 << 63 for d in ne):
            self._fail(f"{where}: negative or overflowing dimension in {list(ne)}")
        n_elements = math.prod(ne)
        if n_elements >= 1 << 63:
            self._fail(f"{where}: element count of {list(ne)} overflows int64")
        try:
            qtype = GGMLQuantizationType(type_id)
        except ValueError:
            self._fail(f"{where}: unknown tensor type id {type_id}")
        if qtype not in SUPPORTED_TYPES:
            self._fail(f"{where}: unsupported tensor type {qtype.name} (id {type_id})")
        block_size = GGML_QUANT_SIZES[qtype][0]
        if ne[0] % block_size:
            self._fail(f"{where}: row length {ne[0]} is not a multiple of the {qtype.name} block size {block_size}")
        nbytes = tensor_nbytes(qtype, n_elements)
        if offset % self.alignment:
            self._fail(f"{where}: data offset {offset} is not a multiple of the alignment {self.alignment}")
        start = data_start + offset
        if start + nbytes > self._size:
            self._fail(
                f"truncated: {where} data [{start}, {start + nbytes}) runs past the end of the file ({self._size} bytes)"
            )
        return TensorInfo(name, tuple(reversed(ne)), qtype, start, nbytes)

    def _read_str(self, pos: int, what: str) -> tuple[str, int]:
        self._need(pos, 8, f"length of {what}")
        (n,) = _U64.unpack_from(self._mm, pos)
        pos += 8
        self._need(pos, n, what)
        try:
            return self._mm[pos:pos + n].decode("utf-8"), pos + n
        except UnicodeDecodeError as e:
            self._fail(f"{what} at offset {pos} is not valid UTF-8 ({e.reason} at byte {e.start})")

    def _read_value(self, pos: int, vtype: int, key: str, depth: int) -> tuple[Any, int]:
        scalar = _SCALARS.get(vtype)
        if scalar is not None:
            st = scalar[0]
            self._need(pos, st.size, f"value of {key!r}")
            (v,) = st.unpack_from(self._mm, pos)
            return (bool(v) if vtype == V.BOOL else v), pos + st.size
        if vtype == V.STRING:
            return self._read_str(pos, f"string value of {key!r}")
        if vtype == V.ARRAY:
            return self._read_array(pos, key, depth)
        self._fail(f"metadata {key!r}: unknown value type {vtype}")

    def _read_array(self, pos: int, key: str, depth: int) -> tuple[list, int]:
        if depth >= _MAX_ARRAY_DEPTH:
            self._fail(f"metadata {key!r}: arrays nested deeper than {_MAX_ARRAY_DEPTH}")
        mm = self._mm
        self._need(pos, 12, f"array header of {key!r}")
        (etype,) = _U32.unpack_from(mm, pos)
        (n,) = _U64.unpack_from(mm, pos + 4)
        pos += 12
        min_size = _MIN_VALUE_SIZE.get(etype)
        if min_size is None:
            self._fail(f"metadata {key!r}: unknown array element type {etype}")
        if n * min_size > self._size - pos:
            self._fail(
                f"truncated: array {key!r} at offset {pos} claims {n} elements, "
                f"which cannot fit in the remaining {self._size - pos} bytes"
            )

        scalar = _SCALARS.get(etype)
        if scalar is not None:
            arr = np.frombuffer(mm, dtype=scalar[1], count=n, offset=pos)
            values = (arr != 0).tolist() if etype == V.BOOL else arr.tolist()
            del arr  # release the buffer export so close() can unmap
            return values, pos + n * min_size
        if etype == V.STRING:
            return self._read_str_array(pos, n, key)
        # Arrays of arrays: each element is (element type, count, data) with no
        # per-element tag, since the outer element type already says ARRAY.
        out = []
        for _ in range(n):
            value, pos = self._read_array(pos, key, depth + 1)
            out.append(value)
        return out, pos

    def _read_str_array(self, pos: int, n: int, key: str) -> tuple[list[str], int]:
        # The hot loop for tokenizer vocabularies: keep it free of calls.
        mm, size, unpack = self._mm, self._size, _U64.unpack_from
        # Grow the list as strings are actually read, so a lying count costs
        # nothing before the data runs out.
        out: list[str] = []
        append = out.append
        for i in range(n):
            if pos + 8 > size:
                self._fail(f"truncated: length of {key!r}[{i}] at offset {pos} runs past the end of the file")
            (ln,) = unpack(mm, pos)
            pos += 8
            if ln > size - pos:
                self._fail(f"truncated: {key!r}[{i}] at offset {pos} claims {ln} bytes, only {size - pos} left")
            try:
                append(mm[pos:pos + ln].decode("utf-8"))
            except UnicodeDecodeError as e:
                self._fail(f"{key!r}[{i}] at offset {pos} is not valid UTF-8 ({e.reason} at byte {e.start})")
            pos += ln
        return out, pos
