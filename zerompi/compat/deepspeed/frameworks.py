"""What the frameworks that drive DeepSpeed (transformers' Trainer, Accelerate, TRL) check before they
use it, answered under the runner (runner.py), so that their scripts run unchanged.

* **The distribution.** accelerate and transformers ask ``importlib.metadata`` whether a ``deepspeed``
  package is installed, and its version, before they import it. Under the runner the alias's finder
  answers with :class:`DeepSpeedDistribution`: name ``deepspeed``, version :data:`API_VERSION` (the
  DeepSpeed release whose API and numbers zerompi follows) with ``+zerompi``, and no files. It comes
  first, so it also stands for a real DeepSpeed installed beside zerompi; outside the runner nothing
  changes.
* **The launch.** ``accelerate launch --config_file ds.yaml`` turns the yaml into ``ACCELERATE_*``
  variables and starts DeepSpeed's launcher. Under MPI the ranks are already started:
  :func:`accelerate_env` asks Accelerate's own launch code for the variables of a yaml, which the
  runner's ``--accelerate_config`` sets before the script runs.
* **The backend.** On a machine without CUDA, accelerate's ``PartialState`` finds no torch.distributed
  backend for a DeepSpeed run and takes each rank for a world of its own. Under the runner the ranks
  MPI started are the world: where accelerate finds none for a DeepSpeed run, it gets zerompi's
  backend over MPI (torch_dist.py), which ``deepspeed.comm.init_distributed`` then sets up.
"""
from __future__ import annotations

import importlib.metadata
import importlib.util
import os
from pathlib import Path

from zerompi.errors import UsageError

API_VERSION = "0.19.8"
METADATA = f"""Metadata-Version: 2.1
Name: deepspeed
Version: {API_VERSION}+zerompi
Summary: zerompi's DeepSpeed API (python -m zerompi.deepspeed)
"""


class DeepSpeedDistribution(importlib.metadata.Distribution):
    """The ``deepspeed`` distribution under the runner: its metadata, and no files."""

    def read_text(self, filename: str) -> str | None:
        return METADATA if filename in ("METADATA", "PKG-INFO") else None

    def locate_file(self, path) -> Path:
        return Path(__file__).parent / path


def find_distributions(context: importlib.metadata.DistributionFinder.Context) -> list[DeepSpeedDistribution]:
    """The finder's answer for ``importlib.metadata``: ours for the name ``deepspeed``, nothing else."""
    name = (context.name or "").replace("_", "-").lower()
    return [DeepSpeedDistribution()] if name == "deepspeed" else []


def prepare_accelerate() -> None:
    """Where accelerate is installed: a DeepSpeed run it finds no backend for gets zerompi's."""
    if importlib.util.find_spec("accelerate") is None:
        return
    import accelerate.state as state
    from zerompi.compat.deepspeed.torch_dist import BACKEND
    original = state.PartialState._prepare_backend
    if getattr(original, "zerompi", False):
        return

    def prepare_backend(self, cpu: bool = False, sagemaker_dp: bool = False, backend: str | None = None):
        found, kind = original(self, cpu, sagemaker_dp, backend)
        if found is None and os.environ.get("ACCELERATE_USE_DEEPSPEED", "").lower() == "true":
            found = BACKEND
        return found, kind
    prepare_backend.zerompi = True
    state.PartialState._prepare_backend = prepare_backend


def accelerate_env(config_file: str) -> dict[str, str]:
    """The ``ACCELERATE_*`` variables ``accelerate launch --config_file config_file`` gives a DeepSpeed run's
    processes, from Accelerate's own parser and DeepSpeed branch (accelerate 1.16); the launcher's own
    variables (ranks, addresses) are left out: MPI's ranks have theirs. A yaml whose ``distributed_type``
    is not DEEPSPEED is refused."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_deepspeed_cmd_env

    if not os.path.isfile(config_file):
        raise UsageError(f"--accelerate_config {config_file}: no such file")
    args = launch_command_parser().parse_args(["--config_file", config_file, "script.py"])
    args, defaults, mixed_precision_from_config = _validate_launch_command(args)
    if not args.use_deepspeed:
        raise UsageError(f"--accelerate_config {config_file}: its distributed_type is not DEEPSPEED; allowed: "
                         "a DeepSpeed configuration (accelerate config, 'DeepSpeed' as the distributed type)")
    fields = list(defaults.deepspeed_config) if defaults is not None else []  # as accelerate's launch_command
    if mixed_precision_from_config:
        fields.append("mixed_precision")
    args.deepspeed_fields_from_accelerate_config = ",".join(fields)
    _, env = prepare_deepspeed_cmd_env(args)
    return {k: v for k, v in env.items() if k.startswith("ACCELERATE_")}


LIGHTNING_CUDA_ONLY = "The DeepSpeed strategy is only supported on CUDA GPUs"
LIGHTNING_HINT = ("zerompi: Lightning's DeepSpeed strategies need CUDA. Under MPI, on CPUs or GPUs, use zerompi's own "
                  "Lightning strategy instead: `import zerompi.compat.lightning`, then "
                  "Trainer(strategy=\"zerompi_stage_3\") "
                  "(or \"zerompi_stage_0\"..\"_2\"), or Trainer(strategy=ZeroMPIStrategy(ZeroConfig(stage=3, ...))); "
                  "docs/frameworks.md says which DeepSpeed settings map to which ZeroConfig keys.")


def add_hint(error: BaseException) -> None:
    """Name zerompi's way where a framework refuses what the runner cannot give it (the note is printed with
    the traceback). Lightning's ``strategy="deepspeed_stage_3"`` on a CPU stops in its own check: the note
    names ZeroMPIStrategy."""
    if isinstance(error, RuntimeError) and str(error).startswith(LIGHTNING_CUDA_ONLY):
        error.add_note(LIGHTNING_HINT)
