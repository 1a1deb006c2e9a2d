"""Hugging Face safetensors directories: their headers read and checked, and written one tensor at a time.

A safetensors file is an 8-byte little-endian header length, a JSON header
`{key: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}` and the tensors'
bytes (offsets relative to the end of the header). A directory holds `model.safetensors`, or
several files named by `model.safetensors.index.json`'s `weight_map` (key -> file).

Reading the tensors' bytes is left to `safetensors.safe_open(...).get_slice` (it maps the file and
reads the byte ranges of a slice). The headers are parsed here because every field must be checked
(dtype known, shape and offsets consistent, the data inside the file: a truncated file) before any
tensor is read, and the error must name the file and the key; nothing in a header is evaluated.

Writing is our own because `safetensors.torch.save_file` takes every tensor of a file at once: a
file of a sharded model would be gathered whole on one rank. Here the header is written from the
global shapes, then each tensor is gathered (a collective every rank joins), written by rank 0 and
dropped: the peak is one full tensor.
"""
from __future__ import annotations

import json
import math
import os
import re
import struct
from collections.abc import Callable, Iterable

import torch

from ..errors import CheckpointError

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
# safetensors' dtype names (the format's specification) <-> torch dtypes
DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
NAMES = {v: k for k, v in DTYPES.items()}
# a header longer than this is not a model's (safetensors itself refuses headers over 100 MB)
MAX_HEADER_BYTES = 100_000_000
# the header is padded with spaces to a multiple of this, so that the data is aligned (as safetensors does)
HEADER_ALIGN = 8


class Entry:
    """One tensor of a safetensors directory: its file, key, global shape and dtype."""
    __slots__ = ("file", "key", "shape", "dtype")

    def __init__(self, file: str, key: str, shape: tuple[int, ...], dtype: torch.dtype):
        self.file, self.key, self.shape, self.dtype = file, key, shape, dtype


def is_safetensors_dir(path: str) -> bool:
    return os.path.isdir(path) and (os.path.exists(os.path.join(path, INDEX))
                                    or any(f.endswith(".safetensors") for f in os.listdir(path)))


def read_directory(path: str) -> dict[str, Entry]:
    """key -> Entry for every tensor of the directory, every header checked (CheckpointError naming
    the file and the key otherwise)."""
    index = os.path.join(path, INDEX)
    if os.path.exists(index):
        weight_map = _weight_map(index)
        files = sorted(set(weight_map.values()))
    else:
        weight_map, files = None, sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    entries: dict[str, Entry] = {}
    for name in files:
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            raise CheckpointError(f"{index} names file {name!r}, which {path} does not hold")
        for key, entry in read_header(file).items():
            if key in entries:
                raise CheckpointError(f"{file}: tensor {key!r} is also in {entries[key].file}")
            if weight_map is not None and weight_map.get(key) != name:
                raise CheckpointError(f"{file}: tensor {key!r} is not listed for this file in {index}")
            entries[key] = entry
    if weight_map is not None:
        absent = sorted(set(weight_map) - set(entries))
        if absent:
            raise CheckpointError(f"{index} lists tensor {absent[0]!r} in {weight_map[absent[0]]!r}, which does "
                                  f"not hold it ({len(absent)} such)")
    return entries


def _weight_map(index: str) -> dict[str, str]:
    try:
        with open(index) as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{index}: not a readable JSON index ({e})") from None
    wm = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(wm, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in wm.items()):
        raise CheckpointError(f"{index}: field 'weight_map' must map tensor names to file names")
    bad = [v for v in wm.values() if os.path.basename(v) != v]
    if bad:
        raise CheckpointError(f"{index}: weight_map names file {bad[0]!r} outside the directory")
    return wm


