"""TRL's preference trainers as ``trl/scripts/dpo.py`` and ``kto.py`` (TRL 1.16) write them: ``TrlParser`` over
``ScriptArguments``, the trainer's config and ``ModelConfig``, ``load_dataset(--dataset_name)``, the trainer built
from the model's path (its reference model is a second copy, which TRL's ``prepare_deepspeed`` wraps at ZeRO-3),
``train()``, ``save_model()``. ``--trainer dpo|kto`` picks one. It knows nothing of zerompi: ``--deepspeed CFG``
under ``python -m zerompi.deepspeed`` makes it a ZeRO run; without it, one plain process is the reference.
Rank 0 also writes the logged per-step losses and gradient norms as JSON to ``--out``.

``--make DIR`` writes what it trains on, with no download: trl_sft.py's tiny Llama and GPT-2, and two datasets
of 64 rows in TRL's standard (not conversational) form, every row of the same length (no batch is padded):
``DIR/dpo/train.jsonl`` (prompt of 6 words, chosen and rejected of 4) and ``DIR/kto/train.jsonl`` (prompt of 6,
completion of 4, desirable on even rows).
"""
import json
import os
import sys
from dataclasses import dataclass, field

from trl_sft import WORDS, run_script
from trl_sft import make as make_models


@dataclass
class Extra:
    out: str = field(default="", metadata={"help": "where rank 0 writes the losses"})
    trainer: str = field(default="dpo", metadata={"help": "dpo or kto"})


def make(root: str) -> None:
    import torch
    make_models(root)
    g = torch.Generator().manual_seed(1)
    text = lambda n: " ".join(WORDS[i] for i in torch.randint(0, len(WORDS), (n,), generator=g).tolist())  # noqa: E731
    for name in ("dpo", "kto"):
        os.makedirs(f"{root}/{name}", exist_ok=True)
    with open(f"{root}/dpo/train.jsonl", "w") as dpo, open(f"{root}/kto/train.jsonl", "w") as kto:
        for i in range(64):
            dpo.write(json.dumps({"prompt": text(6), "chosen": " " + text(4), "rejected": " " + text(4)}) + "\n")
            kto.write(json.dumps({"prompt": text(6), "completion": " " + text(4), "label": i % 2 == 0}) + "\n")


def main() -> None:
    from trl import DPOConfig, DPOTrainer, KTOConfig, KTOTrainer, ModelConfig, ScriptArguments, TrlParser
    which = sys.argv[sys.argv.index("--trainer") + 1] if "--trainer" in sys.argv else "dpo"
    config, trainer_class = {"dpo": (DPOConfig, DPOTrainer), "kto": (KTOConfig, KTOTrainer)}[which]
    parser = TrlParser((ScriptArguments, config, ModelConfig, Extra))
    script_args, training_args, model_args, extra = parser.parse_args_and_config()
    run_script(trainer_class, script_args, training_args, model_args, extra.out)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--make"]:
        make(sys.argv[2])
    else:
        main()
