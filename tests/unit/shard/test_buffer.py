"""Unit tests of zerompi.shard.buffer.FlatBuffer: free/alloc cycles with live views and parameters."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from zerompi.blockio.aligned import Reuse
from zerompi.shard.buffer import FlatBuffer
from zerompi.errors import ZeroMPIError


def refill(buf: FlatBuffer, values: torch.Tensor) -> None:
    buf.alloc()
    buf.tensor.copy_(values)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_nbytes_and_is_allocated(dtype):
    buf = FlatBuffer(10, dtype)
    size = 10 * torch.tensor([], dtype=dtype).element_size()
    assert buf.is_allocated and buf.nbytes == size
    buf.free()
    assert not buf.is_allocated and buf.tensor.untyped_storage().nbytes() == 0
    assert buf.nbytes == size  # the size to re-allocate is remembered
    buf.alloc()
    assert buf.is_allocated and buf.tensor.untyped_storage().nbytes() == size


def test_constructor_options():
    assert not FlatBuffer(8, torch.float32, allocated=False).is_allocated
    assert torch.equal(FlatBuffer(8, torch.float32, zero=True).tensor, torch.zeros(8))
    buf = FlatBuffer(8, torch.float32, allocated=False, zero=True)
    assert buf.tensor.shape == (8,) and buf.nbytes == 32


def test_views_keep_shape_across_free_and_alloc():
    buf = FlatBuffer(12, torch.float32)
    v = buf.view(2, (2, 5))
    buf.free()
    assert v.shape == (2, 5) and v.untyped_storage().nbytes() == 0
    buf.alloc()
    assert v.shape == (2, 5) and v.untyped_storage().nbytes() == buf.nbytes


def test_view_reads_refilled_data():
    buf = FlatBuffer(12, torch.float32)
    views = [buf.view(0, (3,)), buf.view(3, (2, 2)), buf.view(7, (5,))]
    buf.free()
    data = torch.arange(12, dtype=torch.float32)
    refill(buf, data)
    assert torch.equal(views[0], data[:3])
    assert torch.equal(views[1], data[3:7].view(2, 2))
    assert torch.equal(views[2], data[7:])


def test_view_made_before_free_writes_through_after_alloc():
    buf = FlatBuffer(6, torch.float32, zero=True)
    v = buf.view(2, (2, 2))
    buf.free()
    buf.alloc(zero=True)
    v.fill_(3.0)
    assert torch.equal(buf.tensor, torch.tensor([0, 0, 3, 3, 3, 3], dtype=torch.float32))
    buf.tensor[2] = 7.0
    assert v[0, 0].item() == 7.0


def test_alloc_zero_fills_freed_buffer():
    buf = FlatBuffer(1000, torch.float32)
    buf.tensor.fill_(5.0)
    v = buf.view(10, (10,))
    buf.free()
    out = buf.alloc(zero=True)
    assert out is buf.tensor
    assert torch.equal(buf.tensor, torch.zeros(1000)) and torch.equal(v, torch.zeros(10))


def test_alloc_on_allocated_buffer_keeps_data_and_refuses_zero():
    buf = FlatBuffer(4, torch.float32)
    buf.tensor.copy_(torch.tensor([1.0, 2.0, 3.0, 4.0]))
    buf.alloc()  # no-op
    assert torch.equal(buf.tensor, torch.tensor([1.0, 2.0, 3.0, 4.0]))
    with pytest.raises(ZeroMPIError):
        buf.alloc(zero=True)


@pytest.mark.parametrize("offset, shape", [(0, (10,)), (4, (2, 3)), (10, (0,)), (9, ())])
def test_view_in_bounds(offset, shape):
    buf = FlatBuffer(10, torch.float32)
    buf.tensor.copy_(torch.arange(10, dtype=torch.float32))
    v = buf.view(offset, shape)
    assert v.shape == shape
    assert torch.equal(v.reshape(-1), torch.arange(offset, offset + v.numel(), dtype=torch.float32))


@pytest.mark.parametrize("offset, shape", [(-1, (2,)), (0, (11,)), (9, (2,)), (4, (2, 4)), (11, ())])
def test_view_out_of_bounds_raises(offset, shape):
    buf = FlatBuffer(10, torch.float32)
    with pytest.raises(ZeroMPIError, match="outside"):
        buf.view(offset, shape)


def bind_linear(lin: nn.Linear) -> FlatBuffer:
    """Move ``lin``'s parameters into one FlatBuffer, the way buckets bind parameters."""
    w, b = lin.weight.detach().clone(), lin.bias.detach().clone()
    buf = FlatBuffer(w.numel() + b.numel() + 3, torch.float32, zero=True)  # + padding
    buf.tensor[:w.numel()].copy_(w.reshape(-1))
    buf.tensor[w.numel():w.numel() + b.numel()].copy_(b)
    lin.weight.data = buf.view(0, tuple(w.shape))
    lin.bias.data = buf.view(w.numel(), tuple(b.shape))
    return buf


