"""``return_freed_memory``: glibc's mmap threshold fixed at 1 MiB, so freed blocks leave the process.

Observed through glibc's own counter of mmapped blocks (``mallinfo2().hblks``): after a 16 MiB block
is freed, glibc's default raises its threshold and serves a 2 MiB block from the heap; with the
threshold fixed, that block is mapped (and unmapped on free). Each case runs in a fresh interpreter,
since the setting is process-wide.
"""
from __future__ import annotations

import ctypes.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]

PROBE = """
import ctypes, ctypes.util, json, torch
from torch import nn
import zerompi

class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                               "fsmblks", "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL(ctypes.util.find_library("c"))
libc.mallinfo2.restype = MallInfo2
cfg = zerompi.ZeroConfig(stage={stage}, optimizer="adamw", lr=1e-2, cpu_threads=1, device="cpu",
                         abort_on_exception=False, return_freed_memory={flag})
engine = zerompi.initialize(nn.Linear(4, 2), cfg)
big = torch.empty(16 << 18)  # 16 MiB, mapped whatever the threshold; freeing it raises glibc's default
del big
before = libc.mallinfo2().hblks
block = torch.empty(2 << 18)  # 2 MiB
mapped = libc.mallinfo2().hblks - before
engine.close()
print(json.dumps({{"mapped": mapped}}))
"""


def _mapped(stage: int, flag: bool, env: dict | None = None) -> int:
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(PROBE.format(stage=stage, flag=flag))], cwd=REPO,
                          capture_output=True, text=True, timeout=120, env={**os.environ, **(env or {})})
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])["mapped"]


pytestmark = pytest.mark.skipif(
    not hasattr(ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6"), "mallinfo2"),
    reason="not glibc 2.33+: no mallinfo2 to observe the threshold with")


@pytest.mark.parametrize("stage", [0, 3])
def test_freed_blocks_leave_the_process_only_when_asked(stage):
    assert _mapped(stage, False) == 0  # glibc's default: the 2 MiB block reuses the heap
    assert _mapped(stage, True) == 1   # fixed at 1 MiB: mapped, so unmapped when freed


def test_an_environment_threshold_wins():
    assert _mapped(3, True, {"MALLOC_MMAP_THRESHOLD_": str(32 << 20)}) == 0


TRIM = """
import json, torch
from zerompi.blockio.memory import trim_heap

def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096

big = torch.empty(16 << 18)  # freeing a 16 MiB block raises glibc's threshold: 4 MiB blocks then come from the heap
del big
blocks, pins = [], []
for _ in range(32):
    blocks.append(torch.ones(1 << 20))  # 4 MiB, touched
    pins.append(torch.ones(1 << 16))    # 256 KiB: keeps each hole inside the heap, where only a trim reaches
del blocks
before = rss()
ok = trim_heap()
print(json.dumps({"ok": ok, "freed": before - rss()}))
"""


def test_trim_heap_returns_the_holes_freed_tensors_leave():
    """What the optimizer calls after moving its state to aligned copies, and the build after its shards."""
    proc = subprocess.run([sys.executable, "-c", TRIM], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    assert res["ok"] and res["freed"] > 64 << 20, res  # of the 128 MiB freed
