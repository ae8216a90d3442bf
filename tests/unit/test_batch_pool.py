"""The Recorder's batch buffers (``reprokit.batch_pool``): reused window after window, a kept window's buffers never
written, and byte counts that always equal the buffers held."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from reprokit.batch_pool import BatchPool


def _nbytes(ts) -> int:
    return sum(t.numel() * t.element_size() for t in ts)


def test_steady_state_reuses_every_buffer():
    pool = BatchPool()
    seen = []
    for window in range(3):
        ptrs = []
        for position in range(4):
            pool.start(position, kept_steps=0)
            _, tensors = pool.encode({"x": torch.full((2, 3), float(window)), "y": torch.arange(5)})
            assert torch.equal(tensors["batch/x"], torch.full((2, 3), float(window)))
            ptrs.append(tuple(t.data_ptr() for t in tensors.values()))
        seen.append(ptrs)
    assert seen[0] == seen[1] == seen[2], "no buffer allocated after the first window"
    assert pool.bytes() == 4 * (6 * 4 + 5 * 8) and pool.pinned == 0


def test_a_kept_step_s_buffer_is_never_written():
    pool = BatchPool()
    pool.start(0, kept_steps=0)
    _, first = pool.encode({"x": torch.ones(3)})
    pool.start(0, kept_steps=1)  # a new window starts while the old one is kept
    _, second = pool.encode({"x": torch.zeros(3)})
    assert torch.equal(first["batch/x"], torch.ones(3)), "the kept step still reads its batch"
    assert second["batch/x"].data_ptr() != first["batch/x"].data_ptr()
    assert _nbytes(pool.spares.values()) == 12 and pool.bytes() == 24, "the held buffer is a spare, still held"
    assert pool.bytes_at(0) == 12, "a spare is no position's"
    pool.free_spares()
    assert not pool.spares and pool.bytes() == 12


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 2), st.sampled_from([(2,), (3,), (2, 2)]),
                          st.sampled_from([torch.float32, torch.int64])), min_size=1, max_size=25))
def test_byte_counts_always_equal_the_buffers_held(steps):
    pool = BatchPool()
    for i, (position, kept, shape, dtype) in enumerate(steps):
        pool.start(position, kept_steps=kept)
        batch = {"a": torch.full(shape, i, dtype=dtype), "b": torch.full((1,), -i, dtype=torch.int64)}
        _, tensors = pool.encode(batch)
        assert all(torch.equal(tensors[f"batch/{k}"], v) for k, v in batch.items())
        assert pool.bytes() == _nbytes(pool.buffers()) == _nbytes(pool.slots.values()) + _nbytes(pool.spares.values())
        for p in range(4):
            assert pool.bytes_at(p) == _nbytes(t for key, t in pool.slots.items() if key[0] == p)
        if i % 5 == 4:
            pool.free_after(1)
            pool.free_spares()
            assert all(key[0] <= 1 for key in pool.slots) and not pool.spares
    pool.clear()
    assert pool.bytes() == 0 and not pool.buffers()
