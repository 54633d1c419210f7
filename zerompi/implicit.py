"""``loss.backward()`` as ``engine.backward(loss)``: an engine capability for loops that start the
autograd backward themselves (DeepSpeed's engine allows it; transformers' Trainer and accelerate use it).

A watched forward's outputs carry gradient hooks. In a backward the script started, the first output
reached enters the engine's backward and queues its end for when autograd finishes, and each output's
gradient is scaled as ``engine.backward`` scales the loss (the window's share, the fp16 loss scale), but
once only along a path: an output computed from another (transformers' ``loss`` from its ``logits``)
passes its scaled gradient on, and the other's hook leaves it. Under an explicit backward
(``explicit()``) the hooks do nothing.
"""
from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
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


class ImplicitBackward:
    """Runs a script's ``loss.backward()`` on watched outputs as the engine's backward.

    Args:
        begin: enters the engine's backward and returns the factor the loss's gradient is scaled by.
        end: ends it (``ok``: reduce what is left; else undo the micro-batch).
    """

    def __init__(self, begin: Callable[[], float], end: Callable[[bool], None]):
        self._begin, self._end = begin, end
        self._factor: float | None = None  # inside a backward the script started
        self._explicit = False

    def watch(self, out: Any, before: Callable[[], None] | None = None) -> Any:
        """Hook the outputs of a forward (under grad mode); ``before`` runs as a backward through them
        starts (a check that may refuse it). Returns ``out``. Call ``abandon()`` before the forward: a
        backward that raised must be undone before the next micro-batch starts."""
        if torch.is_grad_enabled():
            outputs = Outputs({id(t): t for t in tensors_of(out) if t.requires_grad and t.grad_fn is not None})
            for t in outputs.tensors.values():
                t.register_hook(functools.partial(self._output_grad, outputs, t.grad_fn, before))
        return out

    @contextmanager
    def explicit(self) -> Iterator[None]:
        """An explicit backward (``engine.backward``) runs inside: the hooks leave its gradients alone."""
        self.abandon()
        self._explicit = True
        try:
            yield
        finally:
            self._explicit = False

    def _output_grad(self, outputs: Outputs, node: Any, before: Callable[[], None] | None,
                     grad: torch.Tensor) -> torch.Tensor:
        if self._explicit:
            return grad
        if self._factor is None:
            if before is not None:
                before()
            self._factor = self._begin()
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)
        if outputs.scaled_downstream(node):
            return grad
        return grad * self._factor

    def _finish(self) -> None:
        """Autograd's post-backward callback: reduce what the backward left, as engine.backward does."""
        self._factor = None
        self._end(True)

    def abandon(self) -> None:
        """A ``loss.backward()`` that raised never reached its callback: undo its micro-batch."""
        if self._factor is not None:
            self._factor = None
            self._end(False)
