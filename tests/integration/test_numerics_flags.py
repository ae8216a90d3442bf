"""Global numerics switches (deterministic algorithms, float32 precision) are recorded and put back on replay."""

from __future__ import annotations

import pytest
import torch
from rk_testing import record

import reprokit
from reprokit.env import FP32_PRECISION, _fp32_holder, apply_determinism_flags, determinism_flags
from reprokit.errors import StateMismatchError

NEW_API = _fp32_holder("cuda.matmul") is not None
needs_new_api = pytest.mark.skipif(not NEW_API, reason="this torch has no per-backend fp32_precision (torch < 2.9)")


@pytest.fixture
def torch_numerics():
    """Put every global switch these tests touch back as it was."""
    holders = {name: h for name in FP32_PRECISION if (h := _fp32_holder(name)) is not None}
    precision = {name: h.fp32_precision for name, h in holders.items()}
    det = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled())
    fill = torch.utils.deterministic.fill_uninitialized_memory
    yield
    for name in FP32_PRECISION:
        if name in holders:
            holders[name].fp32_precision = precision[name]
    torch.use_deterministic_algorithms(det[0], warn_only=det[1])
    torch.utils.deterministic.fill_uninitialized_memory = fill


def _mix_precision_apis() -> None:
    """Per-backend settings that make torch refuse to read its legacy flags (allow_tf32,
    get_float32_matmul_precision); CPU matmuls in bf16 where the CPU has it."""
    torch.backends.fp32_precision = "ieee"
    torch.backends.cuda.matmul.fp32_precision = "tf32"
    torch.backends.mkldnn.matmul.fp32_precision = "bf16"


@needs_new_api
@pytest.mark.slow
def test_a_run_on_the_per_backend_precision_api_is_recorded_and_replays_under_it(projects, tmp_path, torch_numerics):
    prec = projects("rk_precision")
    _mix_precision_apis()
    with pytest.raises(RuntimeError, match="mix of the legacy and new APIs"):
        torch.get_float32_matmul_precision()
    _, exc = record(prec, {"precision": "bf16"}, prec.batches(6), tmp_path, snapshot_every=2)
    assert isinstance(exc, reprokit.TrainingFailure) and exc.failure.step == 3
    assert exc.bundle is not None, "reading the legacy flags must not cost the bundle"
    run = reprokit.open_bundle(exc.bundle).run
    flags = {**run["determinism"], **run["precision"]}
    assert flags["fp32_precision"]["mkldnn.matmul"] == "bf16" and flags["fp32_precision"]["cuda.matmul"] == "tf32"
    assert "matmul_allow_tf32" not in flags, "a flag torch refuses to read is left out, not guessed"

    for name in ("generic", "cuda.matmul", "mkldnn.matmul"):  # the replaying process starts from torch's defaults
        _fp32_holder(name).fp32_precision = "none"
    report = reprokit.replay(exc.bundle)
    assert report.verdict == "deterministic", report.runs[0].failure
    assert report.fidelity["bit_exact"]
    assert torch.backends.mkldnn.matmul.fp32_precision == "none", "the replay's settings are undone after it"


def test_warn_only_and_uninitialized_fill_are_recorded_and_put_back(torch_numerics):
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = False
    flags = determinism_flags()
    assert flags["deterministic_warn_only"] is True and flags["fill_uninitialized_memory"] is False
    torch.use_deterministic_algorithms(False)
    torch.utils.deterministic.fill_uninitialized_memory = True
    before = apply_determinism_flags(flags)
    assert torch.are_deterministic_algorithms_enabled() and torch.is_deterministic_algorithms_warn_only_enabled()
    assert torch.utils.deterministic.fill_uninitialized_memory is False
    apply_determinism_flags(before)
    assert not torch.are_deterministic_algorithms_enabled()
    assert torch.utils.deterministic.fill_uninitialized_memory is True


@needs_new_api
def test_a_setting_this_torch_refuses_is_a_clear_error_and_leaves_nothing_half_set(torch_numerics):
    before = determinism_flags()
    bad = {**before, "deterministic_algorithms": True, "fp32_precision": {"cuda.matmul": "no-such-precision"}}
    with pytest.raises(StateMismatchError, match="numerics settings cannot be applied"):
        apply_determinism_flags(bad)
    assert determinism_flags() == before


@needs_new_api
@pytest.mark.slow
def test_bisect_precision_runs_and_restores_under_the_per_backend_precision_api(projects, tmp_path, torch_numerics):
    from reprokit.bisect import bisect_precision

    prec = projects("rk_precision")
    _mix_precision_apis()
    _, exc = record(prec, {"precision": "bf16"}, prec.batches(6), tmp_path, snapshot_every=2)
    before = determinism_flags()
    d = bisect_precision(reprokit.open_bundle(exc.bundle), variants=["recorded", "deterministic"])
    assert d["variants"] == {"recorded": "fail", "deterministic": "fail"}, d
    assert determinism_flags() == before, "every switch a variant set is put back"
