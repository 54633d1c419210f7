"""The fuzz tests of checkpoints and configs, run by pytest with ZEROMPI_FUZZ_REPORT: their counts."""
from __future__ import annotations

import json
import sys
from pathlib import Path

from harness import launch


def fuzz(tmp: Path, log) -> dict:
    report = tmp / "fuzz.json"
    junit = tmp / "fuzz.xml"
    env = launch.job_env(mpich_yield=True, extra={"ZEROMPI_FUZZ_REPORT": str(report)})
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}",
           "tests/unit/checkpoint/test_fuzz_checkpoint.py", "tests/unit/config/test_fuzz_config.py"]
    job = launch.run(cmd, env, timeout=900)
    summary = job.output.strip().splitlines()[-1] if job.output.strip() else ""
    log(f"fuzz tests: {summary} ({job.wall_s:.0f} s)")
    out = json.loads(report.read_text()) if report.exists() else {}
    out["pytest"] = {"returncode": job.code, "summary": summary, "seconds": job.wall_s}
    return out
