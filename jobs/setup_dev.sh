#!/usr/bin/env bash
# The developers' and CI's set-up (.ci/run uses it): jobs/setup.sh with every extra the test suite
# exercises (test: pytest, hypothesis, transformers, peft, accelerate, DeepSpeed, TRL, datasets,
# Lightning; nvme; examples), then DeepSpeed's CPU ops built once. About 1.9 GB in .venv and several
# minutes; running zerompi needs only jobs/setup.sh. Takes jobs/setup.sh's variables;
# ZEROMPI_EXTRAS defaults to mpich,test,nvme,examples ("test,nvme,examples" with a site MPI).
set -euo pipefail
cd "$(dirname "$0")/.."
ZEROMPI_EXTRAS=${ZEROMPI_EXTRAS-mpich,test,nvme,examples} bash jobs/setup.sh
VENV=${ZEROMPI_VENV:-.venv}
# DeepSpeed (a test extra, for the comparisons with it): build the CPU ops its runs load, once, into
# torch's extension cache, so that the tests do not spend minutes compiling them.
if DS_ACCELERATOR=cpu "$VENV/bin/python" -c "import deepspeed" >/dev/null 2>&1; then
    # A build killed midway leaves its lock file behind, and the next build waits on it forever:
    # a lock untouched for 10 minutes belongs to no running build.
    find "${TORCH_EXTENSIONS_DIR:-$HOME/.cache/torch_extensions}" -name lock -mmin +10 -delete 2>/dev/null || true
    DS_ACCELERATOR=cpu "$VENV/bin/python" -c "
from deepspeed.accelerator import get_accelerator
for name in ('FusedAdamBuilder', 'ShareMemCommBuilder'):
    get_accelerator().create_op_builder(name).load()
print('DeepSpeed CPU ops built: fused_adam, deepspeed_shm_comm')" 2>&1 | tail -1
fi
