"""TRL's GRPOTrainer as ``trl/scripts/grpo.py`` (TRL 1.16) runs it: ``TrlParser`` over ``ScriptArguments``,
``GRPOConfig`` and ``ModelConfig``, ``load_dataset(--dataset_name)``, the trainer built from the model's path with a
reward function, ``train()``, ``save_model()``. It knows nothing of zerompi: ``--deepspeed CFG`` under
``python -m zerompi.deepspeed`` makes it a ZeRO run (generation by ``model.generate`` inside TRL's
``unwrap_model_for_generation``, which gathers a ZeRO-3 model); without it, one plain process is the reference.
Rank 0 also writes the logged per-step losses and gradient norms as JSON to ``--out``.

Generation samples, and TRL seeds each process apart, so no two layouts sample the same completions. A ZeRO run
with ``--record PATH`` writes, per rank, every generation batch it scored (``PATH.RANK``, one JSON line per batch:
its prompts and completion ids); a plain run with ``--replay PATH`` takes those completions through TRL's
``rollout_func`` (generation batches in order, the ranks' slices in rank order, which must be the prompts TRL
hands it), so both train on the same completions and only the arithmetic of the step differs.

``--trainer rloo`` runs TRL's RLOOTrainer the same way (it takes no ``rollout_func``: nothing to replay).

``--make DIR`` writes trl_sft.py's tiny Llama and ``DIR/grpo/train.jsonl``: 32 prompts of 6 words.
"""
import glob
import json
import os
import sys
from dataclasses import dataclass, field

from trl_sft import WORDS, train_and_write
from trl_sft import make as make_models


@dataclass
class Extra:
    out: str = field(default="", metadata={"help": "where rank 0 writes the losses"})
    record: str = field(default="", metadata={"help": "write the scored completions to RECORD.RANK"})
    replay: str = field(default="", metadata={"help": "generate nothing: take the completions REPLAY.* recorded"})
    trainer: str = field(default="grpo", metadata={"help": "grpo, or rloo (no rollout_func: neither record nor replay)"})


def make(root: str) -> None:
    import torch
    make_models(root)
    g = torch.Generator().manual_seed(2)
    os.makedirs(f"{root}/grpo", exist_ok=True)
    with open(f"{root}/grpo/train.jsonl", "w") as f:
        for row in torch.randint(0, len(WORDS), (32, 6), generator=g).tolist():
            f.write(json.dumps({"prompt": " ".join(WORDS[i] for i in row)}) + "\n")


def reward(completion_ids, **_) -> list[float]:
    """A reward of the tokens alone: varied within a prompt's group (so advantages are not all zero)."""
    return [(sum(ids) % 17) / 17 + len(set(ids)) / max(len(ids), 1) for ids in completion_ids]


def recording(path: str, rank: int):
    def recorded(prompts, completion_ids, **kwargs) -> list[float]:
        with open(f"{path}.{rank}", "a") as f:
            f.write(json.dumps({"prompts": prompts, "completion_ids": completion_ids}) + "\n")
        return reward(completion_ids)
    recorded.__name__ = "reward"
    return recorded


def replaying(path: str):
    files = sorted(glob.glob(f"{path}.*"), key=lambda p: int(p.rsplit(".", 1)[1]))
    batches = [[json.loads(line) for line in open(p)] for p in files]
    calls = iter(range(len(batches[0])))

    def rollout(prompts, trainer) -> dict:
        k = next(calls)
        said = [p for rank in batches for p in rank[k]["prompts"]]
        assert said == prompts, f"generation batch {k}: TRL hands {prompts}, the ranks scored {said}"
        completions = [c for rank in batches for c in rank[k]["completion_ids"]]
        return {"prompt_ids": trainer.processing_class(text=prompts)["input_ids"], "completion_ids": completions,
                "logprobs": [[0.0] * len(c) for c in completions]}
    return rollout


def main() -> None:
    from datasets import load_dataset
    from trl import GRPOConfig, GRPOTrainer, ModelConfig, RLOOConfig, RLOOTrainer, ScriptArguments, TrlParser
    rloo = "--trainer" in sys.argv and sys.argv[sys.argv.index("--trainer") + 1] == "rloo"
    parser = TrlParser((ScriptArguments, RLOOConfig if rloo else GRPOConfig, ModelConfig, Extra))
    script_args, training_args, model_args, extra = parser.parse_args_and_config()
    training_args.model_init_kwargs = dict(dtype=model_args.dtype)
    dataset = load_dataset(script_args.dataset_name, name=script_args.dataset_config)
    rank = int(os.environ.get("RANK", "0"))
    replay = {"rollout_func": replaying(extra.replay) if extra.replay else None} if not rloo else {}
    trainer = (RLOOTrainer if rloo else GRPOTrainer)(
        model=model_args.model_name_or_path, args=training_args,
        reward_funcs=recording(extra.record, rank) if extra.record else reward,
        train_dataset=dataset[script_args.dataset_train_split], **replay)
    train_and_write(trainer, training_args.output_dir, extra.out)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--make"]:
        make(sys.argv[2])
    else:
        main()
