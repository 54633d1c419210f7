"""The complete checkpoints under a root, newest first, and keeping only the last K of them.

A tag counts when its directory holds a readable index (``index.h5`` is written last, so a tag with one
was completed); its age is the optimizer steps the index records. Nothing else under the root is
touched: a save in flight (``.tmp`` directories), the complete copy a killed replacement left aside
(``.old-*``), ``latest``, and tags whose index cannot be read (never removed unread: they may be
another tool's, or worth a look). The tag ``latest`` names is always kept.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import NamedTuple

from zerompi.checkpoint import paths, schema
from zerompi.checkpoint.index import CheckpointIndex
from zerompi.errors import CheckpointError


class Tag(NamedTuple):
    name: str
    steps: int


def complete_tags(root: str | os.PathLike) -> list[Tag]:
    """The tags under ``root`` whose index reads, newest (most steps) first; [] without a root."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        if p.name.startswith(".") or p.name == schema.LATEST:
            continue
        try:
            if paths.directory_in(root, p) and (p / schema.INDEX).is_file():
                found.append(Tag(p.name, CheckpointIndex.read(p / schema.INDEX).steps))
        except (CheckpointError, *schema.H5_ERRORS):
            continue  # unreadable: not counted, not removed
    return sorted(found, key=lambda t: (t.steps, t.name), reverse=True)


def latest_tag(root: Path) -> str | None:
    """The tag ``latest`` names, if it can be read (schema.read_latest; nothing is refused here)."""
    try:
        return schema.read_latest(root) or None
    except CheckpointError:
        return None


def prune(root: str | os.PathLike, keep: int) -> list[str]:
    """Remove all but the ``keep`` newest complete tags under ``root`` (and the one ``latest`` names);
    returns the removed tags. Call it on one process, after a save has been published."""
    if keep < 1:
        raise ValueError(f"keep must be at least 1, got {keep}")
    root = Path(root)
    latest = latest_tag(root)
    removed = []
    for tag in complete_tags(root)[keep:]:
        if tag.name != latest:
            shutil.rmtree(root / tag.name)
            removed.append(tag.name)
    return removed


def others_hint(root: str | os.PathLike, failed: str | None) -> str:
    """For an error loading ``failed`` (a tag; None: latest's): the other complete tags, and how to load one."""
    root = Path(root)
    failed = failed or latest_tag(root)
    others = [t for t in complete_tags(root) if t.name != failed][:3]
    if not others:
        return ""
    listed = ", ".join(f"{t.name} (step {t.steps})" for t in others)
    return f"; other checkpoints under {root}: {listed}: load one with load_checkpoint(path, tag=TAG)"
