"""safetensors files read and written one tensor (or one piece of a tensor) at a time.

safetensors' own `safe_open` maps the whole file into the process, and the pages a read touches
stay mapped, and counted in its resident memory, while the file is open; its `save_file` needs
every tensor in memory at once. A model of tens of GB converted that way needs tens of GB of
RAM. Here a read is a plain positioned read of one tensor's bytes into a buffer of its own, and
a write appends each tensor's bytes, a layer at a time if it is stacked, behind a header
written first from the tensors' declared shapes.

The format: an 8-byte little-endian header length, a JSON header (`{name: {"dtype", "shape",
"data_offsets": [begin, end]}}`, optionally `"__metadata__"`) padded with spaces to a multiple
of 8 bytes, then the data: each tensor C-contiguous and little-endian, back to back.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

from launcher_scripts.formats.portable_check import DTYPE_BYTES, MAX_HEADER_BYTES

if TYPE_CHECKING:
    import torch

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


class SafetensorsError(ValueError):
    """A file that is not a readable safetensors file, or a write that breaks its plan: one
    line naming the file and what is wrong."""


def _torch_dtypes() -> dict[str, torch.dtype]:
    import torch

    return {
        "F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
        "BF16": torch.bfloat16, "I64": torch.int64, "I32": torch.int32, "I16": torch.int16,
        "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
    }  # fmt: skip


def dtype_code(dtype: torch.dtype) -> str:
    """safetensors' name of a torch dtype."""
    for code, candidate in _torch_dtypes().items():
        if candidate == dtype:
            return code
    raise SafetensorsError(f"dtype {dtype} has no safetensors name")


@dataclass(frozen=True)
class Entry:
    dtype: str  # safetensors' name: F32, BF16, ...
    shape: tuple[int, ...]
    begin: int  # absolute offsets of the bytes in the file
    end: int


def read_header(path: Path, start: int = 0, size: int | None = None) -> dict[str, Entry]:
    """Every tensor's entry, checked to lie within the file. `start` and `size`: where the
    safetensors bytes lie in `path` (a member of a tar, read in place); default: all of it."""
    try:
        with open(path, "rb") as handle:
            handle.seek(start)
            prefix = handle.read(8)
            if len(prefix) < 8:
                raise SafetensorsError(f"{path}: too short for a safetensors file")
            (length,) = struct.unpack("<Q", prefix)
            if length > MAX_HEADER_BYTES:
                raise SafetensorsError(f"{path}: not a safetensors file (header of {length} bytes)")
            header = json.loads(handle.read(length))
        end_of_data = start + size if size is not None else path.stat().st_size
    except (OSError, ValueError) as error:
        if isinstance(error, SafetensorsError):
            raise
        raise SafetensorsError(f"{path}: unreadable safetensors header ({error})") from None
    data_start = start + 8 + length
    entries = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        begin, end = (data_start + int(offset) for offset in info["data_offsets"])
        shape = tuple(int(d) for d in info["shape"])
        expected = math.prod(shape) * DTYPE_BYTES.get(info["dtype"], 0)
        if end > end_of_data or end - begin != expected:
            raise SafetensorsError(f"{path}: tensor {name} does not fit the file (cut short?)")
        entries[name] = Entry(info["dtype"], shape, begin, end)
    return entries


class TensorFile(Mapping[str, "torch.Tensor"]):
    """The tensors of one safetensors file (or of one stored in a tar, read in place), each
    read on its own when asked for: whole (`file[name]`), or some of its leading rows (the
    layers of a stacked tensor a pipeline stage holds)."""

    def __init__(self, path: Path, start: int = 0, size: int | None = None) -> None:
        self.path = path
        self.entries = read_header(path, start, size)

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self.entries:
            raise KeyError(name)
        entry = self.entries[name]
        return self.read_rows(name, 0, entry.shape[0] if entry.shape else 1)

    def __contains__(self, name: object) -> bool:
        return name in self.entries  # Mapping's own would read the tensor

    def __iter__(self) -> Iterator[str]:
        return iter(self.entries)

    def __len__(self) -> int:
        return len(self.entries)

    def _entry(self, name: str) -> Entry:
        if name not in self.entries:
            raise SafetensorsError(f"{self.path}: the checkpoint has no tensor {name}")
        return self.entries[name]

    def shape(self, name: str) -> tuple[int, ...]:
        return self._entry(name).shape

    def read_rows(self, name: str, first: int, last: int) -> torch.Tensor:
        """Rows first..last-1 of the tensor's leading axis (of a 0-d tensor: itself), read
        into memory of their own (no mapping of the file)."""
        import torch

        entry = self._entry(name)
        if not entry.shape:
            first, last, row_bytes = 0, 1, entry.end - entry.begin
        else:
            rows = entry.shape[0]
            if not 0 <= first <= last <= rows:
                raise SafetensorsError(f"{name}: rows {first}:{last} of {rows}")
            row_bytes = (entry.end - entry.begin) // rows if rows else 0
        buffer = bytearray(row_bytes * (last - first))
        with open(self.path, "rb") as handle:
            handle.seek(entry.begin + row_bytes * first)
            if handle.readinto(buffer) != len(buffer):
                raise SafetensorsError(f"{self.path}: tensor {name} is cut short")
        dtype = _torch_dtypes()[entry.dtype]
        shape = (last - first, *entry.shape[1:]) if entry.shape else ()
        if not buffer:
            return torch.empty(shape, dtype=dtype)
        return torch.frombuffer(buffer, dtype=dtype).reshape(shape)

    def meta(self, name: str) -> torch.Tensor:
        """A tensor of the same shape and dtype on the meta device: no data, for planning."""
        import torch

        entry = self._entry(name)
        return torch.empty(entry.shape, dtype=_torch_dtypes()[entry.dtype], device="meta")


