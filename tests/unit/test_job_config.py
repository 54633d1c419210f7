"""A job's config file with a wrong key or kind of value: one short message on stderr naming the file and
the key (with what is allowed), exit status 2, no traceback (jobs/common.py's job_main and load_config,
zerompi/models/gpt.py's gpt_config_from_dict). The job runs as its own process, as a user starts it.

Breaks: drop the kind check of [train] or [model] (then a TypeError traceback), or job_main's catch."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

CASES = {
    "model_kind": ('[model]\nn_embd = "64"\n', "GPT config key n_embd: expected a whole number, got '64'"),
    "train_kind": ('[train]\nsteps = "10"\n', "train.steps: expected a whole number, got '10'"),
    "train_typo": ("[train]\nstepz = 3\n", "unknown key(s) train.stepz (did you mean train.steps?)"),
    "zero_typo": ("[zero]\nstge = 3\n", "stge (did you mean stage?)"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_wrong_config_is_one_line_naming_file_and_key(tmp_path, case):
    text, said = CASES[case]
    config = tmp_path / "bad.toml"
    config.write_text(text)
    proc = subprocess.run([sys.executable, "jobs/train_gpt.py", "--config", str(config), "--steps", "1",
                           "--out", str(tmp_path / "out")], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1", "PYTHONHASHSEED": "0"})
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert lines[0].startswith(f"train_gpt.py: configuration error in {config} or its flags: "), lines[0]
    assert said in lines[0], lines[0]
