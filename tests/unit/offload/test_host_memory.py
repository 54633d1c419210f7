"""HostMemory: an engine's freed host memory goes back to the OS when its config asks for it, and
always under NVMe offload. glibc's setting is process-wide, so each case runs in a fresh interpreter."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]

PROBE = """
import json, zerompi
from zerompi.blockio.memory import _libc
from zerompi.offload import HostMemory
if not hasattr(_libc(), "mallopt"):
    print(json.dumps(None))
else:
    cfg = zerompi.ZeroConfig(stage=3, optimizer="adamw", lr=1e-2, device="cpu", return_freed_memory={flag},
                             offload_optimizer="{tier}", nvme_path="/tmp" if "{tier}" == "nvme" else None)
    print(json.dumps(HostMemory(cfg.offload).returns_freed))
"""


@pytest.mark.parametrize("flag,tier,expect", [(False, "none", False), (True, "none", True), (False, "cpu", False),
                                               (False, "nvme", True)])
def test_freed_memory_is_returned_when_asked_or_swapping(flag, tier, expect):
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_MMAP_THRESHOLD_"}  # it would win
    proc = subprocess.run([sys.executable, "-c", PROBE.format(flag=flag, tier=tier)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    if got is None:
        pytest.skip("not glibc: no mallopt")
    assert got is expect
