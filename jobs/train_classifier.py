"""A BERT-style encoder telling which stdlib module a 256-byte source snippet comes from.

    mpiexec -n 2 python -m mpi4py jobs/train_classifier.py [--config jobs/configs/classifier.toml] [--stage 0-3]

The text is made locally: the sources of k standard-library modules (``[train]
modules``, read from ``sysconfig.get_paths()["stdlib"]`` like the GPT's corpus),
each split into a training part and a held-out last test_fraction. A snippet is
256 consecutive bytes; its label is the module. The model is a byte-level
encoder: token and position embeddings, a [CLS] token in front, pre-norm
transformer encoder layers, and a classification head on [CLS].

Two phases, one step count: steps 1..mlm_steps are a masked-language-model
warm-up (15% of the bytes replaced by [MASK], predicted back) on the same
snippets; the rest fine-tunes the classifier, with the embeddings frozen when
freeze_embeddings is set (frozen parameters stay replicated on every rank). Each
phase has its own engine and checkpoint directory (checkpoints/mlm and
checkpoints/finetune), so --resume continues in whichever phase the run stopped.
"""
from __future__ import annotations

import sysconfig
from pathlib import Path

import torch
from torch import nn

import zerompi
from common import (EVAL_STREAM, LATEST, LOOP_DEFAULTS, Preemption, apply_flags, generator, job_main, load_config,
                    parse_args, setup_logging, start_run, test_metrics, train_loop)
from zerompi.errors import ConfigError

TRAIN_DEFAULTS = dict(LOOP_DEFAULTS, modules=["argparse", "subprocess", "tarfile", "typing"], snippet=256,
                      micro_batch=16, test_fraction=0.2, eval_per_module=64, mlm_steps=0, mlm_lr=1e-3,
                      mask_fraction=0.15, freeze_embeddings=False, out_dir="out/classifier")
MODEL_DEFAULTS = dict(d_model=64, n_layer=2, n_head=4, d_ff=256, dropout=0.1)
CLS, MASK = 256, 257  # token ids after the 256 byte values


class Encoder(nn.Module):
    """Byte embeddings + positions, [CLS] first, transformer encoder; two heads: classes and masked bytes."""

    def __init__(self, n_classes: int, snippet: int, d_model: int, n_layer: int, n_head: int, d_ff: int,
                 dropout: float):
        super().__init__()
        self.tok = nn.Embedding(258, d_model)
        self.pos = nn.Embedding(snippet + 1, d_model)
        layer = nn.TransformerEncoderLayer(d_model, n_head, d_ff, dropout, batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, n_layer, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d_model)
        self.classify = nn.Linear(d_model, n_classes)
        self.unmask = nn.Linear(d_model, 256)

    def embeddings(self) -> list[nn.Parameter]:
        return [self.tok.weight, self.pos.weight]

    def forward(self, x: torch.Tensor, mlm: bool = False) -> torch.Tensor:
        x = torch.cat([torch.full_like(x[:, :1], CLS), x], dim=1)
        h = self.norm(self.encoder(self.tok(x) + self.pos.weight[:x.shape[1]]))
        return self.unmask(h[:, 1:]) if mlm else self.classify(h[:, 0])


