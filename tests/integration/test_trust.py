"""Every bundle is the run that happened: loaders that reuse buffers, generators the run owns, gradient
accumulation, weights written in forward. Each case replays bit-exact."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from rk_testing import record

import reprokit
from reprokit.bundle import open_bundle


def _replays_exactly(bundle, times=2):
    report = reprokit.replay(bundle, times=times)
    assert report.reproduced and report.verdict == "deterministic", report.to_json()
    assert report.fidelity["bit_exact"] and report.fidelity["runs_bit_identical"], report.fidelity
    return report


@pytest.mark.parametrize("refill", [pytest.param("numpy_view", marks=pytest.mark.slow),
                                    pytest.param("data", marks=pytest.mark.slow), "copy_"])
def test_a_loader_refilling_one_large_buffer_in_place_is_recorded_step_by_step(projects, tmp_path, refill):
    """One >= 1 MB CPU batch tensor, refilled every step; a numpy view or ``.data`` write does not move torch's
    version counter, so only a copy at step start records what each step consumed."""
    mlp = projects("rk_mlp")
    cfg = {"optimizer": "sgd", "dim": 1024, "batch_size": 256, "lr": 1e-4}
    source = list(mlp.batches(cfg, 12, poison_step=10))
    assert source[0]["x"].numel() * 4 >= 1 << 20
    buf = {k: v.clone() for k, v in source[0].items()}

    def loader():
        for b in source:
            for k, v in b.items():
                if refill == "numpy_view":
                    buf[k].numpy()[:] = v.numpy()
                elif refill == "data":
                    buf[k].data[:] = v
                else:
                    buf[k].copy_(v)
            yield buf

    _, exc = record(mlp, cfg, loader(), tmp_path, snapshot_every=5)
    assert isinstance(exc, reprokit.TrainingFailure) and exc.failure.step == 10, exc
    b = open_bundle(exc.bundle)
    assert b.steps == [10], "window: the snapshot at step 10 through the failing step"
    _, exc2 = record(mlp, cfg, loader(), tmp_path / "long", snapshot_every=8)
    b = open_bundle(exc2.bundle)
    assert b.steps == [8, 9, 10]
    for k in b.steps:
        torch.testing.assert_close(b.step(k)[0]["x"], source[k]["x"], rtol=0, atol=0, equal_nan=True)
    _replays_exactly(b)


def test_a_step_that_edits_its_batch_in_place_is_recorded_as_it_received_it(projects, tmp_path):
    mlp = projects("rk_mlp")
    cfg = {"optimizer": "sgd"}
    source = list(mlp.batches(cfg, 9, poison_step=7))
    originals = [b["x"].clone() for b in source]
    _, exc = record(mlp, cfg, source, tmp_path, snapshot_every=4, step=mlp.scribbling_step)
    b = open_bundle(exc.bundle)
    assert b.steps == [4, 5, 6, 7]
    for k in b.steps:
        torch.testing.assert_close(b.step(k)[0]["x"], originals[k], rtol=0, atol=0, equal_nan=True)
    report = reprokit.replay(b)
    assert report.reproduced and report.fidelity["bit_exact"]


def test_generators_kept_in_extra_are_recorded_and_restored(projects, tmp_path):
    trust = projects("rk_trust")
    cfg = {"generators": True}
    rec, exc = record(trust, cfg, trust.batches(30, blow_up_step=23), tmp_path, snapshot_every=10)
    assert isinstance(exc, reprokit.TrainingFailure) and exc.failure.step == 23, exc
    b = open_bundle(exc.bundle)
    owned = b.step(21)[1]["owned"]
    assert sorted(e["kind"] for e in owned) == ["numpy", "python", "torch"]
    assert {tuple(e["path"]) for e in owned} == {("gens", "torch"), ("gens", "numpy", 0), ("gens", "python", 0)}
    _replays_exactly(b)


def test_without_its_generators_recorded_the_same_run_does_not_replay_exactly(projects, tmp_path):
    """The control for the test above: the same draws from a generator outside ``state.extra`` (here: rebuilt
    from its seed by build(), as replay does) make replay diverge. This is what recording them prevents."""
    trust = projects("rk_trust")
    cfg = {"generators": True}
    _, exc = record(trust, cfg, trust.batches(30, blow_up_step=23), tmp_path, snapshot_every=10)
    b = open_bundle(exc.bundle)
    with reprokit.Session(b) as s:
        s.snapshot[0]["rng"].pop("owned")
        steps = s.inputs()
        for inp in steps:
            inp.rng.pop("owned")  # as if the generators had not been recorded
        outcome = s.run(steps)
        assert s.fidelity(outcome)["bit_exact"] is False


@pytest.mark.parametrize("snapshot_every", [pytest.param(9, marks=pytest.mark.slow), 4,
                                            pytest.param(1, marks=pytest.mark.slow)])
def test_gradient_accumulation_replays_exactly_whatever_snapshot_every_is(projects, tmp_path, snapshot_every):
    """Optimizer steps every 4 calls; a snapshot between them must carry the accumulated ``.grad``."""
    trust = projects("rk_trust")
    rec, exc = record(trust, {}, trust.batches(40, blow_up_step=33, accumulate=4), tmp_path,
                      snapshot_every=snapshot_every)
    assert isinstance(exc, reprokit.TrainingFailure) and exc.failure.step == 33, exc
    b = open_bundle(exc.bundle)
    start = b.steps[0]
    tree, tensors = b.state()
    has_grads = any(k.startswith("grads/") for k in tensors)
    assert has_grads == (start % 4 != 0), "gradients are in the snapshot exactly when micro-batches are pending"
    _replays_exactly(b)


def test_an_embedding_with_max_norm_replays_exactly(projects, tmp_path):
    """nn.Embedding(max_norm=...) writes its weight in forward: on CPU the snapshot is a synchronous copy."""
    trust = projects("rk_trust")
    cfg = {"max_norm": 0.5}
    _, exc = record(trust, cfg, trust.batches(20, blow_up_step=14), tmp_path, snapshot_every=6)
    _replays_exactly(exc.bundle)


def test_no_reads_of_generators_behind_their_api_while_recording(projects, tmp_path, monkeypatch):
    """The recorder's RNG reads are the public ones: every step calls them (no cache that could go stale)."""
    calls = {"n": 0}
    real = np.random.get_state

    def counting(*a, **kw):
        calls["n"] += 1
        return real(*a, **kw)

    monkeypatch.setattr(np.random, "get_state", counting)
    mlp = projects("rk_mlp")
    cfg = {"optimizer": "sgd"}
    record(mlp, cfg, mlp.batches(cfg, 6), tmp_path, snapshot_every=100)
    assert calls["n"] >= 6
