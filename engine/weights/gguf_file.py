"""A GGUF file's header, read in one pass: is the file complete, its key/values, its tensors (memory-mapped).

    | magic | version | n_tensors | n_kv | key/values ... | tensor infos ... | pad | tensor data ........ |
                                                                               ^ data_offset (aligned)
    expected size = data_offset + max(tensor offset + tensor bytes)

check_gguf(path) -> GGUFLayout   a missing, foreign or truncated file reported with the numbers, in ~0.1 s
read_gguf(path) -> GGUFFile      the same check, then every value (strings, arrays) and tensor info kept;
                                 GGUFFile.tensor_data(t) is t's bytes as gguf.quants.dequantize takes them

`gguf.GGUFReader` reads the same header through a numpy memmap field by field: 2.4-2.8 CPU-s for SmolLM2's
49,152-token vocabulary and 48,900 merges on this project's 2-core host against read_gguf's 0.10-0.11 (two sets
of three interleaved runs, 2026-12-07), and a truncated file fails in it with numpy reshape errors. Its tensor
data layout is kept: F32 / F16 as their numpy dtype in the tensor's shape, every other type as uint8 rows of
the row's quantized bytes.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import BinaryIO

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT, GGMLQuantizationType, GGUFValueType

_SCALAR_FORMATS = {
    GGUFValueType.UINT8: "<B", GGUFValueType.INT8: "<b", GGUFValueType.UINT16: "<H",
    GGUFValueType.INT16: "<h", GGUFValueType.UINT32: "<I", GGUFValueType.INT32: "<i",
    GGUFValueType.FLOAT32: "<f", GGUFValueType.BOOL: "<?", GGUFValueType.UINT64: "<Q",
    GGUFValueType.INT64: "<q", GGUFValueType.FLOAT64: "<d",
}


_MAX_DIMS = 4  # GGML_MAX_DIMS
_CHECKED_READ = 1 << 16  # bytes: a read longer than this is checked against the file's size first


class GGUFFormatError(ValueError):
    """The file is not a complete GGUF file."""


@dataclass(frozen=True)
class GGUFLayout:
    path: Path
    version: int
    tensor_count: int
    kv_count: int
    data_offset: int
    expected_size: int
    file_size: int


class _Header:
    def __init__(self, f: BinaryIO, path: Path, file_size: int) -> None:
        self._f, self.path, self._file_size = f, path, file_size

    def read(self, n: int) -> bytes:
        """The next n bytes. A large n that runs past the file's end is refused before anything is allocated (a
        corrupt string or array length would otherwise ask for up to 2**64 bytes); small ones are not checked
        first (`tell` is a system call, and the header makes ~200,000 reads)."""
        if n > _CHECKED_READ and n > self._file_size - self._f.tell():
            raise GGUFFormatError(
                f"GGUF file {self.path} is truncated inside its header: it has {self._file_size} bytes, "
                f"the header asks for {n} more at byte {self._f.tell()}"
            )
        data = self._f.read(n)
        if len(data) != n:
            raise GGUFFormatError(
                f"GGUF file {self.path} is truncated inside its header: it has {self._file_size} bytes, "
                f"the header continues past byte {self._f.tell()}"
            )
        return data

    def unpack(self, fmt: str) -> int | float | bool:
        value: int | float | bool = struct.unpack(fmt, self.read(struct.calcsize(fmt)))[0]
        return value

    def string(self) -> str:
        return self.read(int(self.unpack("<Q"))).decode("utf-8", errors="replace")

    def value(self, vtype: int, keep: bool) -> object:
        """The next value of type `vtype`; an array is a list (None unless `keep`: a scalar array is skipped in
        one read)."""
        if vtype == GGUFValueType.STRING:
            return self.string()
        if vtype == GGUFValueType.ARRAY:
            item_type, count = int(self.unpack("<I")), int(self.unpack("<Q"))
            if item_type in _SCALAR_FORMATS:
                fmt = _SCALAR_FORMATS[GGUFValueType(item_type)]
                raw = self.read(count * struct.calcsize(fmt))
                return list(struct.unpack(f"<{count}{fmt[1]}", raw)) if keep else None
            items = [self.value(item_type, keep) for _ in range(count)]
            return items if keep else None
        if vtype not in _SCALAR_FORMATS:
            raise GGUFFormatError(f"GGUF file {self.path}: unknown value type {vtype} at byte {self._f.tell()}")
        return self.unpack(_SCALAR_FORMATS[GGUFValueType(vtype)])


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    dims: tuple[int, ...]  # GGUF order: dims[0] runs along a row (numpy's last axis): the reverse of its shape
    ggml_type: GGMLQuantizationType
    offset: int  # from the start of the data section
    nbytes: int

    @property
    def shape(self) -> tuple[int, ...]:
        """The numpy (and torch) shape."""
        return tuple(reversed(self.dims))


class GGUFFile:
    """read_gguf's result: the key/values (decoded: str, int, float, bool, lists of them), the tensor infos in
    file order, and the tensor data mapped from the file when first asked for."""

    def __init__(self, layout: GGUFLayout, fields: dict[str, object], tensors: list[GGUFTensor]) -> None:
        self.layout, self.fields, self.tensors = layout, fields, tensors

    @cached_property
    def _map(self) -> np.memmap:
        return np.memmap(self.layout.path, dtype=np.uint8, mode="r")

    def tensor_data(self, tensor: GGUFTensor) -> np.ndarray:
        """The tensor's bytes, read-only, as gguf.quants.dequantize takes them."""
        start = self.layout.data_offset + tensor.offset
        raw = self._map[start:start + tensor.nbytes]
        if tensor.ggml_type == GGMLQuantizationType.F32:
            return raw.view(np.float32).reshape(tensor.shape)
        if tensor.ggml_type == GGMLQuantizationType.F16:
            return raw.view(np.float16).reshape(tensor.shape)
        block_size, type_size = GGML_QUANT_SIZES[tensor.ggml_type]
        *rows, row = tensor.shape
        return raw.reshape(*rows, row // block_size * type_size)


def check_gguf(path: str | Path) -> GGUFLayout:
    """Raise FileNotFoundError / GGUFFormatError (a ValueError) naming the file unless it is a complete GGUF."""
    return _read(Path(path), keep=False).layout


def read_gguf(path: str | Path) -> GGUFFile:
    """check_gguf's checks, and every key/value and tensor info of the file."""
    return _read(Path(path), keep=True)


def _read(path: Path, keep: bool) -> GGUFFile:
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file {path} does not exist")
    file_size = path.stat().st_size
    with path.open("rb") as f:
        header = _Header(f, path, file_size)
        magic = f.read(4)
        if magic != b"GGUF":
            raise GGUFFormatError(f"{path} is not a GGUF file: it starts with {magic!r}, expected b'GGUF' "
                                  f"(file has {file_size} bytes)")
        version, tensor_count, kv_count = header.unpack("<I"), header.unpack("<Q"), header.unpack("<Q")
        alignment = GGUF_DEFAULT_ALIGNMENT
        fields: dict[str, object] = {}
        for _ in range(int(kv_count)):
            key = header.string()
            value = header.value(int(header.unpack("<I")), keep)
            if key == "general.alignment":
                if type(value) is not int or value <= 0:
                    raise GGUFFormatError(f"GGUF file {path}: general.alignment is {value!r}, not a positive int")
                alignment = value
            if keep:
                fields[key] = value
        tensors = [_tensor_info(header) for _ in range(int(tensor_count))]
        data_offset = math.ceil(f.tell() / alignment) * alignment
    expected = data_offset + max((t.offset + t.nbytes for t in tensors), default=0)
    if file_size < expected:
        raise GGUFFormatError(f"GGUF file {path} is truncated: expected {expected} bytes, got {file_size} "
                              f"({expected - file_size} bytes missing)")
    layout = GGUFLayout(path, int(version), int(tensor_count), int(kv_count), data_offset, expected, file_size)
    return GGUFFile(layout, fields, tensors)


def _tensor_info(header: _Header) -> GGUFTensor:
    name = header.string()
    n_dims = int(header.unpack("<I"))
    if n_dims > _MAX_DIMS:
        raise GGUFFormatError(f"GGUF file {header.path}: tensor {name!r} has {n_dims} dimensions, at most {_MAX_DIMS}")
    dims = tuple(int(header.unpack("<Q")) for _ in range(n_dims))
    ggml_type, offset = GGMLQuantizationType(int(header.unpack("<I"))), int(header.unpack("<Q"))
    block_size, type_size = GGML_QUANT_SIZES[ggml_type]
    return GGUFTensor(name, dims, ggml_type, offset, math.prod(dims) * type_size // block_size)
