"""Whether device tensors go straight to MPI: the ``cuda_aware_mpi`` decision, free of MPI.

MPI libraries report CUDA support three ways, none of them everywhere:

* the MPI-4.1 ``mpi_memory_alloc_kinds`` info value (e.g. ``"system,mpi,cuda:device"``),
* Open MPI's ``MPIX_Query_cuda_support()`` (MPICH has it too),
* MPICH's ``MPIX_GPU_query_support(MPIX_GPU_SUPPORT_CUDA, &flag)``.

mpi/library.py asks the library (:func:`zerompi.comm.mpi.cuda_probes`); this module only
weighs the answers, so every combination can be tested without a GPU or an MPI.
"""
from __future__ import annotations

from dataclasses import dataclass

from zerompi.config.choices import CudaAware
from zerompi.errors import ConfigError


@dataclass(frozen=True)
class Probes:
    """What the MPI library and torch said; None where a probe got no answer."""

    alloc_kinds: str | None  # the mpi_memory_alloc_kinds info value
    mpix_cuda: bool | None   # MPIX_Query_cuda_support(); None when the symbol is absent
    mpix_gpu: bool | None    # MPIX_GPU_query_support(CUDA); None when absent or failed
    torch_cuda: bool         # torch.cuda.is_available()

    def describe(self) -> str:
        kinds = "unset" if self.alloc_kinds is None else repr(self.alloc_kinds)
        return (f"mpi_memory_alloc_kinds={kinds}, MPIX_Query_cuda_support={_answer(self.mpix_cuda)}, "
                f"MPIX_GPU_query_support(CUDA)={_answer(self.mpix_gpu)}")


@dataclass(frozen=True)
class Decision:
    use: bool    # hand device buffers to MPI (else stage them through pinned host memory)
    reason: str  # for the log: the setting and what the probes said


def _answer(value: bool | None) -> str:
    return "absent" if value is None else ("yes" if value else "no")


def parse_alloc_kinds(value: str) -> dict[str, frozenset[str]]:
    """Kind -> restrictors: ``"system,mpi,cuda:device"`` gives ``system`` and ``mpi`` bare, ``cuda`` {device}.

    A kind listed bare stands for all its restrictors, so it maps to the empty set
    (a bare entry of a kind also listed with restrictors wins).
    """
    kinds: dict[str, frozenset[str]] = {}
    for entry in value.split(","):
        name, *restrictors = [part.strip().lower() for part in entry.split(":")]
        if not name:
            continue
        if not restrictors or kinds.get(name) == frozenset():
            kinds[name] = frozenset()
        else:
            kinds[name] = kinds.get(name, frozenset()) | frozenset(restrictors)
    return kinds


def kinds_say_cuda(value: str | None) -> bool | None:
    """True when the kinds cover CUDA device memory, else None (never a no).

    MPI 4.1 lets a library list only the kinds the user asked for (``mpiexec
    -memory-alloc-kinds``), so a list without ``cuda`` is silence, not a refusal;
    ``cuda:host`` alone covers pinned host memory, not the device buffers we send.
    """
    if value is None:
        return None
    cuda = parse_alloc_kinds(value).get("cuda")
    return True if cuda is not None and (not cuda or "device" in cuda) else None


def mpi_says(probes: Probes) -> bool | None:
    """One yes is enough (each probe may be missing from a CUDA-aware MPI); a no needs no yes."""
    answers = (kinds_say_cuda(probes.alloc_kinds), probes.mpix_cuda, probes.mpix_gpu)
    if True in answers:
        return True
    return False if False in answers else None


def decide(setting: CudaAware, probes: Probes) -> Decision:
    """``off``/``on`` as told (``on`` refused when MPI says no); ``auto`` needs torch.cuda and a yes.

    Raises ConfigError for ``on`` with an MPI that reports no CUDA support: handing it
    device pointers would crash inside MPI, far from the setting that caused it.
    """
    said, evidence = mpi_says(probes), probes.describe()
    if setting == CudaAware.OFF:
        return Decision(False, "cuda_aware_mpi='off'")
    if setting == CudaAware.ON:
        if said is False:
            raise ConfigError(f"cuda_aware_mpi='on' but the MPI library reports no CUDA support ({evidence}); "
                              "use 'auto' or 'off' to stage device buffers through host memory")
        why = "and MPI confirms it" if said else "and MPI does not say either way: trusting the setting"
        return Decision(True, f"cuda_aware_mpi='on' {why} ({evidence})")
    if not probes.torch_cuda:
        return Decision(False, "cuda_aware_mpi='auto' and torch.cuda is not available")
    how = "reports" if said else ("reports no" if said is False else "does not report")
    return Decision(bool(said), f"cuda_aware_mpi='auto' and MPI {how} CUDA support ({evidence})")
