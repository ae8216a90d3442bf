"""Injected faults (reprokit.inject) are detected, bundled, and classified by `replay --times N`."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from rk_testing import bundle_of, entries, record

import reprokit
from reprokit.cli import main
from reprokit.inject import FaultInjector, InjectedFault

CASES = {  # fault: (step function, recorded kind, replay verdict, exit code)
    "nan_loss": ("nan_loss_step", "nonfinite_loss", "deterministic", 1),
    "inf_grad": ("inf_grad_step", "nonfinite_grad", "deterministic", 1),
    "exception": ("exception_step", "exception", "deterministic", 1),
    "transient_nan": ("transient_nan_step", "nonfinite_loss", "not_reproduced", 0),
}


@pytest.mark.parametrize("fault", CASES)
@pytest.mark.slow
def test_each_injected_fault_is_detected_bundled_and_classified(projects, tmp_path, fault):
    mod = projects("rk_inject")
    step_name, kind, verdict, code = CASES[fault]
    rec, exc = record(mod, {}, mod.batches({}, 9), tmp_path, step=getattr(mod, step_name), snapshot_every=4)
    assert rec.step_index == 6, "training stopped at the injected step"
    if fault == "exception":
        assert isinstance(exc, InjectedFault)
    else:
        assert isinstance(exc, reprokit.TrainingFailure)
    bundle = bundle_of(exc)
    recorded = reprokit.open_bundle(bundle).failure
    assert (recorded.kind, recorded.step) == (kind, 5)
    if fault == "exception":
        assert recorded.exc_type == "InjectedFault"

    r = CliRunner().invoke(main, ["replay", str(bundle), "--times", "3", "--json"])
    d = json.loads(r.stdout)
    assert (d["verdict"], r.exit_code, d["runs"]) == (verdict, code, 3), r.output
    assert d["transient"] is (fault == "transient_nan")
    if fault == "transient_nan":
        # Never "reproduced" (replays do not see it), never passed off as a fix: the note says so.
        assert d["failed_runs"] == d["different_runs"] == 0 and d["fidelity"]["bit_exact"] is False
        assert d["fidelity"]["first_diverging_step"] == 5, "bit-exact up to the failing step"
        human = CliRunner().invoke(main, ["replay", str(bundle), "--times", "2"])
        assert human.exit_code == 0 and "NOT REPRODUCED" in human.output
        assert "note: transient" in human.output and "this is not a fix" in human.output, human.output
        assert "hint:" not in human.output, "the generator/kernel hint contradicts the transient note"
    else:
        assert d["fidelity"]["bit_exact"] and all(run["failure_step"] == 5 for run in d["per_run"])


def test_a_nan_loss_replayed_with_other_code_is_not_called_transient(projects, tmp_path):
    """The transient note needs the recorded code: a --code checkout that fixed the bug is just not reproduced."""
    mod = projects("rk_inject")
    _, exc = record(mod, {}, mod.batches({}, 9), tmp_path / "r", step=mod.nan_loss_step, snapshot_every=4)
    fixed = tmp_path / "fixed"
    fixed.mkdir()
    src = (tmp_path / "r").glob("bundle-*/code/*.py")
    for f in src:
        text = f.read_text()
        if f.name == "rk_inject.py":
            text = text.replace('FaultInjector("nan_loss", steps=[5])', 'FaultInjector("nan_loss", steps=[99])')
        (fixed / f.name).write_text(text)
    r = CliRunner().invoke(main, ["replay", str(bundle_of(exc)), "--code", str(fixed), *entries(bundle_of(exc)), "--json"])
    d = json.loads(r.stdout)
    assert (d["verdict"], r.exit_code, d["transient"]) == ("not_reproduced", 0, False), r.output


def test_a_bare_loop_counts_calls_and_a_transient_fires_once():
    calls = []

    def step(state, batch):
        calls.append(batch)
        return float(batch)

    boom = FaultInjector("exception", steps=[2]).wrap(step)
    assert [boom(None, 0), boom(None, 1)] == [0.0, 1.0]
    with pytest.raises(InjectedFault, match="step 2"):
        boom(None, 2)
    assert calls == [0, 1], "the step did not run"
    once = FaultInjector("transient_nan", steps=[0, 1])
    wrapped = once.wrap(step)
    out = [wrapped(None, i) for i in range(3)]
    assert out[0] != out[0] and out[1] != out[1] and out[2] == 2.0 and once.fired == [0, 1]
    with pytest.raises(reprokit.ReprokitError, match="unknown fault"):
        FaultInjector("nan", steps=[1])
