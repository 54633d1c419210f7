"""LoRA with the real peft library on Hugging Face GPT-2 and Llama models, at every stage.

Each case builds a small model from a config (no download), attaches LoRA adapters with
``peft.get_peft_model`` (the base is frozen), trains it through the engine and through the
single-process reference (the same PEFT model in plain PyTorch) on the same global batches, and
rank 0 records the differences, the order noise (tolerance.py) and the memory and byte counters.
At stage 3 it also checks what users do with the result: HF ``generate`` on the trained engine
gives the tokens of a single-process model holding the engine's parameters; a checkpoint saved
with ``include_frozen=False`` holds the adapters alone, and its consolidated file loads back into
a fresh PEFT model with ``set_peft_model_state_dict`` and with ``PeftModel.from_pretrained``, and
one more backward samples the frozen base gathered inside it (held.py).
"""
import argparse
import os
import tempfile

os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from mpi4py import MPI  # noqa: E402

import zerompi  # noqa: E402
from common import MICRO, Run, compare, initial_params, local_part, references, write_json, zero_train  # noqa: E402
from held import held_in_backward  # noqa: E402
from hf_models import lora_model  # noqa: E402
from zerompi.checkpoint import consolidate  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
p.add_argument("--models", default="gpt2,llama")
p.add_argument("--steps", type=int, default=3)
args = p.parse_args()
COMM = MPI.COMM_WORLD
world, rank = COMM.Get_size(), COMM.Get_rank()
VOCAB, SEQ = 64, 12
ADAMW = dict(optimizer="adamw", lr=2e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
CASES = [(s, "fp32") for s in range(4)] + [(1, "bf16"), (3, "bf16")]


def hf_loss(model, batch):
    (ids,) = batch
    return model(input_ids=ids, labels=ids).loss


def batches(steps: int):
    g = torch.Generator().manual_seed(5)
    return [[(torch.randint(0, VOCAB, (world * MICRO, SEQ), generator=g),)] for _ in range(steps)]


def generate_matches(engine, make, trained) -> bool:
    """Greedy generation on the stage-3 engine equals that of one process holding its parameters."""
    prompt = torch.randint(0, VOCAB, (1, 5), generator=torch.Generator().manual_seed(9))
    engine.eval()
    with torch.no_grad():
        ours = engine.module.generate(input_ids=prompt, max_new_tokens=6, do_sample=False, pad_token_id=0)
    engine.train()
    if rank != 0:
        return True
    single = make()
    missing, unexpected = single.load_state_dict(trained, strict=False)  # tied weights are listed once
    assert not unexpected and set(missing) <= {n for n, _ in single.named_parameters(remove_duplicate=False)} - set(trained)
    single.eval()
    with torch.no_grad():
        theirs = single.generate(input_ids=prompt, max_new_tokens=6, do_sample=False, pad_token_id=0)
    return bool(torch.equal(ours, theirs))


def adapters_round_trip(engine, make, trained, directory) -> dict:
    """Save adapters only, consolidate, load into fresh PEFT models both ways (rank 0)."""
    from peft import PeftModel, get_peft_model_state_dict, set_peft_model_state_dict
    from safetensors.torch import load_file
    engine.save_checkpoint(directory, tag="adapters", include_frozen=False)
    if rank != 0:
        return {}
    file = consolidate(directory, os.path.join(directory, "adapters.safetensors"), tag="adapters")
    saved = load_file(str(file))
    fresh = make()
    set_peft_model_state_dict(fresh, get_peft_model_state_dict(fresh, state_dict=saved))
    lora = {n for n, p in fresh.named_parameters() if p.requires_grad}
    loaded = dict(fresh.named_parameters())
    adapter_dir = os.path.join(directory, "peft")
    fresh.save_pretrained(adapter_dir, state_dict=saved)
    again = PeftModel.from_pretrained(make().get_base_model(), adapter_dir)
    again_params = dict(again.named_parameters())
    return dict(saved_names=sorted(saved) == sorted(lora),
                set_state=all(torch.equal(loaded[n], trained[n]) for n in lora),
                from_pretrained=all(torch.equal(again_params[n], trained[n]) for n in lora),
                dataset_bytes=sum(os.path.getsize(os.path.join(directory, "adapters", f))
                                  for f in os.listdir(os.path.join(directory, "adapters"))))


results = []
for kind in args.models.split(","):
    make = lambda: lora_model(kind, VOCAB, SEQ)  # noqa: E731
    for stage, dtype in CASES:
        cfg = zerompi.ZeroConfig(stage=stage, dtype=dtype, bucket_mb=0.01, seed=0, **ADAMW)
        data = batches(args.steps)
        model = make()
        init = initial_params(model)
        ours, engine = zero_train(model, cfg, data, hf_loss)
        row = dict(model=kind, stage=stage, dtype=dtype, world=world, steps=args.steps)
        if stage == 3 and dtype == "fp32":
            row["generate"] = generate_matches(engine, make, ours.params)
            with tempfile.TemporaryDirectory() as tmp:
                shared = COMM.bcast(tmp if rank == 0 else None)
                row.update(adapters_round_trip(engine, make, ours.params, shared))
                COMM.Barrier()
        stats = engine.stats
        frozen_numel = sum(p.numel() for p in model.parameters() if not p.requires_grad)
        row.update(model_state_bytes=stats.model_state_bytes, bytes_sent=dict(stats.bytes_sent),
                   frozen_numel=frozen_numel, trainable_numel=sum(b.layout.numel for b in engine.sharded.buckets),
                   frozen_padded=sum(b.layout.padded_numel for b in engine.sharded.all_buckets if not b.trains),
                   trainable_padded=sum(b.layout.padded_numel for b in engine.sharded.buckets),
                   frozen_buckets=sum(not b.trains for b in engine.sharded.all_buckets))
        if stage == 3:  # after the counters: one more backward and step, every rank's samples
            row["held"] = COMM.allgather(held_in_backward(engine, [local_part(data[0][0], rank)], hf_loss, 0))
        engine.close()
        ref, alts = references(COMM, make, cfg, data, loss_fn=hf_loss)
        if rank == 0:
            # The frozen base: exactly its initial values in the compute dtype. The reference's fp32
            # masters keep the unrounded base, so 16-bit runs are judged on the trained adapters.
            frozen = [n for n, p in model.named_parameters() if not p.requires_grad]
            row["frozen_exact"] = all(torch.equal(ours.params[n], init[n].to(cfg.torch_dtype).float()) for n in frozen)
            if dtype != "fp32":
                keep = lambda run: Run({n: t for n, t in run.params.items() if n not in frozen}, run.losses)  # noqa: E731
                ours, ref, alts = keep(ours), keep(ref), [keep(a) for a in alts]
                init = {n: t for n, t in init.items() if n not in frozen}
            row.update(compare(ours, ref, alts, init))
            results.append(row)
if rank == 0:
    write_json(args.out, results)