def reference(lin: nn.Linear, x: torch.Tensor):
    ref = nn.Linear(lin.in_features, lin.out_features)
    ref.load_state_dict({k: v.detach().clone() for k, v in lin.state_dict().items()})
    xr = x.clone().requires_grad_()
    out = ref(xr)
    out.square().sum().backward()
    return out.detach(), ref.weight.grad, ref.bias.grad, xr.grad


def test_parameter_bound_to_view_trains_after_free_alloc_refill():
    torch.manual_seed(0)
    lin = nn.Linear(5, 3)
    x = torch.randn(4, 5)
    expected = reference(lin, x)
    buf = bind_linear(lin)
    saved = buf.tensor.clone()
    buf.free()
    assert lin.weight.untyped_storage().nbytes() == 0
    refill(buf, saved)
    xg = x.clone().requires_grad_()
    out = lin(xg)
    out.square().sum().backward()
    for got, want in zip((out.detach(), lin.weight.grad, lin.bias.grad, xg.grad), expected):
        torch.testing.assert_close(got, want)


def test_parameter_freed_between_forward_and_backward():
    """Stage 3 frees gathered weights after forward and regathers them for backward."""
    torch.manual_seed(1)
    lin = nn.Linear(6, 4)
    x = torch.randn(3, 6)
    expected = reference(lin, x)
    buf = bind_linear(lin)
    saved = buf.tensor.clone()
    xg = x.clone().requires_grad_()
    out = lin(xg)
    buf.free()
    refill(buf, saved)
    out.square().sum().backward()
    for got, want in zip((out.detach(), lin.weight.grad, lin.bias.grad, xg.grad), expected):
        torch.testing.assert_close(got, want)


def test_reuse_pool_moves_memory_and_keeps_the_storage():
    """With a pool, free() hands the bytes over and alloc() takes bytes of the same size back into
    the same storage object: views (and a parameter freed between forward and backward) see them."""
    pool = Reuse(limit=1 << 20)
    torch.manual_seed(1)
    lin = nn.Linear(6, 4)
    x = torch.randn(3, 6)
    expected = reference(lin, x)
    buf = FlatBuffer(6 * 4 + 4, torch.float32, reuse=pool)
    buf.tensor[:24].copy_(lin.weight.detach().reshape(-1))
    buf.tensor[24:].copy_(lin.bias.detach())
    lin.weight.data, lin.bias.data = buf.view(0, (4, 6)), buf.view(24, (4,))
    storage, address = buf.tensor.untyped_storage(), buf.tensor.data_ptr()
    saved = buf.tensor.clone()
    xg = x.clone().requires_grad_()
    out = lin(xg)
    buf.free()
    assert not buf.is_allocated and pool.nbytes == buf.nbytes  # the memory waits in the pool
    other = FlatBuffer(28, torch.float32, allocated=False, reuse=pool)  # its first bytes go to the pool
    other.alloc()  # and come back (the newest of the size first)
    assert pool.nbytes == buf.nbytes and other.tensor.data_ptr() != address
    refill(buf, saved)  # the first buffer's memory comes back into the same storage object
    assert pool.nbytes == 0
    assert buf.tensor.untyped_storage()._cdata == storage._cdata and buf.tensor.data_ptr() == address
    out.square().sum().backward()
    for got, want in zip((out.detach(), lin.weight.grad, lin.bias.grad, xg.grad), expected):
        torch.testing.assert_close(got, want)


def test_reuse_pool_over_its_limit_frees():
    pool = Reuse(limit=16)
    buf = FlatBuffer(28, torch.float32, reuse=pool)
    buf.free()
    assert not buf.is_allocated and pool.nbytes == 0
    buf.alloc(zero=True)
    assert buf.is_allocated and not buf.tensor.any()
