"""Making files durable and proving they read back: fsync by path, and a full checksum re-read."""
from __future__ import annotations

import os
from pathlib import Path

from zerompi.checkpoint import objects, schema
from zerompi.errors import CheckpointError


def fsync_path(path: Path, evict: bool = False) -> None:
    """fsync a file or directory by path; with ``evict``, then drop the file's (now clean) pages from
    the page cache, so that a verifying re-read comes from the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        if evict:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def verify_file(path: Path) -> None:
    """Re-read every dataset of a zerompi HDF5 file (index or rank file) and check its checksums,
    as bound to the file's header (the writer's own check; readers bind to what the index says)."""
    try:
        with schema.open_h5(path) as f:
            for name in objects.walk(f):
                schema.read_array(schema.open_array(f, name, schema.bound_to(f, name)))
    except CheckpointError:
        raise
    except schema.H5_ERRORS as e:
        raise schema.damaged(str(path), e) from e
