"""The one O_DIRECT block path (zerompi/blockio/direct.py) on real files: what goes direct, what is
staged, the padding staged writes leave, full-length loops, and the fallback where O_DIRECT is refused."""
from __future__ import annotations

import os
from functools import partial

import numpy as np
import pytest
import torch

from zerompi.blockio import direct
from zerompi.blockio.aligned import ALIGN, BufferPool, aligned_empty
from zerompi.blockio.direct import READ, WRITE, PageWriter, move_block, transfer


@pytest.fixture
def swap(tmp_path):
    """A file made by ``direct.create`` (O_DIRECT where tmp_path allows it) and a pool of two pages."""
    pool = BufferPool(2, 2 * ALIGN)
    fd, _ = direct.create(str(tmp_path / "f.bin"), True, pool)
    os.ftruncate(fd, 4 * ALIGN)
    yield fd, pool
    os.close(fd)
    pool.close()


def _bytes(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def test_create_is_exclusive_and_probes_no_bytes_into_the_file(tmp_path):
    pool = BufferPool(1, ALIGN)
    path = str(tmp_path / "f.bin")
    fd, _ = direct.create(path, True, pool)
    try:
        assert os.fstat(fd).st_size == 0  # the probe page is truncated away
        with pytest.raises(FileExistsError):
            direct.create(path, True, pool)
    finally:
        os.close(fd)
        pool.close()
    fd, is_direct = direct.create(str(tmp_path / "g.bin"), False, BufferPool(1, ALIGN))
    os.close(fd)
    assert not is_direct


def test_aligned_memory_moves_directly_and_the_rest_is_staged_with_zeroed_padding(swap):
    fd, pool = swap
    io = {kind: partial(transfer, kind, fd) for kind in (WRITE, READ)}
    aligned = aligned_empty(ALIGN, torch.uint8).numpy()
    aligned[:] = _bytes(ALIGN)
    assert not move_block(WRITE, memoryview(aligned), 0, pool, io[WRITE])
    ragged = _bytes(ALIGN + 100, seed=1)
    with pool.lease() as buf:  # leave garbage in the buffers: the padding must not show it
        np.frombuffer(buf.view, np.uint8)[:] = 0xAB
    seen = []
    assert move_block(WRITE, memoryview(ragged), ALIGN, pool, io[WRITE], seen=lambda v: seen.append(bytes(v)))
    assert seen == [ragged.tobytes()]
    with open(f"/proc/self/fd/{fd}", "rb") as f:  # buffered: the O_DIRECT descriptor wants aligned memory
        f.seek(ALIGN)
        assert f.read(2 * ALIGN) == ragged.tobytes() + bytes(ALIGN - 100)
    back = np.zeros(ALIGN + 100, np.uint8)
    assert move_block(READ, memoryview(back), ALIGN, pool, io[READ])
    assert np.array_equal(back, ragged)
    out = aligned_empty(ALIGN, torch.uint8).numpy()
    assert not move_block(READ, memoryview(out), 0, pool, io[READ])
    assert np.array_equal(out, aligned)


def test_a_read_past_the_end_raises_the_callers_error(swap):
    fd, _ = swap
    out = bytearray(3 * ALIGN)
    with pytest.raises(EOFError, match=f"after {2 * ALIGN}"):
        transfer(READ, fd, memoryview(out), 2 * ALIGN, short=lambda done: EOFError(f"after {done}"))
    with pytest.raises(OSError):
        transfer(READ, fd, memoryview(out), 4 * ALIGN)


def test_a_failing_call_is_handed_to_the_caller_with_the_bytes_done(tmp_path):
    path = tmp_path / "ro.bin"
    path.write_bytes(bytes(ALIGN))
    fd = os.open(path, os.O_RDONLY)
    try:
        with pytest.raises(RuntimeError, match="0 done, errno 9") as info:
            transfer(WRITE, fd, memoryview(bytes(ALIGN)), 0,
                     failed=lambda done, e: RuntimeError(f"{done} done, errno {e.errno}"))
        assert isinstance(info.value.__cause__, OSError)
    finally:
        os.close(fd)


@pytest.mark.parametrize("direct_on", [True, False])
def test_page_writer_writes_whole_pages_direct_and_tails_buffered(tmp_path, direct_on):
    path = tmp_path / "p.bin"
    data = _bytes(3 * ALIGN + 17)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    pages = PageWriter(path, fd, 1, 4 * ALIGN, direct=direct_on)
    try:
        pages.write(memoryview(data), ALIGN)           # staged (numpy's memory), tail buffered
        pages.write(memoryview(data[:100]), 7)          # unaligned offset: buffered throughout
    finally:
        pages.close()
        pages.close()
        os.close(fd)
    raw = path.read_bytes()
    assert raw[ALIGN:] == data.tobytes() and raw[7:107] == data[:100].tobytes()
    probe = direct.open_direct(path, os.O_RDONLY)  # whether this filesystem takes O_DIRECT at open
    if probe is not None:
        os.close(probe)
    assert pages.direct_bytes == (3 * ALIGN if direct_on and probe is not None else 0)
