"""Start an asynchronous save: the collective part and the taking of the state here, the writing on a
thread (background.py) that gets only what was taken (taken.py)."""
from __future__ import annotations

import os
from collections.abc import Callable
from functools import partial
from typing import Any

from zerompi.checkpoint.background import BackgroundSave
from zerompi.checkpoint.entries import entries
from zerompi.checkpoint.rawio import WriteOptions
from zerompi.checkpoint.stores import store_for
from zerompi.checkpoint.taken import Capture, check_plain
from zerompi.checkpoint.writer import begin, publish
from zerompi.config.choices import CheckpointLayout
from zerompi.errors import UsageError


def save_async(engine, root: str | os.PathLike, tag: str | None = None, client_state: Any = None, *,
               include_frozen: bool = True,
               after_fence: Callable[[], None] | None = None) -> tuple[str, BackgroundSave]:
    """Collective: start writing a checkpoint of ``engine`` now; returns its tag and the save in flight.

    Only per-rank files can be written without MPI: with checkpoint_layout='auto' an asynchronous
    save writes them even where h5py could write the shared file (both load alike); 'shared' is refused.
    ``after_fence`` is called on the save's thread of each writing rank once the fence has released every
    bucket, before the rest of the file is written: from then on training may change anything while the
    thread writes what was taken at the call (tests hold the thread there).
    """
    layout = engine.config.checkpointing.layout
    if layout in (CheckpointLayout.SHARED, CheckpointLayout.PER_NODE):
        how = "collectively through MPI-IO" if layout == CheckpointLayout.SHARED else \
            "one file per node from shards gathered over MPI"
        raise UsageError(f"save_checkpoint(async_save=True) writes one file per rank without MPI, and "
                         f"checkpoint_layout={layout.value!r} writes {how}; allowed with "
                         "async_save: checkpoint_layout='per_rank' or 'auto'")
    store = store_for(CheckpointLayout.PER_RANK)
    job = begin(engine, root, tag, client_state, store, copy=True, include_frozen=include_frozen)
    snap, write, publisher = job.snap, None, None
    group, tmp, save_id = snap.view.group, job.tmp, job.save_id
    try:
        if snap.view.writes:  # taken now, on this thread; the optimizer's buckets are held at the fence
            capture = Capture.of(entries(snap, job.meta, include_frozen))
            # on the save's own thread alone, no I/O pool beside it: with O_DIRECT from page-aligned shards
            # a write costs little CPU, and the steps keep the cores. (A lowered priority was tried: the
            # save then lags, and a step that reaches a bucket it has not written waits at the fence.)
            options = WriteOptions.from_policy(snap.view.config.checkpointing)._replace(threads=1)
            def write():  # noqa: E306 - on the save's thread
                store.write(tmp, group, capture.parts(after_fence), save_id, options)
        if engine.group.rank == 0:
            publication = job.publication(copy=True)
            check_plain(publication, "the index")
            publisher = partial(publish, publication)  # on the save's thread
        save = BackgroundSave(job.tag, tmp, write, group.rank, group.size, publisher, snap.view.fence)
        return job.tag, save.start()
    except BaseException:  # no thread: nothing will release the buckets
        snap.view.fence.release_all()
        raise
