"""LoRA fine-tuning of a Llama-style base with peft, ZeRO stage 3 over MPI (frozen base sharded).

    mpiexec -n 2 python -m mpi4py jobs/finetune_lora.py \
        [--config jobs/configs/lora.toml] [--steps N] [--out DIR] [--stage S] [--save-every N] [--resume]
        [--reproducible [--micro-batches G]]

The base is built on the meta device, so no rank ever holds all of it: ``initialize``
materialises it one gather unit at a time and, at stage 3, keeps one shard of each frozen
weight per rank (offload_params="cpu"|"nvme" moves those shards off the device). Each module's
values come from ``[train] base_weights`` (a Hugging Face safetensors file, read one module at a
time) or, without it, from the model's own initialisation: this job "pretrains" nothing, so the
base is random and fine-tuning teaches the adapters the byte statistics of the Python standard
library's source. ``peft.get_peft_model`` then adds LoRA adapters (``[model.lora]``) and freezes
the rest. Checkpoints (``--save-every``, SIGUSR1/SIGTERM, the end) hold the adapters and their
optimizer state only (``include_frozen=False``): a resumed job rebuilds the same base. At the
end rank 0 writes ``{out_dir}/adapter``, a PEFT adapter directory that
``PeftModel.from_pretrained(base, out_dir/adapter)`` loads.
"""
from __future__ import annotations

import logging
import math
from pathlib import Path

import torch

import zerompi
from common import (LOOP_DEFAULTS, Preemption, apply_flags, corpus_val_loss, job_main, load_config, micro_batches,
                    micro_batches_per_step, parse_args, setup_logging, start_run, train_loop)
from zerompi.checkpoint import load_full_state_dict
from zerompi.models.corpus import ByteCorpus

log = logging.getLogger("finetune_lora")

TRAIN_DEFAULTS = dict(LOOP_DEFAULTS, micro_batch=8, eval_batches=4, out_dir="out/finetune-lora",
                      base_weights="", data_max_bytes=0)


def build(model_doc: dict):
    """The PEFT model: a LlamaForCausalLM of ``[model.base]`` on the meta device plus LoRA of ``[model.lora]``."""
    import transformers
    from peft import LoraConfig, get_peft_model
    base_cfg = transformers.LlamaConfig(**model_doc.get("base", {}))
    with torch.device("meta"):
        base = transformers.LlamaForCausalLM(base_cfg)
    # Buffers are replicated whole and must be real: the rotary frequencies are recomputed on the CPU.
    for module in base.modules():
        if any(b.is_meta for b in module.buffers(recurse=False)):
            module.to_empty(device="cpu", recurse=False)
            base._init_weights(module)
    lora = LoraConfig(task_type="CAUSAL_LM", **model_doc.get("lora", {}))
    return get_peft_model(base, lora), base


def base_name(module_name: str, param: str) -> str:
    """The base model's name of a PEFT model's parameter, as the base's own file names it
    (base_model.model.X.base_layer.weight -> X.weight)."""
    prefix = module_name.removeprefix("base_model.model.").replace(".base_layer", "")
    return f"{prefix}.{param}" if prefix else param


def init_adapter(name: str, module: torch.nn.Module) -> bool:
    """LoRA's A as peft does (Kaiming-uniform) and B as zeros, so training starts from the base
    itself; False (nothing done) for any other module."""
    if ".lora_A." in name:
        torch.nn.init.kaiming_uniform_(module.weight, a=math.sqrt(5))
    elif ".lora_B." in name:
        torch.nn.init.zeros_(module.weight)
    else:
        return False
    return True


def param_init(model, base, weights: str):
    """Initialise one module's own parameters (what ``initialize`` asks, one module at a time):
    the adapters (init_adapter); base modules from ``weights`` (Hugging Face names) or the model's
    own initialisation."""
    names = {id(m): n for n, m in model.named_modules()}
    reader = None
    if weights:
        from safetensors import safe_open
        reader = safe_open(weights, framework="pt")

    def init(module: torch.nn.Module) -> None:
        name = names[id(module)]
        if init_adapter(name, module):
            return
        if reader is None:
            base._init_weights(module)
            return
        for pname, p in module.named_parameters(recurse=False):
            p.copy_(reader.get_tensor(base_name(name, pname)))
    return init


def loss_of(engine, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    logits = engine(input_ids=x).logits
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1))


def write_adapter(model, ckpt_dir: Path, out: Path) -> None:
    """Rank 0: the adapters of the final checkpoint as a PEFT adapter directory (adapters only)."""
    from peft import get_peft_model_state_dict
    saved = dict(load_full_state_dict(ckpt_dir))  # the trainable parameters alone: a few MiB
    model.save_pretrained(out, state_dict=get_peft_model_state_dict(model, state_dict=saved))


def main(argv: list[str] | None = None) -> None:
    args = parse_args(__doc__, "jobs/configs/lora.toml", argv, reproducible=True)
    preemption = Preemption()
    setup_logging()
    model_doc, train, zero_doc = load_config(args.config, TRAIN_DEFAULTS)
    cfg = apply_flags(args, train, zero_doc)
    torch.manual_seed(train["seed"])
    model, base = build(model_doc)
    engine = zerompi.initialize(model, cfg, param_init=param_init(model, base, train["base_weights"]))
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    log.info("base %.2fM frozen, LoRA %.3fM trainable, %s", frozen / 1e6, trainable / 1e6, cfg)
    data = ByteCorpus(max_bytes=train["data_max_bytes"] or None)
    T = model_doc.get("block_size", 128)
    run = start_run(engine, train, {"model": model_doc}, args.resume, "tokens",
                    micro_batches_per_step(engine) * train["micro_batch"] * T, preemption, include_frozen=False)
    if run.rank0:
        print(f"LoRA on a {frozen / 1e6:.2f}M-parameter frozen base: {trainable:,} trainable parameters, "
              f"stage {cfg.stage}, {engine.world_size} ranks; model state {engine.stats.model_state_bytes:,} "
              "bytes per rank", flush=True)

    def step_fn(step: int) -> dict:
        step_loss, gens = 0.0, micro_batches(engine, train["seed"], step)
        for gen in gens:
            x, y = data.get_batch("train", train["micro_batch"], T, gen)
            loss = loss_of(engine, x, y)
            engine.backward(loss)
            step_loss += loss.item() / len(gens)
        engine.step()
        return {"loss": step_loss}

    result = train_loop(run, step_fn, lambda: corpus_val_loss(engine, data, train, T, loss_of))
    if result.completed and result.metrics:
        if train["save_every"] <= 0:  # else the loop saved the last step already
            engine.save_checkpoint(run.ckpt_dir, client_state={"next_step": train["steps"] + 1},
                                   include_frozen=False)
        if run.rank0:
            write_adapter(model, run.ckpt_dir, run.out_dir / "adapter")
            print(f"adapters in {run.out_dir / 'adapter'} (PeftModel.from_pretrained) and {run.ckpt_dir}", flush=True)
    engine.close()


if __name__ == "__main__":
    job_main(main)
