"""A GGUF file's metadata and tensors, read directly.

gguf-py's GGUFReader builds a numpy view for every part of every metadata value; a vocabulary of
49,152 tokens and as many merges makes that seconds of work at every start. This reads the same
header with `struct` in one pass (tens of milliseconds) and maps the tensor data with numpy as
GGUFReader does, so `tensors[i].data` has GGUFReader's shapes and dtypes (the input of
`gguf.quants.dequantize`). Format: https://github.com/ggml-org/ggml/blob/master/docs/gguf.md
"""

from __future__ import annotations

import math
import os
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

_MAGIC = b"GGUF"
_DEFAULT_ALIGNMENT = 32

# value type id -> struct format of one scalar (8: string, 9: array)
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9


@dataclass
class GGUFTensor:
    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]  # innermost dimension first, as the file lists them
    n_elements: int
    data: np.ndarray  # GGUFReader's layout: quantized types as uint8 [..., bytes per row]


class GGUFFile:
    """`fields`: metadata key -> value (str, int, float, bool, or a list of them); `tensors`.

    Every count, length and offset is checked against the file's size before it is used: a
    truncated, corrupted or hostile file is a ValueError naming the field, never another error.
    """

    #: arrays of arrays nest at most this deep (the format has no use for deeper ones)
    MAX_DEPTH = 4
    #: dimensions of a tensor (ggml's GGML_MAX_DIMS)
    MAX_DIMS = 4

    def __init__(self, path: str) -> None:
        self.path = path
        if os.path.getsize(path) < 24:
            raise ValueError(f"{path} is not a GGUF file (it has {os.path.getsize(path)} bytes, less than a header)")
        self._data = np.memmap(path, mode="r")
        self._buffer = memoryview(self._data)
        self._offset = 0
        if bytes(self._buffer[:4]) != _MAGIC:
            raise ValueError(f"{path} is not a GGUF file (it does not start with {_MAGIC!r})")
        version, n_tensors, n_fields = self._unpack("<4xIQQ", "header")
        if version not in (2, 3):
            raise ValueError(f"{path}: GGUF version {version} is not supported (2 or 3)")
        # a field takes at least 12 bytes (key length, type), a tensor's info at least 24
        self._check_count(n_fields, 12, "metadata count")
        self._check_count(n_tensors, 24, "tensor count")
        self.fields: dict[str, Any] = {}
        for _ in range(n_fields):
            key = self._string("metadata key")
            (kind,) = self._unpack("<I", key)
            self.fields[key] = self._value(kind, key, 0)
        infos = []
        for _ in range(n_tensors):
            name = self._string("tensor name")
            (n_dims,) = self._unpack("<I", f"tensor {name} dimension count")
            if not 1 <= n_dims <= self.MAX_DIMS:
                raise ValueError(f"{path}: tensor {name} has {n_dims} dimensions (1 to {self.MAX_DIMS})")
            dims = self._unpack(f"<{n_dims}Q", f"tensor {name} shape")
            kind, offset = self._unpack("<IQ", f"tensor {name} type and offset")
            infos.append((name, dims, kind, offset))
        #: where the header (metadata and tensor infos) ends, before the alignment padding
        self.header_bytes = self._offset
        alignment = self.fields.get("general.alignment", _DEFAULT_ALIGNMENT)
        if not isinstance(alignment, int) or isinstance(alignment, bool) or not 8 <= alignment <= 1 << 20:
            raise ValueError(f"{path}: general.alignment={alignment!r} must be an integer in [8, 1048576]")
        start = -(-self._offset // alignment) * alignment
        self.tensors = [self._tensor(name, dims, kind, start + offset) for name, dims, kind, offset in infos]

    def _fail(self, what: str, needed: int) -> ValueError:
        return ValueError(
            f"{self.path}: {what} needs {needed} bytes at offset {self._offset}, past the file's {len(self._data)}"
        )

    def _check_count(self, count: int, min_bytes: int, what: str) -> None:
        if count * min_bytes > len(self._data) - self._offset:
            raise ValueError(f"{self.path}: {what} {count} cannot fit in a file of {len(self._data)} bytes")

    def _unpack(self, fmt: str, what: str) -> tuple:
        size = struct.calcsize(fmt)
        if self._offset + size > len(self._data):
            raise self._fail(what, size)
        values = struct.unpack_from(fmt, self._buffer, self._offset)
        self._offset += size
        return values

    def _string(self, what: str) -> str:
        (length,) = self._unpack("<Q", f"{what} length")
        if self._offset + length > len(self._data):
            raise self._fail(what, length)
        start = self._offset
        self._offset += length
        return bytes(self._buffer[start : self._offset]).decode("utf-8", errors="replace")

    def _strings(self, count: int, key: str) -> list[str]:
        """`count` strings in a row (a tokenizer's vocabulary: ~50k-260k), read as `_string` reads
        one, without its per-string bookkeeping."""
        buffer, size, offset, strings = self._buffer, len(self._data), self._offset, []
        unpack_length = struct.Struct("<Q").unpack_from
        for _ in range(count):
            if offset + 8 > size:
                self._offset = offset
                raise self._fail(f"{key} length", 8)
            (length,) = unpack_length(buffer, offset)
            offset += 8
            if offset + length > size:
                self._offset = offset
                raise self._fail(key, length)
            strings.append(str(buffer[offset : offset + length], "utf-8", "replace"))
            offset += length
        self._offset = offset
        return strings

    def _value(self, kind: int, key: str, depth: int) -> Any:
        if kind == _STRING:
            return self._string(key)
        if kind == _ARRAY:
            if depth >= self.MAX_DEPTH:
                raise ValueError(f"{self.path}: {key} nests arrays deeper than {self.MAX_DEPTH}")
            item, count = self._unpack("<IQ", f"{key} array header")
            if item == _STRING:
                self._check_count(count, 8, f"{key} length")
                return self._strings(count, key)
            if item == _ARRAY:
                self._check_count(count, 12, f"{key} length")
                return [self._value(_ARRAY, key, depth + 1) for _ in range(count)]
            if item not in _SCALARS:
                raise ValueError(f"{self.path}: {key} has unknown GGUF array item type {item}")
            self._check_count(count, struct.calcsize(_SCALARS[item]), f"{key} length")
            return list(self._unpack(f"<{count}{_SCALARS[item]}", key))
        if kind not in _SCALARS:
            raise ValueError(f"{self.path}: {key} has unknown GGUF value type {kind}")
        return self._unpack("<" + _SCALARS[kind], key)[0]

    def _tensor(self, name: str, dims: tuple[int, ...], kind: int, offset: int) -> GGUFTensor:
        from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

        try:
            qtype = GGMLQuantizationType(kind)
        except ValueError:
            raise ValueError(f"{self.path}: tensor {name} has unknown type {kind}") from None
        n_elements = math.prod(dims)
        if n_elements == 0 or n_elements > 8 * len(self._data):  # no type stores fewer than 1/8 byte per element
            raise ValueError(
                f"{self.path}: tensor {name} has shape {list(dims)}, impossible in {len(self._data)} bytes"
            )
        np_dims = tuple(reversed(dims))
        plain = {
            GGMLQuantizationType.F32: np.float32,
            GGMLQuantizationType.F16: np.float16,
            GGMLQuantizationType.F64: np.float64,
            GGMLQuantizationType.I8: np.int8,
            GGMLQuantizationType.I16: np.int16,
            GGMLQuantizationType.I32: np.int32,
            GGMLQuantizationType.I64: np.int64,
        }.get(qtype)
        if plain is not None:
            dtype, count = np.dtype(plain), n_elements
        else:
            if qtype not in GGML_QUANT_SIZES:
                raise ValueError(f"{self.path}: tensor {name} has type {qtype.name}, which has no block size")
            block, type_size = GGML_QUANT_SIZES[qtype]
            if np_dims[-1] % block:
                raise ValueError(f"{self.path}: tensor {name} rows of {np_dims[-1]} are not whole {qtype.name} blocks")
            dtype, count = np.dtype(np.uint8), n_elements * type_size // block
            np_dims = (*np_dims[:-1], np_dims[-1] // block * type_size)
        end = offset + count * dtype.itemsize
        if end > len(self._data):
            raise ValueError(f"{self.path}: tensor {name} ends at byte {end}, past the file's {len(self._data)}")
        data = self._data[offset:end].view(dtype).reshape(np_dims)
        return GGUFTensor(name, qtype, tuple(int(d) for d in dims), n_elements, data)
