"""A byte-level text corpus made of the Python standard library's own source.

The stdlib ships with every Python, so training jobs and tests need no
download and no disk cache: the sorted top-level ``*.py`` files of the stdlib
directory are read, each followed by a newline, and concatenated into one
uint8 array (vocabulary: the 256 byte values). The content depends on the
Python version, so compare results across machines only on the same one.
"""
from __future__ import annotations

import logging
import sysconfig
from pathlib import Path

import numpy as np
import torch

log = logging.getLogger(__name__)

VOCAB_SIZE = 256
VAL_FRACTION = 0.05


def stdlib_bytes(max_bytes: int | None = None) -> np.ndarray:
    """The concatenated stdlib sources as a uint8 array, cut to max_bytes if given."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(root.glob("*.py"))
    if not files:
        raise FileNotFoundError(f"no *.py files in the stdlib directory {root}")
    chunks, total = [], 0
    for f in files:
        chunks.append(f.read_bytes() + b"\n")
        total += len(chunks[-1])
        if max_bytes is not None and total >= max_bytes:
            break  # no need to read files that would be cut away
    data = b"".join(chunks)
    if max_bytes is not None:
        data = data[:max_bytes]
    log.debug("corpus: %d bytes from %d files in %s", len(data), len(chunks), root)
    return np.frombuffer(data, dtype=np.uint8).copy()


def decode(ids) -> str:
    """Byte ids (tensor, array or list) back to text; invalid UTF-8 is replaced."""
    if isinstance(ids, torch.Tensor):
        ids = ids.tolist()
    return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


class ByteCorpus:
    """Train/val split (last 5% is val) of the stdlib corpus, with random batches.

    ``get_batch`` draws only from the generator it is given, so sampling is
    reproducible. In data-parallel training the caller seeds a fresh
    generator per draw from (seed, step, rank) (plus the micro-step when
    accumulating), so that each rank draws its own, deterministic micro-batch
    and a run can be repeated or resumed exactly.
    """

    vocab_size = VOCAB_SIZE

    def __init__(self, max_bytes: int | None = None):
        data = torch.from_numpy(stdlib_bytes(max_bytes))
        n_val = max(1, int(len(data) * VAL_FRACTION))
        self.train = data[:-n_val]
        self.val = data[-n_val:]

    def __len__(self) -> int:
        return len(self.train) + len(self.val)

    def get_batch(self, split: str, batch_size: int, block_size: int,
                  generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """``batch_size`` random windows of ``block_size`` bytes: inputs x and next-byte targets y."""
        if split not in ("train", "val"):
            raise ValueError(f"split must be 'train' or 'val', not {split!r}")
        data = self.train if split == "train" else self.val
        if len(data) <= block_size:
            raise ValueError(f"{split} split has {len(data)} bytes, need more than block_size={block_size}")
        starts = torch.randint(len(data) - block_size, (batch_size,), generator=generator)
        offsets = torch.arange(block_size + 1)
        windows = data[starts[:, None] + offsets].long()  # (batch_size, block_size + 1)
        return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()
