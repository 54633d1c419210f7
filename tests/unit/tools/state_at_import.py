"""Preloaded by a fork server of test_forkserver.py: state a framework's import may leave in a server, which
its forked ranks then share unless the server declines or resets it. One ATen kernel fixes ATen's CPU
capability for good; one draw from numpy's global generator seeds it (it is otherwise seeded at first use,
in each rank)."""
import numpy
import torch

torch.ones(4).add_(1)
numpy.random.random()
