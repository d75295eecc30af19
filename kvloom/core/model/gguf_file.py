"""A GGUF file's metadata and tensor table, read without gguf-py's ``GGUFReader`` (which builds numpy objects
for every element of the tokenizer's arrays: ~700 MB and seconds for a 262k vocabulary); tensors stay mapped."""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import quant_shape_to_byte_shape

_MAGIC = b"GGUF"
_VERSIONS = (2, 3)
_DEFAULT_ALIGNMENT = 32
_STRING, _ARRAY = 8, 9
# GGUF value type -> struct format (little-endian)
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
# tensor types held as elements (the rest as the bytes of their blocks, as gguf-py holds them)
_ELEMENT_TYPES = {GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16,
                  GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8,
                  GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
                  GGMLQuantizationType.I64: np.int64}


@dataclass(frozen=True)
class GGUFArray:
    """An array kept in the file (the tokenizer's vocabulary, scores, merges): its length and where it is."""

    type: int
    count: int
    offset: int


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor: ``shape`` in GGUF's order (fastest dimension first), ``data`` a read-only view of its bytes
    in the mapped file, shaped as gguf-py's reader shapes it (rows of elements, or of block bytes)."""

    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]
    data: np.ndarray


class GGUFFile:
    """``fields``: metadata key -> value (int, float, bool, str; a list for a small array, a ``GGUFArray``
    for one of more than ``max_array`` elements); ``tensors`` in file order. The file stays mapped while
    this object or a tensor's ``data`` lives; ``release`` drops a tensor's pages from this process."""

    def __init__(self, path: str | Path, max_array: int = 1024) -> None:
        self.path = str(path)
        with open(self.path, "rb") as f:
            if f.read(4) != _MAGIC or len(f.read(20)) < 20:  # the magic, the version and the two counts
                raise ValueError(f"{self.path!r} is not a GGUF file (no GGUF header)")
        self.data = np.memmap(self.path, mode="r")
        self._buf = memoryview(self.data)
        self._pos = 4
        version = self._scalar(4)
        if version not in _VERSIONS:
            raise ValueError(f"{self.path!r}: GGUF version {version} (big-endian or unknown); supported: {_VERSIONS}")
        self.fields: dict[str, object] = {}
        try:
            infos = self._read_header(max_array)
        except (struct.error, UnicodeDecodeError, ValueError) as e:
            raise ValueError(f"{self.path!r}: GGUF metadata cut short or corrupt at byte {self._pos} ({e})") from None
        alignment = self.fields.get("general.alignment", _DEFAULT_ALIGNMENT)
        if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"{self.path!r}: general.alignment {alignment!r} is not a power of two")
        start = -(-self._pos // alignment) * alignment
        self.tensors = [self._tensor(name, qtype, dims, start + offset) for name, qtype, dims, offset in infos]
        del self._buf

    def _read_header(self, max_array: int) -> list[tuple]:
        n_tensors, n_fields = self._scalar(10), self._scalar(10)
        for _ in range(n_fields):
            key = self._string()
            self.fields[key] = self._value(self._scalar(4), max_array)
        infos = []
        for _ in range(n_tensors):
            name = self._string()
            dims = tuple(self._scalar(10) for _ in range(self._scalar(4)))
            infos.append((name, GGMLQuantizationType(self._scalar(4)), dims, self._scalar(10)))
        return infos

    def _scalar(self, vtype: int):
        fmt = _SCALARS[vtype]
        (value,) = struct.unpack_from(fmt, self._buf, self._pos)
        self._pos += struct.calcsize(fmt)
        return value

    def _string(self) -> str:
        n = self._scalar(10)
        if self._pos + n > len(self._buf):
            raise ValueError(f"a string of {n} bytes runs past the end of the file")
        text = bytes(self._buf[self._pos:self._pos + n]).decode("utf-8")
        self._pos += n
        return text

    def _skip_strings(self, count: int) -> None:
        buf, pos, unpack = self._buf, self._pos, struct.Struct("<Q").unpack_from
        for _ in range(count):
            pos += 8 + unpack(buf, pos)[0]
        if pos > len(buf):
            raise ValueError("a string array runs past the end of the file")
        self._pos = pos

    def _value(self, vtype: int, max_array: int):
        if vtype == _STRING:
            return self._string()
        if vtype != _ARRAY:
            if vtype not in _SCALARS:
                raise ValueError(f"{self.path!r}: unknown GGUF value type {vtype} at byte {self._pos}")
            return self._scalar(vtype)
        item, count = self._scalar(4), self._scalar(10)
        offset = self._pos
        if count <= max_array:
            return [self._value(item, max_array) for _ in range(count)]
        if item == _STRING:
            self._skip_strings(count)
        elif item in _SCALARS:
            self._pos += count * struct.calcsize(_SCALARS[item])
        else:  # arrays of arrays: walked element by element
            for _ in range(count):
                self._value(item, 0)
        return GGUFArray(item, count, offset)

    def _tensor(self, name: str, qtype: GGMLQuantizationType, dims: tuple[int, ...], offset: int) -> GGUFTensor:
        shape = tuple(reversed(dims))
        n = int(np.prod(shape, dtype=np.int64))
        block, size = GGML_QUANT_SIZES[qtype]
        if qtype in _ELEMENT_TYPES:
            dtype, count = np.dtype(_ELEMENT_TYPES[qtype]), n
        else:
            dtype, count, shape = np.dtype(np.uint8), n // block * size, quant_shape_to_byte_shape(shape, qtype)
        if offset + count * dtype.itemsize > len(self.data):
            raise ValueError(f"{self.path!r}: tensor {name!r} runs past the end of the file")
        data = np.ndarray(shape, dtype, buffer=self.data, offset=offset)
        return GGUFTensor(name, qtype, dims, data)

    def release(self, tensor: GGUFTensor) -> None:
        """Drop ``tensor``'s file pages from this process's memory (they stay in the page cache; read
        again, they come back): a load holds the pages of one tensor at a time, not of the whole file."""
        mapping = getattr(self.data, "_mmap", None)
        if mapping is None or not hasattr(mapping, "madvise"):
            return
        start = tensor.data.ctypes.data - self.data.ctypes.data
        first = start // mmap.PAGESIZE * mmap.PAGESIZE
        end = -(-(start + tensor.data.nbytes) // mmap.PAGESIZE) * mmap.PAGESIZE
        mapping.madvise(mmap.MADV_DONTNEED, first, min(end, len(mapping)) - first)
