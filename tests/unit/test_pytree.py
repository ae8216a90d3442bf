"""Encoding trees of tensors and plain data: round trips, tags, refusals."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load, save

from reprokit import pytree
from reprokit.errors import CaptureError

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.int8,
          torch.uint8, torch.bool]


@st.composite
def tensors(draw):
    dtype = draw(st.sampled_from(DTYPES))
    shape = draw(st.lists(st.integers(0, 4), max_size=3))
    seed = draw(st.integers(0, 2**16))
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(shape, generator=g) * 100
    if draw(st.booleans()) and t.numel():
        t.view(-1)[0] = draw(st.sampled_from([math.nan, math.inf, -math.inf]))
    return t.to(dtype) if dtype.is_floating_point else t.nan_to_num().clamp(-100, 100).to(dtype)


scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**62, 2**62), st.floats(allow_nan=True),
                    st.text(max_size=8))
keys = st.one_of(st.text(max_size=6), st.integers(-5, 5), st.sampled_from(list(pytree.TAGS)))
trees = st.recursive(
    st.one_of(scalars, tensors()),
    lambda children: st.one_of(st.lists(children, max_size=4), st.tuples(children, children),
                               st.dictionaries(keys, children, max_size=4)),
    max_leaves=12,
)


def assert_same(a, b):
    assert type(a) is type(b), (a, b)
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a.view(-1).view(torch.uint8) if a.numel() else a, b.view(-1).view(torch.uint8) if b.numel()
                           else b)
    elif isinstance(a, float) and math.isnan(a):
        assert math.isnan(b)
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_same(x, y)
    else:
        assert a == b


@settings(max_examples=150, deadline=None)
@given(trees)
def test_round_trip_through_json_and_safetensors(tree):
    import json

    encoded, ts = pytree.encode(tree, "t")
    text = json.dumps(encoded, allow_nan=False)  # strict JSON, no NaN literals
    back = pytree.decode(json.loads(text), load(save(ts)))
    assert_same(tree, back)


def test_optimizer_state_int_keys_and_tuples():
    sd = {"state": {0: {"step": torch.tensor(3.0)}}, "param_groups": [{"betas": (0.9, 0.99), "params": [0]}]}
    tree, ts = pytree.encode(sd)
    back = pytree.decode(tree, ts)
    assert list(back["state"]) == [0] and back["param_groups"][0]["betas"] == (0.9, 0.99)


def test_numpy_leaves_come_back_as_numpy():
    tree, ts = pytree.encode({"a": np.arange(6).reshape(2, 3), "s": np.float32(1.5)})
    back = pytree.decode(tree, ts)
    assert isinstance(back["a"], np.ndarray) and back["a"].tolist() == [[0, 1, 2], [3, 4, 5]]
    assert back["s"] == 1.5


def test_copies_do_not_alias_the_source():
    t = torch.zeros(3)
    _, ts = pytree.encode({"t": t})
    t.add_(1)
    assert ts["t"].sum() == 0


@pytest.mark.parametrize("bad,where", [({"f": print}, "f"), ([1, {"o": object()}], "1/o"),
                                       ({"s": torch.zeros(2).to_sparse()}, "s")])
def test_unsupported_leaves_name_their_path(bad, where):
    with pytest.raises(CaptureError, match=where):
        pytree.encode(bad)


def test_skip_callables_drops_functions():
    tree, _ = pytree.encode({"fn": print, "x": 1}, skip_callables=True)
    assert tree == {"x": 1}
