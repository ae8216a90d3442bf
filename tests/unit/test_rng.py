"""RNG capture/restore is exact, including the skipped-when-unchanged fast paths of python, numpy and torch."""

from __future__ import annotations

import random

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from reprokit.state import capture_rng, restore_rng

DRAWS = {
    "none": lambda: None,
    "np_rand": lambda: np.random.rand(),
    "np_randn": lambda: np.random.randn(),  # alternates the legacy Gaussian cache
    "np_randn3": lambda: np.random.randn(3),
    "np_int": lambda: np.random.randint(0, 10),
    "py_random": lambda: random.random(),
    "torch_rand": lambda: torch.rand(2),
}


def _sample():
    return (np.random.randn(3).tolist(), np.random.rand(2).tolist(), random.random(), torch.rand(2).tolist())


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**16), st.lists(st.sampled_from(sorted(DRAWS)), max_size=8))
def test_capture_then_restore_gives_the_same_draws(seed, draws):
    np.random.seed(seed)
    random.seed(seed)
    torch.manual_seed(seed)
    for name in draws:
        DRAWS[name]()
        capture_rng()  # interleaved captures exercise the cache
    tree, tensors = capture_rng()
    expected = _sample()
    DRAWS["np_randn"]()  # move every generator on
    random.random()
    torch.rand(1)
    restore_rng(tree, tensors)
    assert _sample() == expected


def test_reseeding_to_the_same_words_with_a_cached_gaussian_is_seen():
    """The case that sank the numpy shortcut: same words, different Gaussian cache."""
    for _ in range(2):
        np.random.seed(231)
        np.random.randn(3)  # 8 words consumed, one Gaussian cached
        capture_rng()
        np.random.randn()  # the cached one is used: same words, empty cache
        capture_rng()
    np.random.seed(231)
    np.random.randn(3)
    want = np.random.get_state(legacy=True)
    tree, _ = capture_rng()
    assert tree["numpy"][1:] == [want[2], want[3], want[4]]


def test_python_fast_path_is_in_use_and_sees_every_change():
    from reprokit.state import _PythonGlobalRNG

    random.seed(11)
    random.gauss(0, 1)  # leaves gauss_next set
    before = random.getstate()
    reader = _PythonGlobalRNG()
    assert reader.fast, "the CPython layout check failed: every step pays random.getstate()"
    assert random.getstate() == before, "the layout check puts the state back"
    first = reader.get_state()
    assert reader.get_state()[1] is first[1]  # unchanged: the cached tensor
    for change in (random.random, lambda: random.gauss(0, 1), lambda: random.seed(12), lambda: random.randint(0, 9),
                   lambda: random.setstate(before)):
        change()
        version, tensor, gauss = reader.get_state()
        want = random.getstate()
        assert (version, tuple(tensor.tolist()), gauss) == want


def test_numpy_fast_path_is_in_use_and_sees_every_change():
    from reprokit.state import _NumpyGlobalRNG

    np.random.seed(7)
    np.random.randn()  # leaves a Gaussian cached
    before = np.random.get_state(legacy=True)
    reader = _NumpyGlobalRNG()
    assert reader.fast, "the numpy layout check failed: every step pays np.random.get_state()"
    after = np.random.get_state(legacy=True)
    assert np.array_equal(after[1], before[1]) and after[2:] == before[2:], "locating must not touch the generator"
    first = reader.get_state()
    assert reader.get_state()[1] is first[1]  # unchanged: the cached tensor
    name, keys, pos = before[:3]
    changes = (np.random.rand, np.random.randn, np.random.randn, lambda: np.random.seed(8),
               lambda: np.random.randint(0, 9), lambda: np.random.set_state(before),
               # the same words with a different Gaussian cache, each way round
               lambda: np.random.set_state((name, keys, pos, 0, 0.0)),
               lambda: np.random.set_state((name, keys, pos, 1, 0.5)),
               lambda: np.random.set_state((name, keys, pos, 1, -0.5)))
    for change in changes:
        change()
        part, tensor = reader.get_state()
        want = np.random.get_state(legacy=True)
        assert part == [want[0], want[2], want[3], want[4]]
        assert np.array_equal(tensor.numpy(), want[1].astype(np.int64))


def test_numpy_fast_path_follows_a_replaced_bit_generator():
    from reprokit.state import _NumpyGlobalRNG

    reader = _NumpyGlobalRNG()
    rs = np.random.mtrand._rand
    old = rs._bit_generator
    assert reader.fast
    try:
        rs._bit_generator = np.random.MT19937(3)  # a new object: the located addresses are stale
        part, tensor = reader.get_state()
        want = np.random.get_state(legacy=True)
        assert part[1:] == [want[2], want[3], want[4]] and np.array_equal(tensor.numpy(), want[1])
    finally:
        rs._bit_generator = old
    assert reader.fast  # back on the original: located again


def test_torch_cpu_fast_path_is_in_use_and_sees_every_change():
    import struct

    from reprokit.state import _TorchCPURNG

    torch.manual_seed(5)
    before = torch.get_rng_state()
    reader = _TorchCPURNG()
    assert reader.fast, "the torch generator layout check failed: every step allocates torch.get_rng_state()"
    assert torch.equal(torch.get_rng_state(), before), "locating must not touch the default generator"
    first = reader.get_state()
    assert reader.get_state() is first  # unchanged: the cached tensor
    cached = bytearray(before.numpy().tobytes())
    struct.pack_into("=dddi", cached, 5016, 0.125, 0.75, 0.75, 1)  # a cached double normal sample
    with_float = bytearray(before.numpy().tobytes())
    struct.pack_into("=f?", with_float, 5048, 0.5, True)  # a cached float normal sample
    changes = (lambda: torch.rand(1), lambda: torch.randn(1, dtype=torch.float64), lambda: torch.randn(1),
               lambda: torch.randn(100), lambda: torch.randint(0, 9, (3,)), lambda: torch.manual_seed(6),
               lambda: torch.bernoulli(torch.full((4,), 0.5)), lambda: torch.set_rng_state(before),
               lambda: torch.set_rng_state(torch.frombuffer(cached, dtype=torch.uint8).clone()),
               lambda: torch.set_rng_state(before),
               lambda: torch.set_rng_state(torch.frombuffer(with_float, dtype=torch.uint8).clone()))
    for change in changes:
        change()
        assert torch.equal(reader.get_state(), torch.get_rng_state())


def test_words_address_refuses_what_it_cannot_prove():
    from reprokit.state import _PythonGlobalRNG, _words_address

    inst = random.Random(5)
    good = _PythonGlobalRNG._validate(inst)
    assert good == id(inst) + 16
    kw = {"getstate": inst.getstate, "setstate": inst.setstate, "draw": inst.random}
    state = inst.getstate()
    # Past the end of the object: refused before anything is read.
    assert _words_address(inst, id(inst) + 64, 4 + 624 * 4, lambda st: b"", **kw) is None
    # Bytes that do not match the full read: refused, and the state is put back.
    assert _words_address(inst, good, 4 + 624 * 4, lambda st: b"\0" * 2500, **kw) is None
    assert inst.getstate() == state
    # A "draw" that does not move the words: refused.
    assert _words_address(inst, good, 4 + 624 * 4, lambda st: _pack(st), getstate=inst.getstate,
                          setstate=inst.setstate, draw=lambda: None) is None


def _pack(st):
    import struct

    return struct.pack("=i624I", st[1][-1], *st[1][:-1])
