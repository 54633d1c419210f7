"""Sharded HDF5 checkpoints: atomic, verified, resumable at any world size.

``engine.save_checkpoint`` / ``engine.load_checkpoint`` are the collective
entry points; :func:`load_full_state_dict` and :func:`consolidate` read a
checkpoint offline without MPI.
"""
from zerompi.errors import CheckpointError
from zerompi.checkpoint.consolidate import FullStateDict, consolidate, load_full_state_dict
from zerompi.checkpoint.index import CheckpointIndex
from zerompi.checkpoint.reader import load
from zerompi.checkpoint.writer import save
from zerompi.checkpoint.asynchronous import save_async

__all__ = ["CheckpointError", "CheckpointIndex", "FullStateDict", "consolidate", "load",
           "load_full_state_dict", "save", "save_async"]