class TensorSource:
    """The tensors of a Hugging Face checkpoint directory (model.safetensors, or the shards a
    model.safetensors.index.json lists), each read on its own."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        index = directory / INDEX
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (OSError, ValueError, KeyError) as error:
                raise SafetensorsError(f"{index}: unreadable ({error})") from None
            files = sorted(set(weight_map.values()))
            missing = [name for name in files if not (directory / name).is_file()]
            if missing:
                raise SafetensorsError(
                    f"{index} names the shard {missing[0]}, which is not in {directory} "
                    f"({len(missing)} of its {len(files)} shards missing): copy every "
                    "shard save_pretrained wrote there"
                )
        elif (directory / SINGLE).is_file():
            files = [SINGLE]
        else:
            raise SafetensorsError(
                f"{directory} has no {SINGLE} (nor {INDEX}): save the model with "
                "safe_serialization (transformers' default)"
            )
        self.files: dict[str, TensorFile] = {}
        for name in files:
            shard = TensorFile(directory / name)
            self.files |= dict.fromkeys(shard.entries, shard)
        if index.is_file():
            for tensor, name in weight_map.items():
                if tensor not in self.files:
                    raise SafetensorsError(
                        f"{index} puts {tensor} in {name}, which does not hold it: the shards "
                        "are not the ones the index was written with"
                    )

    @property
    def names(self) -> set[str]:
        return set(self.files)

    def __contains__(self, name: str) -> bool:
        return name in self.files

    def _file(self, name: str) -> TensorFile:
        if name not in self.files:
            raise SafetensorsError(f"{self.directory}: the checkpoint has no tensor {name}")
        return self.files[name]

    def shape(self, name: str) -> tuple[int, ...]:
        """The tensor's shape, from its file's header (nothing is read)."""
        return self._file(name).shape(name)

    def read(self, name: str) -> torch.Tensor:
        """The tensor's bytes, read into memory of its own (no mapping of the file)."""
        return self._file(name)[name]

    def meta(self, name: str) -> torch.Tensor:
        """A tensor of the same shape and dtype on the meta device: no data, for planning."""
        return self._file(name).meta(name)


# A tensor read function: a name -> its tensor (TensorSource.read, or .meta to plan).
Reader = Callable[[str], "torch.Tensor"]


@dataclass(frozen=True)
class StreamedTensor:
    """A tensor to write, made piece by piece: the pieces' bytes, in order, are its bytes (a
    stacked tensor's pieces are its layers)."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    pieces: Callable[[], Iterable[torch.Tensor]]

    @classmethod
    def whole(cls, name: str, tensor: torch.Tensor) -> StreamedTensor:
        return cls(name, tuple(tensor.shape), tensor.dtype, lambda: (tensor,))

    @classmethod
    def planned(
        cls, name: str, source: TensorSource, piece: Callable[[Reader, int], torch.Tensor],
        layers: int | None = None,
    ) -> StreamedTensor:  # fmt: skip
        """A tensor computed from a checkpoint's tensors: `piece(read, layer)` for each of
        `layers` layers, stacked on a new leading axis, or once (layer 0) when `layers` is None.
        Its shape and dtype come from running `piece` on meta tensors: nothing is read."""
        probe = piece(source.meta, 0)
        lead = () if layers is None else (layers,)
        count = 1 if layers is None else layers

        def pieces() -> Iterator[torch.Tensor]:
            for layer in range(count):
                yield piece(source.read, layer)

        return cls(name, (*lead, *probe.shape), probe.dtype, pieces)


def write(
    path: Path, tensors: Iterable[StreamedTensor], metadata: dict[str, str] | None = None
) -> int:
    """Write the tensors to `path` (header first, then each one's pieces in order); returns
    the file's size. SafetensorsError when a piece does not match its tensor's plan."""
    planned = list(tensors)
    header: dict[str, Any] = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for tensor in planned:
        if tensor.name in header:
            raise SafetensorsError(f"{path}: tensor {tensor.name} is written twice")
        code = dtype_code(tensor.dtype)
        size = math.prod(tensor.shape) * DTYPE_BYTES[code]
        header[tensor.name] = {
            "dtype": code,
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    with open(path, "wb") as handle:
        handle.write(struct.pack("<Q", len(encoded)))
        handle.write(encoded)
        for tensor in planned:
            begin, end = header[tensor.name]["data_offsets"]
            written = sum(_write_piece(handle, piece, tensor) for piece in tensor.pieces())
            if written != end - begin:
                raise SafetensorsError(
                    f"{path}: tensor {tensor.name} got {written} bytes, not {end - begin}"
                )
    return 8 + len(encoded) + offset


def _write_piece(handle: BinaryIO, piece: torch.Tensor, tensor: StreamedTensor) -> int:
    import torch

    if piece.dtype != tensor.dtype:
        raise SafetensorsError(
            f"tensor {tensor.name}: a piece is {piece.dtype}, not {tensor.dtype}"
        )
    data = piece.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
    if data.numel():
        handle.write(memoryview(data.numpy()))
    return int(data.numel())
