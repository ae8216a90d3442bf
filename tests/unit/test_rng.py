"""RNG capture/restore is exact: the global generators and the generators a run keeps in ``TrainState.extra``."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
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
        capture_rng()  # interleaved captures must not disturb anything
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


def test_the_recorder_reads_generators_only_through_their_public_apis():
    """No ctypes, no addresses: the readers that guessed object layouts are gone."""
    import reprokit.rng
    import reprokit.state

    for mod in (reprokit.rng, reprokit.state):
        with open(mod.__file__) as f:
            src = f.read()
        assert "ctypes" not in src and "string_at" not in src and "from_address" not in src, mod.__name__


def _owned_extra():
    return {
        "torch": torch.Generator().manual_seed(1),
        "nested": {"numpy": np.random.default_rng(2), "legacy": [np.random.RandomState(3)]},
        "python": (random.Random(4), 5),
        "mt": np.random.Generator(np.random.MT19937(6)),
        "counter": 7,
    }


def _draw_owned(extra):
    return (torch.rand(3, generator=extra["torch"]).tolist(), extra["nested"]["numpy"].normal(size=2).tolist(),
            extra["nested"]["legacy"][0].randn(3).tolist(), extra["python"][0].gauss(0, 1),
            extra["mt"].random(2).tolist())


@settings(max_examples=25, deadline=None)
@given(st.lists(st.integers(0, 4), max_size=6))
def test_generators_in_extra_round_trip_through_the_bundle_form(draws):
    from reprokit import rng

    extra = _owned_extra()
    for i in draws:  # move some of them on, leaving Gaussian caches in some
        _draw_owned(extra)[i] if i % 2 else extra["nested"]["legacy"][0].randn()
    tree, tensors = rng.encode(rng.capture(extra))
    json.dumps(tree, allow_nan=False)  # strict JSON: the bundle stores it as such
    want = _draw_owned(extra)
    _draw_owned(extra)  # move every one on
    rng.restore(tree, tensors, extra)
    assert _draw_owned(extra) == want
    fresh = _owned_extra()  # what build() would make: other objects at the same places
    rng.restore(tree, tensors, fresh)
    assert _draw_owned(fresh) == want


def test_a_generator_missing_at_replay_is_a_clear_mismatch():
    from reprokit import rng
    from reprokit.errors import StateMismatchError

    tree, tensors = rng.encode(rng.capture({"g": torch.Generator().manual_seed(0)}))
    with pytest.raises(StateMismatchError, match=r"torch generator \(cpu\) at state.extra\['g'\]"):
        rng.restore(tree, tensors, {"g": None})


def test_unrecordable_generators_are_refused_at_attach():
    from reprokit import rng
    from reprokit.errors import CaptureError

    with pytest.raises(CaptureError, match="SystemRandom"):
        rng.check_generators({"a": [random.SystemRandom()]})
    with pytest.raises(CaptureError, match="not a string"):
        rng.check_generators({"a": {3.5: random.Random()}})


def test_a_generator_build_did_not_make_is_created_with_the_recorded_bit_generator():
    from reprokit import rng

    extra = {"g": np.random.Generator(np.random.MT19937(3)), "r": np.random.RandomState(np.random.PCG64(4))}
    marked = rng.marked(extra)
    tree, tensors = rng.encode(rng.capture(extra))
    want = (extra["g"].random(3).tolist(), extra["r"].rand(3).tolist())
    fresh = rng.unmarked(marked, {})  # build() made none of them
    rng.restore(tree, tensors, fresh)
    assert type(fresh["g"].bit_generator) is np.random.MT19937
    assert (fresh["g"].random(3).tolist(), fresh["r"].rand(3).tolist()) == want


def test_a_generator_of_another_bit_generator_is_a_clear_mismatch():
    from reprokit import rng
    from reprokit.errors import StateMismatchError

    tree, tensors = rng.encode(rng.capture({"g": np.random.Generator(np.random.MT19937(3))}))
    with pytest.raises(StateMismatchError, match="MT19937"):
        rng.restore(tree, tensors, {"g": np.random.default_rng(0)})


def test_after_a_device_error_the_cuda_state_is_made_on_the_host_or_left_out():
    """The bundle form written when no CUDA call may run: each CUDA generator's (seed, offset) as the 16 bytes
    torch's CUDA generator writes, or (the host format unchecked) no CUDA state at all; never a CUDA call."""
    import dataclasses

    from reprokit.rng import capture, cuda_state_on_host, encode

    rs = dataclasses.replace(capture(), cuda=((2**64 - 5, 96), (7, 0)))
    _, host = encode(rs, host_only=True)
    assert host["rng/cuda/0"].dtype == torch.uint8 and host["rng/cuda/0"].tolist() == \
        list((2**64 - 5).to_bytes(8, "little")) + list((96).to_bytes(8, "little"))
    assert torch.equal(host["rng/cuda/1"], cuda_state_on_host((7, 0)))
    tree, left_out = encode(rs, host_only=True, cuda=False)
    assert not [k for k in left_out if k.startswith("rng/cuda/")]
    assert torch.equal(left_out["rng/torch"], host["rng/torch"]) and tree == encode(rs, host_only=True)[0]
