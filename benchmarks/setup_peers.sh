#!/usr/bin/env bash
# Set up benchmarks/.venv-peers: a venv of its own for the peer frameworks that
# benchmarks/bench_peers.py runs beside zerompi (torch DDP / ZeroRedundancyOptimizer /
# FSDP2 and DeepSpeed ZeRO-1/2/3, all on CPU with gloo). DeepSpeed is never a
# dependency of zerompi: it lives only in this venv. Safe to re-run.
#
#   PEERS_TORCH      torch requirement, installed first (default torch==2.13.0; a bare
#                    "torch" would pull a multi-GB CUDA build)
#   PEERS_DEEPSPEED  DeepSpeed requirement (default deepspeed==0.19.8, the version measured)
#   PYTHON           interpreter that creates the venv (default python3)
#
# zerompi itself is installed editable, so the same venv runs every row; the zerompi
# rows use only zerompi's own dependencies (mpi4py, mpich, torch, numpy, h5py).
set -euo pipefail
cd "$(dirname "$0")/.."
# DeepSpeed's NVMe offload (ZeRO-Infinity; the LoRA ladder's deepspeed-zero3+nvme) JIT-builds its async
# I/O op against libaio: Debian's libaio-dev, installed here when missing and run as root.
if ! dpkg -s libaio-dev >/dev/null 2>&1; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        apt-get install -y --no-install-recommends libaio-dev >/dev/null \
            || { apt-get update -qq && apt-get install -y --no-install-recommends libaio-dev >/dev/null; }
    else
        echo "warning: libaio-dev missing; DeepSpeed's NVMe offload rows need it (apt-get install libaio-dev)" >&2
    fi
fi
PYTHON=${PYTHON:-python3}
VENV=benchmarks/.venv-peers
if [ ! -x "$VENV/bin/python" ]; then
    "$PYTHON" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip install --quiet --disable-pip-version-check)
"${PIP[@]}" "${PEERS_TORCH:-torch==2.13.0}"
# DeepSpeed compiles a small CPU op (cpu_adam / shared-memory comm) at start: g++ and ninja.
"${PIP[@]}" "${PEERS_DEEPSPEED:-deepspeed==0.19.8}" ninja
"${PIP[@]}" mpi4py mpich matplotlib
# The LoRA rows (bench_capacity.py --lora, bench_lora_steps.py): Hugging Face Llama + PEFT, as
# zerompi's test extra pins them; torch is already there, so they add no other torch.
"${PIP[@]}" "transformers>=4.46" "peft>=0.13"
# the nvme extra: zlib-ng's CRC-32, as the test venv has it (jobs/setup.sh), so checkpoint rows match
"${PIP[@]}" -e ".[nvme]"
command -v g++ >/dev/null || echo "warning: g++ not found; DeepSpeed rows need it (apt-get install g++)" >&2
# Build DeepSpeed's async I/O op now rather than inside a measured trial (12 C++ files, minutes on
# 2 cores), where the trials load it: the folder lora_worker.py names (TORCH_EXTENSIONS_DIR, in the
# venv), with the venv's ninja first on PATH as in bench_capacity.py's trials. A build made by one
# ninja version, or with other include paths, is rebuilt by the next load.
if dpkg -s libaio-dev >/dev/null 2>&1; then
    PATH="$PWD/$VENV/bin:$PATH" TORCH_EXTENSIONS_DIR="$PWD/$VENV/torch-extensions" DS_ACCELERATOR=cpu \
        "$PWD/$VENV/bin/python" -c "from deepspeed.ops.op_builder import AsyncIOBuilder as B; B().load(verbose=False)" \
        >/dev/null
fi
DS_ACCELERATOR=cpu "$VENV/bin/python" - <<'EOF'
import torch, mpi4py.MPI as M, deepspeed, matplotlib, transformers, peft, zerompi
print("peers venv: torch", torch.__version__, "| deepspeed", deepspeed.__version__,
      "| transformers", transformers.__version__, "| peft", peft.__version__,
      "| matplotlib", matplotlib.__version__, "| zerompi", zerompi.__version__, "|",
      M.Get_library_version().splitlines()[0].strip())
EOF
