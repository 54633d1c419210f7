"""The cuda_aware_mpi decision from fake probe answers (zerompi/comm/cuda_aware.py), and the real probes here."""
from __future__ import annotations

import importlib.metadata
import itertools

import pytest

from zerompi.comm.cuda_aware import Probes, decide, kinds_say_cuda, mpi_says, parse_alloc_kinds
from zerompi.errors import ConfigError

YES_KINDS, NO_KINDS = "system,mpi,cuda:device", "mpi,system"  # NO_KINDS: what MPICH 5 reports


def probes(kinds=None, mpix_cuda=None, mpix_gpu=None, torch_cuda=True) -> Probes:
    return Probes(kinds, mpix_cuda, mpix_gpu, torch_cuda)


@pytest.mark.parametrize("value, kinds", [
    ("system,mpi,cuda:device", {"system": set(), "mpi": set(), "cuda": {"device"}}),
    (" mpi , CUDA:Device ,cuda:host", {"mpi": set(), "cuda": {"device", "host"}}),
    ("cuda:host,cuda", {"cuda": set()}),          # bare cuda covers every restrictor
    ("cuda,cuda:host", {"cuda": set()}),
    ("rocm:device,,level_zero", {"rocm": {"device"}, "level_zero": set()}),
    ("", {}),
])
def test_parse_alloc_kinds(value, kinds):
    assert parse_alloc_kinds(value) == kinds


@pytest.mark.parametrize("value, said", [
    ("system,mpi,cuda:device", True), ("cuda", True), ("mpi,cuda:host,cuda:device", True),
    ("cuda:host", None),                         # pinned host memory only, not our device buffers
    ("cuda:managed", None), ("mpi,system", None),  # a list without cuda may just not list what was not asked
    ("rocm:device", None), (None, None),
])
def test_alloc_kinds_say_yes_or_nothing(value, said):
    assert kinds_say_cuda(value) is said


ANSWERS = (None, False, True)


@pytest.mark.parametrize("kinds, mpix_cuda, mpix_gpu",
                         list(itertools.product((None, NO_KINDS, YES_KINDS), ANSWERS, ANSWERS)))
def test_mpi_says_yes_if_any_probe_does_no_if_one_says_no(kinds, mpix_cuda, mpix_gpu):
    answers = (kinds_say_cuda(kinds), mpix_cuda, mpix_gpu)
    expected = True if True in answers else (False if False in answers else None)
    assert mpi_says(probes(kinds, mpix_cuda, mpix_gpu)) is expected


@pytest.mark.parametrize("torch_cuda", [False, True])
@pytest.mark.parametrize("p", [probes(), probes(YES_KINDS, True, True), probes(NO_KINDS, False, False)])
def test_off_never_uses_it(p, torch_cuda):
    p = Probes(p.alloc_kinds, p.mpix_cuda, p.mpix_gpu, torch_cuda)
    assert decide("off", p).use is False


@pytest.mark.parametrize("p, confirmed", [
    (probes(YES_KINDS), True), (probes(mpix_cuda=True), True), (probes(mpix_gpu=True), True),
    (probes(NO_KINDS, mpix_cuda=True, mpix_gpu=False), True),  # Open MPI symbol yes beats a no
    (probes(), False), (probes(NO_KINDS), False), (probes(torch_cuda=False), False),
])
def test_on_is_used_when_mpi_confirms_or_cannot_tell(p, confirmed):
    decision = decide("on", p)
    assert decision.use is True
    assert ("confirms" if confirmed else "does not say") in decision.reason


@pytest.mark.parametrize("p", [probes(mpix_cuda=False), probes(mpix_gpu=False),
                               probes(NO_KINDS, False, False), probes(NO_KINDS, False, False, torch_cuda=False)])
def test_on_when_mpi_says_no_is_a_config_error_naming_what_the_probes_said(p):
    with pytest.raises(ConfigError) as e:
        decide("on", p)
    message = str(e.value)
    assert "cuda_aware_mpi='on'" in message and "reports no CUDA support" in message
    assert "MPIX_Query_cuda_support=" in message and "MPIX_GPU_query_support(CUDA)=" in message
    assert "'auto' or 'off'" in message


@pytest.mark.parametrize("p, use, why", [
    (probes(YES_KINDS), True, "reports CUDA support"),
    (probes(mpix_cuda=True), True, "reports CUDA support"),
    (probes(mpix_gpu=True), True, "reports CUDA support"),
    (probes(NO_KINDS, mpix_cuda=False, mpix_gpu=True), True, "reports CUDA support"),
    (probes(YES_KINDS, True, True, torch_cuda=False), False, "torch.cuda is not available"),
    (probes(NO_KINDS, False, False), False, "reports no CUDA support"),
    (probes(mpix_gpu=False), False, "reports no CUDA support"),
    (probes(), False, "does not report CUDA support"),
    (probes(NO_KINDS), False, "does not report CUDA support"),
    (probes("cuda:host"), False, "does not report CUDA support"),
])
def test_auto_needs_torch_cuda_and_a_yes(p, use, why):
    decision = decide("auto", p)
    assert decision.use is use
    assert why in decision.reason and "cuda_aware_mpi='auto'" in decision.reason


def test_reason_carries_every_probe_answer():
    reason = decide("auto", probes(NO_KINDS, None, False)).reason
    assert "mpi_memory_alloc_kinds='mpi,system'" in reason
    assert "MPIX_Query_cuda_support=absent" in reason and "MPIX_GPU_query_support(CUDA)=no" in reason


def test_real_probes_on_this_mpi_answer_without_crashing():
    """On the test machines' MPI (the CPU MPICH wheel from PyPI) every probe answers, and says no."""
    from zerompi.comm.mpi import MPIGroup, cuda_probes
    from zerompi.comm.launch import use_cuda_aware

    found = cuda_probes()
    assert {found.mpix_cuda, found.mpix_gpu} <= {None, False, True}
    assert use_cuda_aware("off") is False
    use_cuda_aware("auto")
    try:
        importlib.metadata.version("mpich")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("the expected answers below are those of the PyPI mpich wheel")
    assert "MPICH" in MPIGroup.library_version()
    assert (found.mpix_cuda, found.mpix_gpu, mpi_says(found)) == (False, False, False)
    assert found.alloc_kinds is not None and "cuda" not in found.alloc_kinds
    assert use_cuda_aware("auto") is False
    with pytest.raises(ConfigError, match="cuda_aware_mpi='on' but the MPI library reports no CUDA support"):
        use_cuda_aware("on")
