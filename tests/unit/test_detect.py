"""The global-norm helpers behind the grad and param checks."""

from __future__ import annotations

import math
import os

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


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_the_norm_helper_thread_is_made_again_in_a_forked_child():
    """A thread does not survive fork: a child handing work to its parent's executor would wait forever."""
    from reprokit.detect import _Aside

    assert _Aside.submit(os.getpid).result(timeout=10) == os.getpid()
    pid = os.fork()
    if pid == 0:  # the child: exit 0 only when its own helper thread ran the work
        try:
            ok = _Aside.submit(os.getpid).result(timeout=10) == os.getpid()
        except BaseException:
            ok = False
        os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert _Aside.submit(os.getpid).result(timeout=10) == os.getpid()  # the parent's thread still works
