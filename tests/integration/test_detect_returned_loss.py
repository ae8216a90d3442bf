"""The loss checks see the loss however the step returns it, and predicates that return odd verdicts fail cleanly."""

from __future__ import annotations

import math

import pytest
from rk_testing import bundle_of, record

import reprokit


def _record(projects, tmp_path, batches, **kw):
    m = projects("rk_detect_cases")
    return record(m, {}, batches, tmp_path / "repros", snapshot_every=4, **kw)


@pytest.mark.slow
def test_a_nan_loss_inside_a_returned_dict_is_a_nonfinite_loss(projects, tmp_path):
    # Only the loss check can see it (grads are not checked): before, a dict return went unchecked.
    m = projects("rk_detect_cases")
    _, exc = _record(projects, tmp_path, m.batches(8, returns="dict", zero_row=5), check_grads=False)
    assert isinstance(exc, reprokit.TrainingFailure), exc
    assert (exc.failure.kind, exc.failure.step) == ("nonfinite_loss", 5)
    report = reprokit.replay(exc.bundle)
    assert report.reproduced and report.runs[0].failure.kind == "nonfinite_loss", report


@pytest.mark.slow
def test_a_spike_in_a_returned_dict_fires_and_replays_at_the_same_step(projects, tmp_path):
    m = projects("rk_detect_cases")
    _, exc = _record(projects, tmp_path, m.batches(20, returns="dict", spike=(15, 100.0)),
                     spike_factor=20.0, spike_window=10)
    assert isinstance(exc, reprokit.TrainingFailure), exc
    assert (exc.failure.kind, exc.failure.step) == ("loss_spike", 15)
    report = reprokit.replay(exc.bundle)  # the window starts at step 12: the spike history came with it
    assert report.reproduced and (report.runs[0].failure.kind, report.runs[0].failure.step) == ("loss_spike", 15)


def test_a_normal_loss_curve_with_a_spike_detector_runs_clean(projects, tmp_path):
    m = projects("rk_detect_cases")
    rec, exc = _record(projects, tmp_path, m.batches(40), spike_factor=3.0, spike_window=10)
    assert exc is None and rec.step_index == 40


@pytest.mark.parametrize("returns, said", [("tuple", "returned a tuple, not a loss")])
def test_a_loss_the_checks_cannot_read_is_said_once(projects, tmp_path, returns, said):
    m = projects("rk_detect_cases")
    with pytest.warns(reprokit.RecorderWarning, match=said) as got:
        rec, exc = _record(projects, tmp_path, m.batches(6, returns=returns), check_grads=False)
    assert exc is None and rec.step_index == 6
    assert sum("not a loss" in str(w.message) for w in got) == 1, [str(w.message) for w in got]
    assert "'loss' entry" in str(got[0].message)


def test_a_predicate_returning_a_vector_fails_with_a_config_error_naming_it(projects, tmp_path):
    m = projects("rk_detect_cases")
    _, exc = _record(projects, tmp_path, m.batches(6), detect=[m.vector_verdict])
    # Before: a bare "Boolean value of Tensor with more than one value is ambiguous" out of reprokit, no bundle.
    assert isinstance(exc, reprokit.TrainingFailure), repr(exc)
    f = exc.failure
    assert (f.kind, f.exc_type, f.step, f.frame) == ("exception", "ConfigError", 0, "rk_detect_cases.py:vector_verdict")
    assert "vector_verdict returned a tensor of shape [2]" in f.message and ".any()" in f.message
    assert bundle_of(exc).is_dir()


def test_a_loss_that_is_not_positive_says_the_spike_check_cannot_judge(projects, tmp_path):
    m = projects("rk_detect_cases")
    with pytest.warns(reprokit.RecorderWarning, match="median of the recent losses is -") as got:
        rec, exc = _record(projects, tmp_path, m.batches(14, returns="negative"), spike_factor=3.0, spike_window=10)
    assert exc is None and rec.step_index == 14
    assert sum("spike_factor cannot judge" in str(w.message) for w in got) == 1


def test_an_injected_nan_loss_keeps_the_rest_of_a_returned_dict(projects, tmp_path):
    m = projects("rk_detect_cases")
    state = m.build({})
    outs = [m.nan_dict_step(state, b) for b in m.batches(4)]  # a bare loop: the injector counts calls
    assert all(isinstance(o, dict) and o["logits"].shape == (4, 1) for o in outs), outs  # before: a float at step 3
    assert [math.isnan(o["loss"].detach().item()) for o in outs] == [False, False, False, True]
    _, exc = _record(projects, tmp_path, m.batches(6), step=m.nan_dict_step, check_grads=False)
    assert isinstance(exc, reprokit.TrainingFailure) and (exc.failure.kind, exc.failure.step) == ("nonfinite_loss", 3)


def test_a_bundle_recorded_before_dict_losses_were_read_replays_as_it_was_recorded(projects, tmp_path):
    # Before the loss was read out of a returned dict, this run failed on its gradients (nonfinite_grad) and its
    # run.json had no `loss_from_mapping`. Such a bundle must still reproduce, not turn into a different failure.
    import json

    from rk_testing import reseal
    m = projects("rk_detect_cases")
    _, exc = _record(projects, tmp_path, m.batches(8, returns="dict", zero_row=5))
    assert (exc.failure.kind, exc.failure.step) == ("nonfinite_loss", 5)
    b = bundle_of(exc)
    run = json.loads((b / "run.json").read_text())
    assert run["recorder"]["detect"].pop("loss_from_mapping") is True
    (b / "run.json").write_text(json.dumps(run))
    failure = json.loads((b / "failure.json").read_text())
    failure.update(kind="nonfinite_grad")
    (b / "failure.json").write_text(json.dumps(failure))
    reseal(b)
    report = reprokit.replay(b)
    assert report.verdict == "deterministic", report.to_json()
    assert report.runs[0].failure.kind == "nonfinite_grad"
