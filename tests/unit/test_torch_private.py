"""The private torch APIs behind zerompi/torch_private.py, each pinned to the behaviour zerompi needs.

A torch upgrade that drops or changes one fails here by name; the package itself would only fall
back (no memory reuse) or break where the call sits.
"""
from __future__ import annotations

import re
from pathlib import Path

import torch

from zerompi import torch_private


def test_storages_exchange_their_bytes_and_keep_their_identity():
    assert torch_private.can_move_storage(), f"torch {torch.__version__} has no UntypedStorage._swap_data_ptr_"
    a = torch.arange(8, dtype=torch.float32)
    view = a[2:5]
    storage = a.untyped_storage()
    spare = torch.UntypedStorage(0)
    ptr = storage.data_ptr()
    torch_private.move_storage(storage, spare)
    assert storage.nbytes() == 0 and spare.nbytes() == 32 and spare.data_ptr() == ptr
    torch_private.move_storage(storage, spare)
    assert a.untyped_storage() is storage and storage.data_ptr() == ptr
    assert view.tolist() == [2.0, 3.0, 4.0]  # the view sees the bytes back


def test_use_count_tells_a_storage_held_elsewhere():
    count = torch_private.use_count_of()
    assert count is not None, f"torch {torch.__version__} has no torch._C._storage_Use_Count"
    t = torch.empty(16)
    alone = count(t.untyped_storage())
    other = t[4:]
    assert count(t.untyped_storage()) == alone + 1
    del other
    assert count(t.untyped_storage()) == alone


def test_pytree_walks_nested_arguments():
    args = ({"x": torch.ones(2)}, [torch.zeros(1), 3])
    leaves, spec = torch_private.tree_flatten(args)
    assert [type(v) for v in leaves] == [torch.Tensor, torch.Tensor, int]
    assert torch_private.tree_unflatten(leaves, spec)[1][1] == 3
    doubled = torch_private.tree_map(lambda v: v * 2, args)
    assert doubled[0]["x"].tolist() == [2.0, 2.0] and doubled[1][1] == 6


def test_no_other_module_reaches_into_torch_privates():
    root = Path(torch_private.__file__).parent
    private = re.compile(r"torch\._C\b|torch\.utils\._|_swap_data_ptr_|_storage_Use_Count")
    users = {p.relative_to(root).as_posix() for p in root.rglob("*.py") if private.search(p.read_text())}
    assert users == {"torch_private.py"}


def test_a_scheduler_moved_to_another_optimizer_steps_without_warning():
    import warnings
    first = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    scheduler = torch.optim.lr_scheduler.StepLR(first, 1, gamma=0.5)
    second = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    second.param_groups[0]["initial_lr"] = 1.0
    scheduler.optimizer = second
    torch_private.track_scheduler_steps(second)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        second.step()
        scheduler.step()
    assert second.param_groups[0]["lr"] == 0.5 and first.param_groups[0]["lr"] == 1.0


def test_work_from_a_finished_future():
    fut = torch.futures.Future()
    fut.set_result([torch.ones(1)])
    work = torch_private.create_work_from_future(fut)
    assert work.wait() and work.is_completed()
