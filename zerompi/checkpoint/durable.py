"""Making files durable and proving they read back: fsync by path, and a full checksum re-read."""
from __future__ import annotations

import os
from pathlib import Path

from zerompi.checkpoint import schema
from zerompi.errors import CheckpointError


def fsync_path(path: Path) -> None:
    """fsync a file or directory by path (h5py does not expose its descriptor)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def verify_file(path: Path) -> None:
    """Re-read every dataset of an HDF5 file and check its checksums."""
    def visit(_name, obj):
        if hasattr(obj, "shape"):
            schema.read_array(obj)
    try:
        with schema.open_h5(path) as f:
            f.visititems(visit)
    except CheckpointError:
        raise
    except schema.H5_ERRORS as e:
        raise schema.damaged(str(path), e) from e
