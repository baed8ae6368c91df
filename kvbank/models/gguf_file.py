"""A GGUF file's metadata and tensors, read directly.

gguf-py's GGUFReader builds a numpy view for every part of every metadata value; a vocabulary of
49,152 tokens and as many merges makes that seconds of work at every start. This reads the same
header with `struct` in one pass (tens of milliseconds) and maps the tensor data with numpy as
GGUFReader does, so `tensors[i].data` has GGUFReader's shapes and dtypes (the input of
`gguf.quants.dequantize`). Format: https://github.com/ggml-org/ggml/blob/master/docs/gguf.md
"""

from __future__ import annotations

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
    """`fields`: metadata key -> value (str, int, float, bool, or a list of them); `tensors`."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._data = np.memmap(path, mode="r")
        self._buffer = memoryview(self._data)
        self._offset = 0
        if bytes(self._buffer[:4]) != _MAGIC:
            raise ValueError(f"{path} is not a GGUF file (it does not start with {_MAGIC!r})")
        version, n_tensors, n_fields = struct.unpack_from("<IQQ", self._buffer, 4)
        if version not in (2, 3):
            raise ValueError(f"{path}: GGUF version {version} is not supported (2 or 3)")
        self._offset = 24
        self.fields: dict[str, Any] = {}
        for _ in range(n_fields):
            key = self._string()
            (kind,) = self._unpack("<I")
            self.fields[key] = self._value(kind)
        infos = []
        for _ in range(n_tensors):
            name = self._string()
            (n_dims,) = self._unpack("<I")
            dims = self._unpack(f"<{n_dims}Q")
            kind, offset = self._unpack("<IQ")
            infos.append((name, dims, kind, offset))
        alignment = int(self.fields.get("general.alignment", _DEFAULT_ALIGNMENT))
        start = -(-self._offset // alignment) * alignment
        self.tensors = [self._tensor(name, dims, kind, start + offset) for name, dims, kind, offset in infos]

    def _unpack(self, fmt: str) -> tuple:
        values = struct.unpack_from(fmt, self._buffer, self._offset)
        self._offset += struct.calcsize(fmt)
        return values

    def _string(self) -> str:
        (length,) = self._unpack("<Q")
        start = self._offset
        self._offset += length
        return bytes(self._buffer[start : self._offset]).decode("utf-8", errors="replace")

    def _value(self, kind: int) -> Any:
        if kind == _STRING:
            return self._string()
        if kind == _ARRAY:
            item, count = self._unpack("<IQ")
            if item == _STRING:
                return [self._string() for _ in range(count)]
            if item == _ARRAY:
                return [self._value(_ARRAY) for _ in range(count)]
            if item not in _SCALARS:
                raise ValueError(f"{self.path}: unknown GGUF array item type {item}")
            return list(self._unpack(f"<{count}{_SCALARS[item]}"))
        if kind not in _SCALARS:
            raise ValueError(f"{self.path}: unknown GGUF value type {kind}")
        return self._unpack("<" + _SCALARS[kind])[0]

    def _tensor(self, name: str, dims: tuple[int, ...], kind: int, offset: int) -> GGUFTensor:
        from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

        qtype = GGMLQuantizationType(kind)
        n_elements = int(np.prod(dims))
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
