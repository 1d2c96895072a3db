"""GGUFFile: round trips through gguf.GGUFWriter, and malformed files."""

from __future__ import annotations

import struct
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import gguf
import gguf.quants
from gguf import GGMLQuantizationType as T, GGUFValueType as V

from hetserve.models.gguf_loader import GGUFError, GGUFFile, TensorInfo

RNG = np.random.default_rng(0)
F32_DATA = RNG.standard_normal((3, 5)).astype(np.float32)
F16_DATA = RNG.standard_normal((4, 8)).astype(np.float16)
VEC_DATA = RNG.standard_normal(7).astype(np.float32)
Q8_SOURCE = RNG.standard_normal((4, 64)).astype(np.float32)
Q8_DATA = gguf.quants.quantize(Q8_SOURCE, T.Q8_0)  # uint8 [4, 68]

METADATA = {
    "general.architecture": "test",
    "test.u8": 200,
    "test.i8": -5,
    "test.u16": 60000,
    "test.i16": -30000,
    "test.u32": 4_000_000_000,
    "test.i32": -2_000_000_000,
    "test.u64": 2**40 + 3,
    "test.i64": -(2**50),
    "test.f32": 0.5,
    "test.f64": 1.0 / 3.0,
    "test.bool": True,
    "test.str": "hello",
    "test.arr_i32": [1, -2, 3],
    "test.arr_f32": [0.5, 1.5, -2.25],
    "test.arr_u64": [2**63 + 1, 7],
    "test.arr_bool": [True, False, True],
    "test.arr_str": ["a", "h\u00e9llo \u2603", "", "z"],
    "test.nested": [[1, 2], [3]],
}


