"""Write safetensors files a few tensors at a time: the header first (every tensor's dtype, shape and offset
are known before any is loaded), then each tensor's bytes as it arrives, so the writer never holds a file.

The format: an 8-byte little-endian header length, the JSON header (space-padded to 8 bytes), then the
tensors' bytes back to back in header order. Hugging Face's sharded layout is several such files,
`model-0000k-of-0000n.safetensors`, and `model.safetensors.index.json` mapping each tensor to its file.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Callable, Iterable

import torch

DTYPES = {
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float64: "F64",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
"""torch dtype -> safetensors' name for it."""
HOLD_BYTES = 64 << 20
"""How many tensor bytes one read loads at most (a larger tensor is read alone): export's working set."""


@dataclass(frozen=True)
class Entry:
    """One tensor to write: its name in the file, its shape and dtype, and its name where it is read from."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    source: str

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def split_shards(entries: list[Entry], max_bytes: int) -> list[list[Entry]]:
    """Consecutive tensors into files of at most `max_bytes` each (a larger tensor gets a file of its own)."""
    shards: list[list[Entry]] = [[]]
    size = 0
    for entry in entries:
        if shards[-1] and size + entry.nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(entry)
        size += entry.nbytes
    return shards


def shard_names(count: int) -> list[str]:
    """Hugging Face's file names: model.safetensors alone, else model-0000k-of-0000n.safetensors."""
    if count == 1:
        return ["model.safetensors"]
    return [f"model-{k:05d}-of-{count:05d}.safetensors" for k in range(1, count + 1)]


def header_bytes(entries: list[Entry], metadata: dict[str, str]) -> bytes:
    """The length prefix and JSON header of a file holding `entries` in order."""
    header: dict[str, object] = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for entry in entries:
        header[entry.name] = {
            "dtype": DTYPES[entry.dtype],
            "shape": list(entry.shape),
            "data_offsets": [offset, offset + entry.nbytes],
        }
        offset += entry.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the tensors start 8-byte aligned
    return struct.pack("<Q", len(text)) + text


def reads(entries: list[Entry], hold_bytes: int = HOLD_BYTES) -> Iterable[list[Entry]]:
    """Consecutive groups of at most `hold_bytes` (one tensor at least): what one read loads."""
    group: list[Entry] = []
    for entry in entries:
        if group and sum(e.nbytes for e in group) + entry.nbytes > hold_bytes:
            yield group
            group = []
        group.append(entry)
    if group:
        yield group


Loader = Callable[[list[str]], dict[str, torch.Tensor]]
"""Reads the named tensors (by their `source` names)."""


def write_file(path: Path, entries: list[Entry], load: Loader, metadata: dict[str, str]) -> None:
    """One safetensors file, its tensors loaded a group at a time and written as they come."""
    with open(path, "wb") as handle:
        handle.write(header_bytes(entries, metadata))
        for group in reads(entries):
            tensors = load([e.source for e in group])
            for entry in group:
                _write_tensor(handle, entry, tensors.pop(entry.source))
            del tensors


def _write_tensor(handle: BinaryIO, entry: Entry, tensor: torch.Tensor) -> None:
    if tuple(tensor.shape) != entry.shape or tensor.dtype != entry.dtype:
        raise ValueError(
            f"{entry.source}: read {tuple(tensor.shape)} {tensor.dtype}, expected {entry.shape} {entry.dtype}"
        )
    # A byte view of the tensor's memory (no copy; numpy has no bfloat16, uint8 it has).
    handle.write(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().data)


def index_json(shards: list[list[Entry]], names: list[str], metadata: dict[str, str]) -> str:
    """model.safetensors.index.json: the total size and which file holds each tensor."""
    weight_map = {entry.name: name for shard, name in zip(shards, names) for entry in shard}
    total = sum(entry.nbytes for shard in shards for entry in shard)
    return json.dumps({"metadata": {**metadata, "total_size": total}, "weight_map": weight_map}, indent=2) + "\n"