def read_header(file: str) -> dict[str, Entry]:
    size = os.path.getsize(file)
    with open(file, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError(f"{file}: truncated ({size} bytes): no safetensors header")
        (n,) = struct.unpack("<Q", head)
        if n > min(MAX_HEADER_BYTES, size - 8):
            raise CheckpointError(f"{file}: header of {n} bytes does not fit the file ({size} bytes): truncated "
                                  f"or not a safetensors file")
        try:
            header = json.loads(f.read(n))
        except ValueError as e:
            raise CheckpointError(f"{file}: header is not JSON ({e})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{file}: header is not a JSON object")
    data_bytes = size - 8 - n
    out = {}
    for key, info in header.items():
        if key == "__metadata__":
            continue
        out[key] = _entry(file, key, info, data_bytes)
    return out


def _entry(file: str, key: str, info, data_bytes: int) -> Entry:
    where = f"{file}: tensor {key!r}"
    if not isinstance(info, dict):
        raise CheckpointError(f"{where}: header entry is not an object")
    dtype = DTYPES.get(info.get("dtype"))
    if dtype is None:
        raise CheckpointError(f"{where}: field 'dtype' = {info.get('dtype')!r} is not one of {sorted(DTYPES)}")
    shape, offsets = info.get("shape"), info.get("data_offsets")
    if not (isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)):
        raise CheckpointError(f"{where}: field 'shape' must be a list of non-negative integers")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int and o >= 0 for o in offsets)):
        raise CheckpointError(f"{where}: field 'data_offsets' must be two non-negative integers")
    begin, end = offsets
    if end - begin != math.prod(shape) * dtype.itemsize:
        raise CheckpointError(f"{where}: data_offsets {offsets} do not hold shape {shape} of {info['dtype']}")
    if end > data_bytes:
        raise CheckpointError(f"{where}: its data ends at byte {end} of the data, past the file's end "
                              f"({data_bytes} data bytes): the file is truncated")
    return Entry(file, key, tuple(shape), dtype)


def shard_size(max_shard_size) -> int:
    """Bytes from an int or a Hugging Face size string ("5GB" = 5e9, "2GiB" = 2 * 2**30)."""
    if isinstance(max_shard_size, int) and max_shard_size > 0:
        return max_shard_size
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(i?)B\s*", str(max_shard_size), re.IGNORECASE)
    if not m:
        raise CheckpointError(f"max_shard_size={max_shard_size!r}: give bytes (an int) or a size such as '5GB'")
    base = 1024 if m.group(3) else 1000
    return int(float(m.group(1)) * base ** " KMGT".index(m.group(2).upper() or " "))


def plan_files(tensors: list[tuple[str, tuple[int, ...], torch.dtype]], limit: int) -> list[list[int]]:
    """Indices of `tensors` per file, in order, each file under `limit` bytes unless one tensor is larger."""
    files: list[list[int]] = [[]]
    used = 0
    for i, (_, shape, dtype) in enumerate(tensors):
        n = math.prod(shape) * dtype.itemsize
        if files[-1] and used + n > limit:
            files.append([])
            used = 0
        files[-1].append(i)
        used += n
    return files


def write_directory(path: str, tensors: list[tuple[str, tuple[int, ...], torch.dtype]],
                    value: Callable[[int], torch.Tensor], max_shard_size, writer: bool) -> list[str]:
    """Write `tensors` (key, shape, dtype) as a safetensors directory: `value(i)` gives tensor i whole (every
    rank calls it, in order: it may be a collective); only the `writer` rank writes. -> the file names."""
    groups = plan_files(tensors, shard_size(max_shard_size))
    names = ([SINGLE] if len(groups) == 1 else
             [f"model-{k + 1:05d}-of-{len(groups):05d}.safetensors" for k in range(len(groups))])
    if writer:
        os.makedirs(path, exist_ok=True)
    for name, group in zip(names, groups):
        with open(os.path.join(path, name), "wb") if writer else _Discard() as f:
            f.write(_header([tensors[i] for i in group]))
            for i in group:
                t = value(i)
                if writer:
                    f.write(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().data)
                del t
    if writer and len(names) > 1:
        total = sum(math.prod(s) * d.itemsize for _, s, d in tensors)
        index = {"metadata": {"total_size": total},
                 "weight_map": {tensors[i][0]: name for name, group in zip(names, groups) for i in group}}
        with open(os.path.join(path, INDEX), "w") as f:
            json.dump(index, f, indent=2, sort_keys=True)
    return names


def _header(tensors: Iterable[tuple[str, tuple[int, ...], torch.dtype]]) -> bytes:
    header: dict = {"__metadata__": {"format": "pt"}}
    at = 0
    for key, shape, dtype in tensors:
        n = math.prod(shape) * dtype.itemsize
        header[key] = {"dtype": NAMES[dtype], "shape": list(shape), "data_offsets": [at, at + n]}
        at += n
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-(8 + len(text)) % HEADER_ALIGN)
    return struct.pack("<Q", len(text)) + text


class _Discard:
    """A file that is not written (ranks other than the writer go through the same collectives)."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def write(self, data) -> None:
        pass
