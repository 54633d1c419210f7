"""Writing the safetensors format (no pickle): an 8-byte header size, a JSON header, raw data.

Used by ``consolidate`` (full fp32 weights streamed from a checkpoint) and by
``zerompi.deepspeed``'s ``save_16bit_model`` (the gathered weights in the compute dtype).
The file appears under its name only once it is complete (written aside, then renamed).
"""
from __future__ import annotations

import json
import struct
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import NamedTuple

CODES = {"float64": "F64", "float32": "F32", "bfloat16": "BF16", "float16": "F16", "int64": "I64",
         "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL"}
_ITEMSIZE = {"F64": 8, "F32": 4, "BF16": 2, "F16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}


class Entry(NamedTuple):
    name: str
    shape: tuple[int, ...]
    code: str  # a value of CODES: "F32", "BF16", "I64", ...


def write(out: Path, entries: Iterable[Entry], data: Callable[[str], memoryview],
          metadata: dict[str, str] | None = None) -> Path:
    """Write ``entries`` in order, each tensor's little-endian bytes from ``data(name)``."""
    entries = list(entries)
    header, offset = {}, 0
    for e in entries:
        nbytes = _ITEMSIZE[e.code]
        for d in e.shape:
            nbytes *= int(d)
        header[e.name] = {"dtype": e.code, "shape": list(e.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    header["__metadata__"] = {"format": "pt", **(metadata or {})}
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # data starts 8-byte aligned
    out = Path(out)
    tmp = out.with_name(f".{out.name}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(struct.pack("<Q", len(blob)))
            f.write(blob)
            for e in entries:
                f.write(data(e.name))
        tmp.rename(out)
    finally:
        tmp.unlink(missing_ok=True)
    return out
