"""`reprokit extract` of a NaN bundle only succeeds when the module alone makes the NaN again."""

from __future__ import annotations

import pytest
import torch
from rk_testing import bundle_of, record
from safetensors.torch import load_file

from reprokit.bundle import open_bundle
from reprokit.errors import DidNotReproduce
from reprokit.extract import extract


def _bundle(projects, tmp_path, attr):
    m = projects("rk_detect_cases")
    _, exc = record(m, {"attr": attr}, m.batches(8, zero_row=5), tmp_path / "repros", snapshot_every=4)
    return open_bundle(bundle_of(exc))


@pytest.mark.slow
def test_a_module_keeping_its_settings_in_a_dict_is_extracted_with_them(projects, tmp_path):
    b = _bundle(projects, tmp_path, "dict")
    assert (b.failure.kind, b.failure.step) == ("nonfinite_loss", 5)
    got = extract(b, tmp_path / "extract")
    # Before: the dict was left behind, the module alone raised AttributeError, and that was written as the repro.
    assert (got.module, got.cls, got.phase) == ("n", "Norm", "forward")
    assert got.failure.startswith("FloatingPointError: the module's output"), got.failure
    assert not got.notes, got.notes


@pytest.mark.slow
def test_a_module_that_fails_alone_for_another_reason_is_no_extract_of_a_nan(projects, tmp_path):
    b = _bundle(projects, tmp_path, "namespace")
    with pytest.raises(DidNotReproduce) as e:
        extract(b, tmp_path / "extract")
    msg = str(e.value)
    assert "module n (Norm) alone raises AttributeError" in msg and "non-finite loss at step 5" in msg, msg
    assert "attributes not carried (not plain data): opts (SimpleNamespace)" in msg, msg


@pytest.mark.parametrize("probe", [False, True])
@pytest.mark.slow
def test_a_module_called_twice_is_extracted_at_the_call_whose_backward_made_the_nan(projects, tmp_path, probe):
    # probe: a third call under no_grad, which backward does not visit (before, it shifted the calls' gradients)
    m = projects("rk_detect_cases")
    _, exc = record(m, {"model": "twice", "probe": probe}, m.twice_batches(8, gate_off=5), tmp_path / "repros",
                    step=m.twice_step, snapshot_every=4)
    b = open_bundle(bundle_of(exc))
    assert (b.failure.kind, b.failure.step) == ("nonfinite_grad", 5)
    got = extract(b, tmp_path / "extract")
    assert (got.module, got.cls, got.phase) == ("shared", "Root", "backward")
    batch = load_file(str(got.output / "steps" / "00000000.safetensors"))
    # The second call (zeroed input), with the finite gradient it received. Before: the first call, fed the NaN
    # gradient the second one made, so the "repro" only showed NaN in, NaN out.
    assert bool(torch.isfinite(batch["batch/grad_outputs/0"]).all()), batch["batch/grad_outputs/0"]
    assert bool((batch["batch/args/0"] == 0).all()), batch["batch/args/0"]
    assert got.failure.startswith("FloatingPointError: the gradient of"), got.failure


@pytest.mark.slow
def test_a_module_taking_an_options_object_is_refused_for_that_reason(projects, tmp_path):
    m = projects("rk_detect_cases")
    _, exc = record(m, {"model": "options"}, m.batches(8, scale_at=(5, 1000.0)),
                    tmp_path / "repros", snapshot_every=4)
    b = open_bundle(bundle_of(exc))
    assert (b.failure.kind, b.failure.step) == ("nonfinite_loss", 5)
    with pytest.raises(DidNotReproduce) as e:
        extract(b, tmp_path / "extract")
    msg = str(e.value)  # before: "does not fail the same way (its failure may need state it does not hold)"
    assert "module soft (Tempered) takes an input that a bundle cannot hold" in msg, msg
    assert "batch/args/1: cannot record a value of type SimpleNamespace" in msg, msg


def test_a_loss_spike_has_no_module_to_cut_out_and_says_so(projects, tmp_path):
    from reprokit.extract import NothingToExtract

    m = projects("rk_detect_cases")
    _, exc = record(m, {}, m.batches(20, spike=(15, 100.0)), tmp_path / "repros", snapshot_every=4,
                    spike_factor=20.0, spike_window=10)
    b = open_bundle(bundle_of(exc))
    assert b.failure.kind == "loss_spike"
    with pytest.raises(NothingToExtract) as e:
        extract(b, tmp_path / "extract")
    msg = str(e.value)  # before: "first seen in None with inputs already non-finite: unknown (...)"
    assert "loss spike at step 15" in msg and "no value went non-finite and nothing raised" in msg, msg
    assert "None" not in msg and not (tmp_path / "extract").exists()


@pytest.mark.slow
def test_a_nan_made_in_place_says_why_there_is_no_one_op_repro(projects, tmp_path):
    got = extract(_bundle(projects, tmp_path, "inplace"), tmp_path / "extract")
    assert (got.module, got.op) == ("n", None)
    assert got.failure.startswith("FloatingPointError: the module's output"), got.failure
    # before: no op line and no note at all
    assert any("aten.div_.Tensor made it, writing in place" in n for n in got.notes), got.notes
