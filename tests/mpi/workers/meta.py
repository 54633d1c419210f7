"""Deferred initialisation: a GPT built on the meta device, materialised bucket by bucket.

For each stage (and a model whose tied weight belongs to two modules, the second of which
also has a bias, so that materialising it must not touch the first's values): the engine's
initial parameters are read back, an eager single-process model is given the same values,
and both train the same batches; the rows report the parity, and the initial values'
statistics against the distributions GPT.__init__ draws from.
"""
import argparse
import math

import torch
from mpi4py import MPI
from torch import nn

import zerompi
from common import VOCAB, compare, engine_train, references, tiny_gpt, token_batches, write_json

COMM = MPI.COMM_WORLD


def stats(init: dict, n_layer: int) -> dict:
    def std(pred):
        values = torch.cat([v.reshape(-1) for n, v in init.items() if pred(n)])
        return float(values.std())
    return {"embedding_std": std(lambda n: n.endswith("wte.weight")),
            "c_fc_std": std(lambda n: n.endswith("c_fc.weight")),
            "c_proj_std": std(lambda n: n.endswith("c_proj.weight")),
            "c_proj_expected": 0.02 / math.sqrt(2 * n_layer),
            "ln_weight_all_one": all(bool((v == 1).all()) for n, v in init.items() if "ln" in n and "weight" in n),
            "distinct_values": len({round(float(v.reshape(-1)[0]), 7) for n, v in init.items()
                                    if n.endswith("c_fc.weight")})}


class TiedWithBias(nn.Module):
    """out.weight is emb.weight; out also has a bias of its own."""

    def __init__(self, d: int = 24):
        super().__init__()
        self.emb, self.mid, self.out = nn.Embedding(VOCAB, d), nn.Linear(d, d), nn.Linear(d, VOCAB)
        self.out.weight = self.emb.weight

    def forward(self, x, y):
        logits = self.out(torch.tanh(self.mid(self.emb(x))))
        return logits, nn.functional.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))


def build(kind: str, seed: int):
    torch.manual_seed(seed)
    return tiny_gpt(seed, n_embd=32, n_layer=3) if kind == "gpt" else TiedWithBias()


def run(stage: int, kind: str) -> dict:
    with torch.device("meta"):
        model = build(kind, 0)
    # SGD: Adam would turn the rounding of near-zero gradients into full-size steps, which says
    # nothing about initialisation (test_parity covers AdamW with the models tuned for it)
    cfg = zerompi.ZeroConfig(stage=stage, optimizer="sgd", lr=0.2, momentum=0.9, bucket_mb=0.001,
                             cpu_threads=1)
    engine = zerompi.initialize(model, cfg, param_init=model.init_module if kind == "gpt" else None)
    meta_left = [n for n, p in model.named_parameters() if p.is_meta]
    init = engine.full_state_dict()
    batches = token_batches(5, COMM.Get_size(), 3, 1)
    ours = engine_train(engine, batches)

    def eager():
        model = build(kind, 1)
        model.load_state_dict(init, strict=False)
        return model
    missing, unexpected = build(kind, 1).load_state_dict(init, strict=False)
    ref, alts = references(COMM, eager, cfg, batches)
    if ref is None:  # rank 0 writes the rows
        return {}
    return {"stage": stage, "kind": kind, "meta_left": meta_left, "dtype": "fp32", **compare(ours, ref, alts),
            "not_loaded": sorted(missing) + sorted(unexpected), "units": len(engine.sharded.units),
            "stats": stats(init, 3) if kind == "gpt" else {"tied": sorted(init)}}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    args = p.parse_args()
    rows = [run(stage, "gpt") for stage in range(4)] + [run(stage, "tied") for stage in (1, 3)]
    if COMM.Get_rank() == 0:
        write_json(args.out, rows)


if __name__ == "__main__":
    main()
