"""TRL's supervised fine-tuning script as ``trl/scripts/sft.py`` (TRL 1.16) writes it: ``TrlParser`` over
``ScriptArguments, SFTConfig, ModelConfig, DatasetMixtureConfig``, ``load_dataset(--dataset_name)``,
``SFTTrainer(model=<path>, ...)``, ``train()``, ``save_model()``. It knows nothing of zerompi: ``--deepspeed CFG``
under ``python -m zerompi.deepspeed`` makes it a ZeRO run; without it, one plain process is the reference.
Rank 0 also writes the logged per-step losses and gradient norms as JSON to ``--out``.

``--make DIR`` writes what it trains on, with no download: a tiny GPT-2 and a tiny Llama (``DIR/gpt2``,
``DIR/llama``, each with a word-level tokenizer) and a text dataset (``DIR/data/train.jsonl``, 64 rows of 15
words: every row is 16 tokens with the EOS that SFTTrainer appends, so no batch is padded).
"""
import json
import sys
from dataclasses import dataclass, field

VOCAB = 128
WORDS = [f"w{i}" for i in range(VOCAB - 3)]
SPECIAL = ["<unk>", "<pad>", "<eos>"]


@dataclass
class Extra:
    out: str = field(default="", metadata={"help": "where rank 0 writes the losses"})


def tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(SPECIAL + WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>", eos_token="<eos>")


def make(root: str) -> None:
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM
    tok = tokenizer()
    torch.manual_seed(0)
    ids = dict(bos_token_id=tok.eos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    models = {"gpt2": GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=VOCAB, n_positions=32,
                                                 resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **ids)),
              "llama": LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                                    num_attention_heads=2, num_key_value_heads=2, vocab_size=VOCAB,
                                                    max_position_embeddings=32, **ids))}
    for name, model in models.items():
        model.save_pretrained(f"{root}/{name}")
        tok.save_pretrained(f"{root}/{name}")
    g = torch.Generator().manual_seed(0)
    import os
    os.makedirs(f"{root}/data", exist_ok=True)
    with open(f"{root}/data/train.jsonl", "w") as f:
        for row in torch.randint(0, len(WORDS), (64, 15), generator=g).tolist():
            f.write(json.dumps({"text": " ".join(WORDS[i] for i in row)}) + "\n")


def main() -> None:
    from trl import DatasetMixtureConfig, ModelConfig, ScriptArguments, SFTConfig, SFTTrainer, TrlParser
    parser = TrlParser((ScriptArguments, SFTConfig, ModelConfig, DatasetMixtureConfig, Extra))
    script_args, training_args, model_args, _, extra = parser.parse_args_and_config()
    run_script(SFTTrainer, script_args, training_args, model_args, extra.out)


def run_script(trainer_class, script_args, training_args, model_args, out: str) -> None:
    """What TRL's scripts do once parsed: the trainer from the model's path and the dataset, ``train()``,
    ``save_model()``; then rank 0 writes the logged per-step losses and gradient norms to ``out``."""
    from datasets import load_dataset
    training_args.model_init_kwargs = dict(revision=model_args.model_revision, dtype=model_args.dtype,
                                           attn_implementation=model_args.attn_implementation)
    dataset = load_dataset(script_args.dataset_name, name=script_args.dataset_config)
    trainer = trainer_class(model=model_args.model_name_or_path, args=training_args,
                            train_dataset=dataset[script_args.dataset_train_split])
    train_and_write(trainer, training_args.output_dir, out)


def train_and_write(trainer, output_dir: str, out: str) -> None:
    """``train()``, ``save_model()``; then rank 0 writes the logged per-step losses and gradient norms to ``out``."""
    trainer.train()
    trainer.save_model(output_dir)
    if trainer.is_world_process_zero() and out:
        logged = [h for h in trainer.state.log_history if "loss" in h]
        with open(out, "w") as f:
            json.dump(dict(losses=[h["loss"] for h in logged], grad_norms=[h["grad_norm"] for h in logged],
                           world=trainer.args.world_size), f)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--make"]:
        make(sys.argv[2])
    else:
        main()
