"""The global-norm helpers behind the grad and param checks."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import reprokit
from reprokit.detect import global_norm


@settings(max_examples=40, deadline=None)
@given(st.lists(st.lists(st.floats(-(2.0**100), 2.0**100, allow_nan=False, width=32), min_size=1, max_size=6),
                min_size=1, max_size=6))
def test_global_norm_is_the_norm_of_everything_and_never_overflows(rows):
    ts = [torch.tensor(r, dtype=torch.float32) for r in rows]
    want = math.sqrt(sum(float(x) ** 2 for r in rows for x in torch.tensor(r, dtype=torch.float32).tolist()))
    got = global_norm(ts).item()
    assert math.isfinite(got)  # squares of 2**100 overflow float32; the float64 accumulation must not
    assert math.isclose(got, want, rel_tol=1e-9, abs_tol=1e-300)


def test_global_norm_sees_a_nonfinite_value():
    for bad in (float("nan"), float("inf"), float("-inf")):
        ts = [torch.ones(3), torch.tensor([1.0, bad]), torch.ones(2, dtype=torch.float64)]
        assert not math.isfinite(global_norm(ts).item())


@pytest.mark.parametrize("bad", [{"scaler_patience": 0}, {"spike_factor": 1.0}, {"spike_window": 1}])
def test_bad_detector_settings_raise_reprokit_s_config_error(bad):
    with pytest.raises(reprokit.ConfigError, match=next(iter(bad))) as e:
        reprokit.DetectSettings(**bad)
    assert isinstance(e.value, reprokit.ReprokitError) and isinstance(e.value, ValueError)
