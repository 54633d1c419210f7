"""A transformers Trainer script as users write them (``HfArgumentParser(TrainingArguments)``, a model, a
dataset, ``trainer.train()``, ``trainer.save_model()``), for tests/mpi/test_hf_trainer.py. It knows
nothing of zerompi: ``--deepspeed CFG`` under ``python -m zerompi.deepspeed`` makes it a ZeRO run;
without it, one plain process is the reference. A tiny GPT-2 from a fixed seed (or ``--model_dir``'s
pretrained model), 64 fixed token rows.
Rank 0 writes the logged per-step losses and gradient norms as JSON to ``--out``. ``--make DIR`` writes the
pretrained models instead.
"""
import json
import sys
from dataclasses import dataclass, field

import torch
from transformers import (AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel, HfArgumentParser, Trainer,
                          TrainerCallback, TrainingArguments)


@dataclass
class Extra:
    out: str = field(metadata={"help": "where rank 0 writes the losses"})
    model_dir: str = field(default="", metadata={"help": "from_pretrained(model_dir) instead of a GPT-2 built here"})


def tiny_gpt2() -> GPT2Config:
    return GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=128, n_positions=32, resid_pdrop=0.0,
                      embd_pdrop=0.0, attn_pdrop=0.0)  # no random draws: summation order alone differs


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int = 64, length: int = 32, vocab: int = 128):
        self.x = torch.randint(0, vocab, (n, length), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.x[i], "labels": self.x[i]}


class CountSteps(TrainerCallback):
    """The optimizer steps this process ran (a resumed run starts past the checkpoint's)."""

    def __init__(self):
        self.steps = 0

    def on_step_end(self, args, state, control, **kwargs):
        self.steps += 1


def make(root: str) -> None:
    """``--make DIR``: the pretrained models the ZeRO-3 cases load, with no download (DIR/gpt2, DIR/llama)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    GPT2LMHeadModel(tiny_gpt2()).save_pretrained(f"{root}/gpt2")
    LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                                 num_key_value_heads=2, vocab_size=128, max_position_embeddings=64)
                     ).save_pretrained(f"{root}/llama")


def main() -> None:
    args, extra = HfArgumentParser((TrainingArguments, Extra)).parse_args_into_dataclasses()
    torch.manual_seed(0)
    if extra.model_dir:  # under ZeRO-3 transformers builds it in deepspeed.zero.Init and loads it into that
        model = AutoModelForCausalLM.from_pretrained(extra.model_dir)
    else:
        model = GPT2LMHeadModel(tiny_gpt2())
    counted = CountSteps()
    trainer = Trainer(model=model, args=args, train_dataset=Tokens(), callbacks=[counted])
    trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)
    trainer.save_model()
    if trainer.is_world_process_zero():
        logged = [h for h in trainer.state.log_history if "loss" in h]
        with open(extra.out, "w") as f:
            json.dump(dict(losses=[h["loss"] for h in logged], grad_norms=[h["grad_norm"] for h in logged],
                           world=trainer.args.world_size, steps_run=counted.steps), f)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--make"]:
        make(sys.argv[2])
    else:
        main()
