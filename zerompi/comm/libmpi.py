"""Functions of the MPI library the process loaded that mpi4py does not wrap (MPIX extensions),
reached through ctypes; None where the library lacks them. Needs no mpi4py: the library is found
among the process's mapped files."""
from __future__ import annotations

import ctypes
import os
from typing import Any

MPI_SUCCESS = 0  # the standard's value
_MPIX_GPU_SUPPORT_CUDA = 0  # MPICH's mpi.h: MPIX_GPU_SUPPORT_CUDA


def mpi_function(name: str, restype: Any, *argtypes: Any) -> Any:
    """``name`` from the MPI library mpi4py loaded, or None where that library lacks it.

    mpi4py loads libmpi with RTLD_LOCAL, so ``CDLL(None)`` cannot see it: find it in
    /proc/self/maps and reopen it with RTLD_NOLOAD (never loading a second MPI).
    """
    try:
        with open("/proc/self/maps") as maps:
            paths = dict.fromkeys(f[5].strip() for f in (line.split(maxsplit=5) for line in maps) if len(f) == 6)
    except OSError:  # no /proc (not Linux): not reported
        return None
    for path in (p for p in paths if os.path.basename(p).startswith("libmpi")):
        try:
            fn = getattr(ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LAZY), name)
        except (OSError, AttributeError):
            continue
        fn.restype, fn.argtypes = restype, list(argtypes)
        return fn
    return None


def mpix_cuda_support() -> bool | None:
    """Open MPI's (and MPICH's) ``int MPIX_Query_cuda_support(void)``."""
    query = mpi_function("MPIX_Query_cuda_support", ctypes.c_int)
    return None if query is None else bool(query())


def mpix_gpu_cuda_support() -> bool | None:
    """MPICH's ``MPIX_GPU_query_support(MPIX_GPU_SUPPORT_CUDA, &flag)``; None if absent or failing."""
    query = mpi_function("MPIX_GPU_query_support", ctypes.c_int, ctypes.c_int, ctypes.POINTER(ctypes.c_int))
    flag = ctypes.c_int(0)
    if query is None or query(_MPIX_GPU_SUPPORT_CUDA, ctypes.byref(flag)) != MPI_SUCCESS:
        return None
    return bool(flag.value)