def write_valid(path: Path, alignment: int | None = None) -> bytes:
    w = gguf.GGUFWriter(path, "test")
    if alignment is not None:
        w.add_custom_alignment(alignment)
    w.add_uint8("test.u8", 200)
    w.add_int8("test.i8", -5)
    w.add_uint16("test.u16", 60000)
    w.add_int16("test.i16", -30000)
    w.add_uint32("test.u32", 4_000_000_000)
    w.add_int32("test.i32", -2_000_000_000)
    w.add_uint64("test.u64", 2**40 + 3)
    w.add_int64("test.i64", -(2**50))
    w.add_float32("test.f32", 0.5)
    w.add_float64("test.f64", 1.0 / 3.0)
    w.add_bool("test.bool", True)
    w.add_string("test.str", "hello")
    w.add_array("test.arr_i32", [1, -2, 3])
    w.add_array("test.arr_f32", [0.5, 1.5, -2.25])
    w.add_key_value("test.arr_u64", [2**63 + 1, 7], V.ARRAY, sub_type=V.UINT64)
    w.add_array("test.arr_bool", [True, False, True])
    w.add_array("test.arr_str", ["a", "h\u00e9llo \u2603", "", "z"])
    w.add_array("test.nested", [[1, 2], [3]])
    w.add_tensor("tok.weight", F32_DATA)
    w.add_tensor("a.0", F16_DATA)
    w.add_tensor("a.1", VEC_DATA)
    w.add_tensor("q8.weight", Q8_DATA, raw_dtype=T.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path.read_bytes()


@pytest.fixture
def valid(tmp_path: Path) -> tuple[Path, bytes]:
    path = tmp_path / "valid.gguf"
    return path, write_valid(path)


def test_metadata_and_tensors(valid):
    path, _ = valid
    with GGUFFile(path) as f:
        assert f.path == str(path)
        assert f.version == 3
        assert list(f.metadata) == list(METADATA)
        for key, want in METADATA.items():
            got = f.metadata[key]
            assert type(got) is type(want), key
            assert got == pytest.approx(want) if isinstance(want, float) else got == want, key
        assert type(f.metadata["test.arr_bool"][0]) is bool
        assert type(f.metadata["test.arr_f32"][0]) is float

        assert list(f.tensors) == ["tok.weight", "a.0", "a.1", "q8.weight"]
        assert f.tensors["tok.weight"].shape == (3, 5)
        assert f.tensors["a.0"].shape == (4, 8)
        assert f.tensors["a.1"].shape == (7,)
        q8 = f.tensors["q8.weight"]
        assert isinstance(q8, TensorInfo)
        assert (q8.shape, q8.qtype, q8.nbytes) == ((4, 64), T.Q8_0, 4 * 68)
        assert all(info.offset % 32 == 0 for info in f.tensors.values())

        def check(name, want):
            got = f.load_tensor(name)
            assert got.dtype == torch.float32
            assert torch.equal(got, torch.from_numpy(np.asarray(want, dtype=np.float32)))

        check("tok.weight", F32_DATA)
        check("a.0", F16_DATA.astype(np.float32))
        check("a.1", VEC_DATA)
        check("q8.weight", gguf.quants.dequantize(Q8_DATA, T.Q8_0))
        # Sanity: Q8_0 is close to the source it was quantized from.
        assert torch.allclose(f.load_tensor("q8.weight"), torch.from_numpy(Q8_SOURCE), atol=0.05)

        raw = f.raw("q8.weight")
        assert raw.dtype == np.uint8 and not raw.flags.owndata
        assert raw.tobytes() == Q8_DATA.tobytes()
        loaded = f.load_tensor("tok.weight")
    # Loaded tensors own their memory and survive close().
    assert torch.equal(loaded, torch.from_numpy(F32_DATA))
    with pytest.raises(GGUFError, match="closed"):
        f.raw("a.0")


def test_custom_alignment(tmp_path: Path):
    path = tmp_path / "aligned.gguf"
    write_valid(path, alignment=64)
    with GGUFFile(path) as f:
        assert f.metadata["general.alignment"] == 64
        assert all(info.offset % 64 == 0 for info in f.tensors.values())
        assert torch.equal(f.load_tensor("a.1"), torch.from_numpy(VEC_DATA))


# -- hand-built files ---------------------------------------------------------

def s(text: str | bytes) -> bytes:
    raw = text.encode() if isinstance(text, str) else text
    return struct.pack("<Q", len(raw)) + raw


def kv(key: str | bytes, vtype: int, payload: bytes) -> bytes:
    return s(key) + struct.pack("<I", vtype) + payload


def build(kvs: list[bytes], infos: list[bytes] = (), data: bytes = b"", version: int = 3,
          n_kv: int | None = None, n_tensors: int | None = None) -> bytes:
    head = b"GGUF" + struct.pack("<IQQ", version, len(infos) if n_tensors is None else n_tensors,
                                 len(kvs) if n_kv is None else n_kv)
    body = head + b"".join(kvs) + b"".join(infos)
    return body + b"\0" * (-len(body) % 32) + data


def tensor_info(name: str, ne: list[int], qtype: int, offset: int = 0) -> bytes:
    return s(name) + struct.pack(f"<I{len(ne)}QIQ", len(ne), *ne, qtype, offset)


def test_hand_built_edge_cases(tmp_path: Path):
    path = tmp_path / "edge.gguf"
    empty_arr = kv("e", V.ARRAY, struct.pack("<IQ", V.INT32, 0))
    path.write_bytes(build([empty_arr]))
    with GGUFFile(path) as f:
        assert f.metadata == {"e": []} and f.tensors == {} and f.version == 3
    path.write_bytes(build([kv("v2", V.UINT32, struct.pack("<I", 1))], version=2))
    with GGUFFile(path) as f:
        assert f.version == 2 and f.metadata == {"v2": 1}
    # A BF16 tensor, plus a Q8_0 tensor at a non-zero (aligned) offset.
    bf16 = (np.arange(6, dtype=np.float32).view(np.uint32) >> 16).astype(np.uint16).tobytes()
    q8 = Q8_DATA.tobytes()
    path.write_bytes(build([], [tensor_info("b", [3, 2], T.BF16, 0), tensor_info("q", [64, 4], T.Q8_0, 32)],
                           bf16 + b"\0" * (32 - len(bf16)) + q8))
    with GGUFFile(path) as f:
        assert torch.equal(f.load_tensor("b"), torch.arange(6, dtype=torch.float32).view(2, 3))
        assert torch.equal(f.load_tensor("q"), torch.from_numpy(gguf.quants.dequantize(Q8_DATA, T.Q8_0)))


# -- malformed files ----------------------------------------------------------

def key_end(data: bytes, key: str) -> int:
    """Offset just past a key (or tensor name) string, i.e. of what follows it."""
    return data.index(s(key)) + len(s(key))


def patch(data: bytes, pos: int, fmt: str, *values) -> bytes:
    out = bytearray(data)
    struct.pack_into(fmt, out, pos, *values)
    return bytes(out)


def tensor_field(data: bytes, name: str, field: str) -> int:
    p = key_end(data, name)
    n_dims = struct.unpack_from("<I", data, p)[0]
    return {"n_dims": p, "ne0": p + 4, "type": p + 4 + 8 * n_dims, "offset": p + 8 + 8 * n_dims}[field]


HUGE = 2**60
MALFORMED = {
    "empty": (lambda d: b"", "truncated"),
    "tiny": (lambda d: d[:3], "truncated"),
    "magic_only": (lambda d: d[:4], "truncated"),
    "cut_in_header": (lambda d: d[:13], "truncated"),
    "cut_after_header": (lambda d: d[:24], "truncated"),
    "cut_in_kvs": (lambda d: d[:key_end(d, "test.arr_str") + 10], "truncated"),
    "cut_in_string_array": (lambda d: d[:key_end(d, "test.arr_str") + 25], "truncated"),
    "cut_in_tensor_infos": (lambda d: d[:key_end(d, "q8.weight") + 6], "truncated"),
    "cut_in_tensor_data": (lambda d: d[:-100], "truncated"),  # the last 16 bytes are padding
    "bad_magic": (lambda d: b"GGUX" + d[4:], "magic"),
    "version_99": (lambda d: patch(d, 4, "<I", 99), "version 99"),
    "version_1": (lambda d: patch(d, 4, "<I", 1), "version 1"),
    "big_endian": (lambda d: patch(d, 4, ">I", 3), "big-endian"),
    "kv_count_2**62": (lambda d: patch(d, 16, "<Q", 2**62), "cannot fit"),
    "tensor_count_2**62": (lambda d: patch(d, 8, "<Q", 2**62), "cannot fit"),
    "key_length_2**60": (lambda d: patch(d, 24, "<Q", HUGE), "truncated"),
    "string_length_2**60": (lambda d: patch(d, key_end(d, "test.str") + 4, "<Q", HUGE), "truncated"),
    "array_length_2**60": (lambda d: patch(d, key_end(d, "test.arr_i32") + 8, "<Q", HUGE), "cannot fit"),
    "string_array_length_2**60": (lambda d: patch(d, key_end(d, "test.arr_str") + 8, "<Q", HUGE), "cannot fit"),
    "string_element_length_2**60": (lambda d: patch(d, key_end(d, "test.arr_str") + 16, "<Q", HUGE), "truncated"),
    "nested_array_length_2**60": (lambda d: patch(d, key_end(d, "test.nested") + 20, "<Q", HUGE), "cannot fit"),
    "unknown_value_type": (lambda d: patch(d, key_end(d, "test.u8"), "<I", 13), "unknown value type 13"),
    "unknown_array_type": (lambda d: patch(d, key_end(d, "test.arr_i32") + 4, "<I", 99), "unknown array element type 99"),
    "invalid_utf8_key": (lambda d: patch(d, key_end(d, "test.u8") - 1, "<B", 0xFF), "UTF-8"),
    "invalid_utf8_string": (lambda d: patch(d, key_end(d, "test.str") + 12, "<B", 0xFF), "UTF-8"),
    "invalid_utf8_in_array": (lambda d: patch(d, key_end(d, "test.arr_str") + 24, "<B", 0xFF), "UTF-8"),
    "duplicate_key": (lambda d: patch(d, key_end(d, "test.i8") - 2, "<B", ord("u")), "duplicate metadata key"),
    "tensor_offset_past_end": (lambda d: patch(d, tensor_field(d, "a.1", "offset"), "<Q", 2**40), "past the end"),
    "tensor_offset_2**63": (lambda d: patch(d, tensor_field(d, "a.1", "offset"), "<Q", 2**63), "past the end"),
    "tensor_offset_unaligned": (lambda d: patch(d, tensor_field(d, "a.1", "offset"), "<Q", 1), "alignment"),
    "tensor_type_200": (lambda d: patch(d, tensor_field(d, "a.0", "type"), "<I", 200), "unknown tensor type id 200"),
    "tensor_type_unsupported": (lambda d: patch(d, tensor_field(d, "a.0", "type"), "<I", T.IQ2_XXS), "IQ2_XXS"),
    "n_dims_9": (lambda d: patch(d, tensor_field(d, "a.0", "n_dims"), "<I", 9), "n_dims is 9"),
    "n_dims_0": (lambda d: patch(d, tensor_field(d, "a.0", "n_dims"), "<I", 0), "n_dims is 0"),
    "n_dims_2**31": (lambda d: patch(d, tensor_field(d, "a.0", "n_dims"), "<I", 2**31), "n_dims"),
    "zero_dim": (lambda d: patch(d, tensor_field(d, "a.0", "ne0"), "<Q", 0), "zero dimension"),
    "negative_dim": (lambda d: patch(d, tensor_field(d, "a.0", "ne0"), "<q", -8), "negative"),
    "overflowing_dims": (lambda d: patch(d, tensor_field(d, "a.0", "ne0"), "<QQ", 2**40, 2**40), "overflow"),
    "row_not_multiple_of_block": (lambda d: patch(d, tensor_field(d, "q8.weight", "ne0"), "<Q", 48), "block size"),
    "huge_tensor": (lambda d: patch(d, tensor_field(d, "q8.weight", "ne0"), "<Q", 2**50), "past the end"),
    "duplicate_tensor_name": (lambda d: patch(d, key_end(d, "a.1") - 1, "<B", ord("0")), "duplicate tensor name"),
    "alignment_48": (
        lambda d: build([kv("general.alignment", V.UINT32, struct.pack("<I", 48))]), "power of two"),
    "alignment_string": (lambda d: build([kv("general.alignment", V.STRING, s("32"))]), "power of two"),
    "nested_too_deep": (
        lambda d: build([kv("deep", V.ARRAY, struct.pack("<IQ", V.ARRAY, 1) * 40 + struct.pack("<IQ", V.INT32, 0))]),
        "nested deeper"),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_malformed(valid, case: str):
    path, data = valid
    mutate, expected = MALFORMED[case]
    bad = mutate(data)
    assert bad != data
    path.write_bytes(bad)
    start = time.perf_counter()
    with pytest.raises(GGUFError) as info:
        GGUFFile(path)
    assert time.perf_counter() - start < 60  # only a hang (a loop over a planted 2**40 count): a parse takes ms
    message = str(info.value)
    assert str(path) in message
    assert expected in message


def test_random_corruption_only_raises_gguf_error(valid):
    # Any byte soup must either load or fail with GGUFError: never another
    # exception type, a hang or a huge allocation.
    path, data = valid
    rng = np.random.default_rng(1)
    header_end = key_end(data, "q8.weight") + 40  # mutate headers, not just tensor data
    start = time.perf_counter()
    for _ in range(300):
        bad = bytearray(data)
        for _ in range(int(rng.integers(1, 4))):
            pos = int(rng.integers(0, header_end))
            if rng.random() < 0.3:  # plant a large length/count
                struct.pack_into("<Q", bad, min(pos, len(bad) - 8), int(rng.integers(0, 2**63)))
            else:
                bad[pos] = int(rng.integers(0, 256))
        if rng.random() < 0.2:
            bad = bad[: int(rng.integers(0, len(bad)))]
        path.write_bytes(bytes(bad))
        try:
            with GGUFFile(path) as f:
                for name in f.tensors:
                    f.load_tensor(name)
        except GGUFError as e:
            assert str(path) in str(e)
    assert time.perf_counter() - start < 600  # only a hang: the 300 files take seconds even on a slow host