class Snippets:
    """Each module's bytes, split into train and test parts; snippets drawn by a given generator."""

    def __init__(self, modules: list[str], snippet: int, test_fraction: float):
        root = Path(sysconfig.get_paths()["stdlib"])
        self.snippet = snippet
        self.train, self.test = [], []
        for name in modules:
            data = torch.frombuffer(bytearray((root / f"{name}.py").read_bytes()), dtype=torch.uint8).long()
            cut = int(len(data) * (1 - test_fraction))
            self.train.append(data[:cut])
            self.test.append(data[cut:])

    def batch(self, n: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """n training snippets of uniformly drawn modules, and their labels."""
        labels = torch.randint(len(self.train), (n,), generator=g)
        rows = []
        for c in labels.tolist():
            start = int(torch.randint(len(self.train[c]) - self.snippet, (), generator=g))
            rows.append(self.train[c][start:start + self.snippet])
        return torch.stack(rows), labels

    def test_set(self, per_module: int) -> tuple[torch.Tensor, torch.Tensor]:
        """per_module evenly spaced snippets of each module's test part (they overlap when it is short)."""
        rows, labels = [], []
        for c, data in enumerate(self.test):
            for start in torch.linspace(0, len(data) - self.snippet, per_module).long().tolist():
                rows.append(data[start:start + self.snippet])
                labels.append(c)
        return torch.stack(rows), torch.tensor(labels)


def mask(x: torch.Tensor, fraction: float, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """x with ``fraction`` of its bytes replaced by [MASK], and the targets (-100: not masked)."""
    chosen = torch.rand(x.shape, generator=g) < fraction
    return x.masked_fill(chosen, MASK), x.masked_fill(~chosen, -100)


def losses(engine, x: torch.Tensor, y: torch.Tensor, mlm: bool, fraction: float, g: torch.Generator):
    """(mean loss, correct predictions or None) of one batch."""
    if mlm:
        inputs, targets = mask(x, fraction, g)
        logits = engine(inputs, mlm=True)
        return nn.functional.cross_entropy(logits.reshape(-1, 256), targets.reshape(-1)), None
    logits = engine(x)
    return nn.functional.cross_entropy(logits, y), int((logits.argmax(1) == y).sum())


def build(model: Encoder, train: dict, cfg: zerompi.ZeroConfig, mlm: bool):
    """The engine of one phase; fine-tuning freezes the embeddings first if asked."""
    for p in model.embeddings():
        p.requires_grad_(mlm or not train["freeze_embeddings"])
    if mlm:  # the warm-up has its own learning rate and schedule length
        cfg = cfg.replace(lr=train["mlm_lr"], total_steps=train["mlm_steps"],
                          warmup_steps=min(cfg.warmup_steps, train["mlm_steps"]))
    return zerompi.initialize(model, cfg)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(__doc__, "jobs/configs/classifier.toml", argv)
    preemption = Preemption()
    rank0 = setup_logging()
    model_doc, train, zero_doc = load_config(args.config, TRAIN_DEFAULTS)
    cfg = apply_flags(args, train, zero_doc)
    if args.resume not in (None, LATEST):
        raise ConfigError("train_classifier resumes each phase from its own latest checkpoint: --resume takes no "
                          f"tag here (got {args.resume!r})")
    data = Snippets(train["modules"], train["snippet"], train["test_fraction"])
    x_test, y_test = data.test_set(train["eval_per_module"])
    model_cfg = dict(MODEL_DEFAULTS, **model_doc)
    torch.manual_seed(train["seed"])
    model = Encoder(len(train["modules"]), train["snippet"], **model_cfg)
    base = Path(train["ckpt_dir"] or Path(train["out_dir"]) / "checkpoints")
    phases = [("mlm", 1, train["mlm_steps"]), ("finetune", train["mlm_steps"] + 1, train["steps"])]
    if args.resume and (base / "finetune" / "latest").exists():
        phases = phases[1:]  # the fine-tuning checkpoint holds the warmed-up embeddings

    for phase, first, last in phases:
        if last < first:
            continue
        mlm = phase == "mlm"
        engine = build(model, train, cfg, mlm)
        world, rank = engine.world_size, engine.rank
        run = start_run(engine, dict(train, steps=last, ckpt_dir=str(base / phase)), {"model": model_cfg},
                        args.resume, "samples", world * train["micro_batch"], preemption, first_step=first)

        def step_fn(step: int) -> dict:
            g = generator(train["seed"], step, rank)
            x, y = data.batch(train["micro_batch"], g)
            loss, correct = losses(engine, x, y, mlm, train["mask_fraction"], g)
            engine.backward(loss)
            engine.step()
            return {"loss": loss.item()} | ({} if mlm else {"accuracy": correct / len(y)})

        def eval_fn() -> dict:
            engine.eval()
            with torch.no_grad():  # every world-th test snippet; the same masks at every evaluation
                loss, correct = losses(engine, x_test[rank::world], y_test[rank::world], mlm,
                                       train["mask_fraction"], generator(train["seed"], EVAL_STREAM, rank))
            engine.train()
            return test_metrics(engine, len(y_test[rank::world]), loss.item(), correct)

        result = train_loop(run, step_fn, eval_fn, lambda _interval: {"phase": phase})
        if not result.completed:
            return
        if mlm:  # the warmed-up weights go to a new model: at stage 3 this one's storage is the engine's
            warm = engine.full_state_dict()
            model = Encoder(len(train["modules"]), train["snippet"], **model_cfg)
            model.load_state_dict(warm)
        engine.close()
    if rank0 and "val_accuracy" in result.metrics:
        print(f"test accuracy {result.metrics['val_accuracy']:.4f} on {len(y_test)} snippets of "
              f"{len(train['modules'])} modules (chance {1 / len(train['modules']):.2f})", flush=True)


if __name__ == "__main__":
    job_main(main)
