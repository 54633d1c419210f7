"""Every rank passes the same config (shard/agreement.py): checked in one all-gather at initialize."""
from __future__ import annotations

import dataclasses
from enum import Enum

import pytest
import torch

import zerompi
from zerompi.comm.local import run_ranks
from zerompi.errors import ConfigError
from zerompi.shard.agreement import PER_RANK, check_configs_agree

BASE = zerompi.ZeroConfig(stage=2, device="cpu", cpu_threads=1)


def test_the_same_config_passes():
    assert run_ranks(3, lambda group: check_configs_agree(BASE, group)) == [None] * 3


def test_a_key_that_differs_is_named_with_every_ranks_value_on_every_rank():
    def rank(group):
        cfg = dataclasses.replace(BASE, lr=1e-2 if group.rank == 1 else 1e-3, stage=3 if group.rank == 2 else 2)
        with pytest.raises(ConfigError) as e:
            check_configs_agree(cfg, group)
        return str(e.value)
    messages = run_ranks(3, rank)
    assert len(set(messages)) == 1
    assert "lr: 0.001 on rank(s) [0, 2], 0.01 on rank(s) [1]" in messages[0]
    assert "stage: 2 on rank(s) [0, 1], 3 on rank(s) [2]" in messages[0]


def test_per_rank_keys_may_differ():
    def rank(group):
        check_configs_agree(dataclasses.replace(BASE, hang_dir=f"/tmp/h{group.rank}", cpu_threads=group.rank + 1),
                            group)
        return True
    assert run_ranks(2, rank) == [True, True]
    assert PER_RANK <= {f.name for f in dataclasses.fields(BASE)}


def test_initialize_refuses_ranks_with_another_config():
    def rank(group):
        torch.manual_seed(0)
        cfg = dataclasses.replace(BASE, bucket_mb=1.0 if group.rank == 0 else 2.0)
        with pytest.raises(ConfigError, match="bucket_mb: 1.0 on rank"):
            zerompi.initialize(torch.nn.Linear(4, 4), cfg, group=group)
        return True
    assert run_ranks(2, rank) == [True, True]


# Each key that may differ between ranks, and why: it says where this rank runs and writes, how long it
# waits, or how it moves bytes, never what any rank computes.
EXPECTED_PER_RANK = {
    "cpu_threads": "torch threads of this rank's process: nodes may have other core counts",
    "nvme_path": "this node's own swap directory",
    "nvme_threads": "I/O requests in flight on this rank's swap file",
    "nvme_buffers": "staging memory of this rank's swap I/O",
    "nvme_block_kib": "request size of this rank's swap I/O",
    "nvme_verify": "checks this rank's own swapped blocks as it reads them back",
    "pin_memory": "how this rank's host buffers are allocated",
    "return_freed_memory": "how this rank's allocator hands memory back to the OS",
    "hang_dir": "where this rank writes its records on a hang abort",
    "hang_floor": "how long this rank waits before a hang abort",
    "collective_timeout": "how long this rank waits in one collective",
    "abort_on_exception": "what this rank does with its own uncaught exception",
    "recovery_dir": "the shared filesystem may be mounted at another path on each node",
    "min_ranks": "this rank's own threshold for giving up after ranks are lost",
    "checkpoint_direct_io": "how this rank writes its own file: the same bytes either way",
    "checkpoint_align_kib": "where datasets start in this rank's own file: the same values",
    "checkpoint_async_copy": "what this rank's background save writes from: the same bytes",
}

# Two valid configs to vary a key from (the second for what needs quantized gradients and no micro_batches),
# and the alternatives the generic rule (another enum member, the other bool, another number) cannot give.
BASES = (zerompi.ZeroConfig(stage=3, device="cpu", cpu_threads=1, micro_batches=4, total_steps=100),
         zerompi.ZeroConfig(stage=3, device="cpu", cpu_threads=1, total_steps=100, quantize_grads="int8"))
ALTERNATIVES = {"max_live_params": 10**6, "ranks_per_node": 1, "optimizer": "sgd", "optimizer_kwargs": {"amsgrad": True},
                "betas": (0.8, 0.99), "clip_grad_norm": 1.0, "nvme_path": "/tmp/zerompi-nvme", "collective_timeout": 30.0,
                "hang_dir": "/tmp/zerompi-hang", "recovery_dir": "/tmp/zerompi-recovery"}


def _differing(key: str) -> tuple[zerompi.ZeroConfig, zerompi.ZeroConfig]:
    """Two valid configs that differ at ``key`` only."""
    for base in BASES:
        value = getattr(base, key)
        if key in ALTERNATIVES:
            candidates = [ALTERNATIVES[key]]
        elif isinstance(value, bool):
            candidates = [not value]
        elif isinstance(value, Enum):
            candidates = [m for m in type(value) if m != value]
        elif isinstance(value, (int, float)):
            candidates = [c for c in (value + 1, value * 2) if c != value]
        else:
            candidates = []
        for c in candidates:
            try:
                return base, base.replace(**{key: c})
            except ConfigError:
                continue
    pytest.fail(f"no valid alternative value for config key {key!r}: add one to ALTERNATIVES")


def test_per_rank_is_the_reviewed_set():
    assert PER_RANK == set(EXPECTED_PER_RANK), (sorted(PER_RANK - set(EXPECTED_PER_RANK)),
                                                sorted(set(EXPECTED_PER_RANK) - PER_RANK))


def test_every_key_but_per_rank_s_is_refused_by_name_when_it_differs():
    """Every config key, whichever are added later: one rank with another value is refused, naming the key with
    each rank's value, unless the key is in PER_RANK, where it passes.
    Guards: a key added to PER_RANK without reason (``seed``: ranks would draw other dropout masks)."""
    keys = [f.name for f in dataclasses.fields(zerompi.ZeroConfig)]
    pairs = {key: _differing(key) for key in keys}

    def rank(group):
        wrong = {}
        for key, pair in pairs.items():
            try:
                check_configs_agree(pair[group.rank], group)
                if key not in EXPECTED_PER_RANK:
                    wrong[key] = "accepted"
            except ConfigError as e:
                want = f"{key}: {getattr(pair[0], key)!r} on rank(s) [0], {getattr(pair[1], key)!r} on rank(s) [1]"
                if key in EXPECTED_PER_RANK or f"ranks: {want} (" not in str(e):
                    wrong[key] = str(e)
        return wrong
    assert run_ranks(2, rank) == [{}, {}]
