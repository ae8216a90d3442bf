"""The shrinker's and bisectors' search primitives on their own, with Hypothesis: answers and call bounds."""

from __future__ import annotations

import doctest
import importlib
import math
import pkgutil

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import reprokit
from reprokit.search import ddmin, find_integer, shortest_window


class Counted:
    """A predicate that counts its calls and remembers its arguments."""

    def __init__(self, fn):
        self.fn, self.calls = fn, []

    def __call__(self, *args):
        self.calls.append(args)
        return self.fn(*args)


@given(st.integers(0, 10**6))
def test_find_integer_finds_the_largest_true_n_in_logarithmic_calls(k):
    f = Counted(lambda n: n <= k)
    assert find_integer(f) == k
    assert all(n >= 1 for (n,) in f.calls), "f(0) is assumed, never asked"
    assert len(f.calls) <= 4 + 2 * math.ceil(math.log2(k + 2)) + 1, (k, len(f.calls))


@given(st.lists(st.integers(0, 30), min_size=1, max_size=60, unique=True), st.data())
def test_ddmin_returns_an_order_preserving_one_minimal_failing_subset(items, data):
    culprits = set(data.draw(st.lists(st.sampled_from(items), min_size=1, max_size=3, unique=True)))
    fails = Counted(lambda xs: culprits <= set(xs))
    out = ddmin(items, fails)
    assert set(out) == culprits, "with a monotone predicate the minimal failing subset is the culprits"
    assert out == [x for x in items if x in set(out)], "order kept"
    assert fails(out)
    for i in range(len(out)):  # 1-minimal: dropping any one element no longer fails
        assert not fails(out[:i] + out[i + 1:])


@given(st.integers(2, 2000), st.data())
def test_ddmin_finds_one_culprit_within_its_documented_bound(n, data):
    culprit = data.draw(st.integers(0, n - 1))
    fails = Counted(lambda xs: culprit in xs)
    assert ddmin(list(range(n)), fails) == [culprit]
    assert len(fails.calls) <= 2 * math.ceil(math.log2(n)), (n, len(fails.calls))


@given(st.integers(1, 5000), st.data())
@settings(max_examples=200)
def test_shortest_window_trims_to_exactly_the_needed_window(n, data):
    a = data.draw(st.integers(0, n - 1))
    b = data.draw(st.integers(a + 1, n))
    fails = Counted(lambda lo, hi: lo <= a and b <= hi)
    assert shortest_window(n, fails) == (a, b)
    assert all(0 <= lo < hi <= n for lo, hi in fails.calls)
    assert len(fails.calls) <= 2 * (4 + 2 * math.ceil(math.log2(n + 2)) + 1)


def test_shortest_window_with_a_non_monotone_predicate_still_returns_a_failing_window():
    # fails only on windows of even length that hold 10: not monotone, but whatever comes back must fail
    fails = Counted(lambda lo, hi: lo <= 10 < hi and (hi - lo) % 2 == 0)
    lo, hi = shortest_window(64, fails)
    assert fails(lo, hi)


def _modules_with_examples():
    names = ["reprokit"] + [m.name for m in pkgutil.walk_packages(reprokit.__path__, "reprokit.")]
    # The framework integrations import transformers / lightning (seconds each); their own tests cover them.
    return sorted(n for n in names if not n.startswith("reprokit.integrations."))


@pytest.mark.parametrize("name", _modules_with_examples())
def test_docstring_examples_run(name):
    """Every `>>>` example in reprokit's docstrings runs and shows what it says (+SKIP ones need a real bundle)."""
    module = importlib.import_module(name)
    result = doctest.testmod(module, verbose=False, report=False)
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples in {name} failed"
