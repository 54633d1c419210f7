"""The outputs of one forward, for ``loss.backward()`` under the DeepSpeed engine: which tensors the
output holds, and which of them a backward reached already (its gradient then comes scaled)."""
from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from typing import Any

import torch


def tensors_of(out: Any) -> Iterator[torch.Tensor]:
    """The tensors of a forward's output (nested tuples, lists, dicts, dataclasses such as
    transformers' ModelOutput)."""
    if isinstance(out, torch.Tensor):
        yield out
    elif isinstance(out, Mapping):
        for v in out.values():
            yield from tensors_of(v)
    elif isinstance(out, (list, tuple)):
        for v in out:
            yield from tensors_of(v)
    elif dataclasses.is_dataclass(out) and not isinstance(out, type):
        for f in dataclasses.fields(out):
            yield from tensors_of(getattr(out, f.name))


class Outputs:
    """One forward's hooked outputs, and which of them a backward has already passed (whose
    gradients were scaled): an output reached from one of those takes an already scaled gradient."""

    def __init__(self, tensors: dict[int, torch.Tensor]):
        self.tensors = tensors
        self._fired: list[Any] = []
        self._reach: dict[Any, set] = {}

    def _reached_from(self, node: Any) -> set:
        """The hooked outputs' nodes in ``node``'s graph below it (walked once, only with several outputs)."""
        if node not in self._reach:
            wanted = {t.grad_fn for t in self.tensors.values()} - {node}
            seen, found, todo = set(), set(), [node]
            while todo and wanted - found:
                for nxt, _ in todo.pop().next_functions:
                    if nxt is not None and nxt not in seen:
                        seen.add(nxt)
                        if nxt in wanted:
                            found.add(nxt)
                        todo.append(nxt)
            self._reach[node] = found
        return self._reach[node]

    def scaled_downstream(self, node: Any) -> bool:
        """Record that ``node``'s output was reached; whether its gradient came scaled through another output."""
        scaled = len(self.tensors) > 1 and any(node in self._reached_from(f) for f in self._fired)
        self._fired.append(node)
        return scaled
