"""A checkpoint's paths stay inside it: no symbolic link leads a reader out of the root.

``ROOT/TAG`` and ``ROOT/latest`` must resolve inside ``ROOT`` (a link to another tag
there is fine); the files of a tag (``index.h5``, ``rankNNNNN.h5``, ``shards.h5``)
must be regular files inside the tag's directory. A FIFO or a device in their place
is refused before it is opened, since opening one can block forever.
"""
from __future__ import annotations

import os
import stat
from pathlib import Path

from zerompi.errors import CheckpointError


def _real(path: Path) -> Path | None:
    try:
        return path.resolve(strict=True)
    except FileNotFoundError:
        return None
    except (OSError, RuntimeError) as e:  # a loop of links, permissions
        raise CheckpointError(f"{path}: cannot resolve the path ({e})") from e


def contained(path: Path, root: Path, what: str = "checkpoint root") -> Path | None:
    """The real path of ``path`` (None when it does not exist), refused when it leaves ``root``."""
    real, real_root = _real(path), _real(root)
    if real is None or real_root is None:
        return None
    if real != real_root and real_root not in real.parents:
        how = "is a symbolic link" if path.is_symlink() else "leads through a symbolic link"
        raise CheckpointError(f"{path}: {how} to {real}, outside the {what} {root}: refused "
                              "(a checkpoint is read only from its own files)")
    return real


def directory_in(root: Path, path: Path) -> bool:
    """Whether ``path`` is a directory inside ``root`` (False when missing; refused when it leaves)."""
    real = contained(path, root)
    return real is not None and real.is_dir()


def regular_file(path: Path, directory: Path | None = None, what: str = "checkpoint directory") -> Path:
    """``path``, checked to be a regular file inside ``directory`` (its parent by default)."""
    directory = path.parent if directory is None else directory
    real = contained(path, directory, what)
    if real is None:
        raise CheckpointError(f"{path}: missing")
    mode = os.stat(real).st_mode
    if not stat.S_ISREG(mode):
        raise CheckpointError(f"{path}: not a regular file (mode {stat.filemode(mode)}): refused without opening it")
    return path
