"""Real training loops on CPU: record a failure, replay it, check what comes back."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from rk_testing import bundle_of, record

import reprokit
from reprokit import bundle as B
from reprokit.bundle import open_bundle, tensorfile


@pytest.mark.slow
def test_nan_after_n_steps_is_recorded_and_replays_bit_exact(projects, tmp_path):
    mlp = projects("rk_mlp")
    cfg = {"optimizer": "adamw", "scheduler": "lambda"}
    rec, exc = record(mlp, cfg, mlp.batches(cfg, 40, poison_step=27), tmp_path, snapshot_every=10)
    assert isinstance(exc, reprokit.TrainingFailure)
    assert exc.failure.kind == "nonfinite_loss" and exc.failure.step == 27
    b = open_bundle(exc.bundle)
    assert b.steps == list(range(20, 28)), "window = last snapshot (step 20) through the failing step"
    assert (b.path / "code" / "rk_mlp.py").is_file(), "the user's module is in the code snapshot"
    report = reprokit.replay(exc.bundle, times=2)
    assert report.reproduced and report.verdict == "deterministic"
    assert report.runs[0].failure.step == 27
    assert report.fidelity["steps_compared"] == 8 and report.fidelity["bit_exact"]
    assert report.fidelity["runs_bit_identical"], "every replay restores the same snapshot"


@pytest.mark.slow
def test_user_exception_is_reraised_unchanged_with_a_note(projects, tmp_path):
    lm = projects("rk_lm")
    cfg = {"vocab": 50, "max_len": 16}
    state = lm.build(cfg)
    rec = reprokit.Recorder(state, lm.train_step, build=lm.build, config=cfg, out_dir=tmp_path, snapshot_every=5)
    batches = list(lm.batches(cfg, 12, oov_step=9))
    for b in batches[:9]:
        rec.step(b)
    with pytest.raises(IndexError) as info:
        rec.step(batches[9])
    exc = info.value
    assert "index out of range" in str(exc)
    assert any(n.startswith("reprokit: bundle written to") for n in exc.__notes__)
    # The traceback still reaches the user's forward, where the lookup failed.
    frames = [f.name for f in __import__("traceback").extract_tb(exc.__traceback__)]
    assert "forward" in frames
    b = open_bundle(bundle_of(exc))
    assert b.failure.kind == "exception" and b.failure.exc_type == "IndexError"
    assert b.failure.frame == "rk_lm.py:forward"
    report = reprokit.replay(b, times=1)
    assert report.reproduced and report.runs[0].failure.step == 9


def test_rare_long_sample_shape_error(projects, tmp_path):
    lm = projects("rk_lm")
    cfg = {"vocab": 30, "max_len": 16}
    _, exc = record(lm, cfg, lm.batches(cfg, 30, long_step=23), tmp_path, snapshot_every=10)
    assert isinstance(exc, RuntimeError) and "must match the size" in str(exc)
    b = open_bundle(bundle_of(exc))
    assert b.steps == [20, 21, 22, 23]
    assert b.failure.signature()["message"].count("N") >= 2, "shape numbers are normalised out"
    assert reprokit.replay(b).reproduced


@pytest.mark.slow
def test_replay_with_a_fixed_checkout_passes(projects, tmp_path):
    mlp = projects("rk_mlp")
    cfg = {"optimizer": "sgd"}
    _, exc = record(mlp, cfg, mlp.batches(cfg, 20, poison_step=13), tmp_path / "out", snapshot_every=5)
    fixed = tmp_path / "checkout"
    shutil.copytree(exc.bundle / "code", fixed)
    src = (fixed / "rk_mlp.py").read_text()
    src = src.replace('        loss = nn.functional.mse_loss(model(batch["x"]).squeeze(-1), batch["y"])\n        loss.backward()',
                      '        x = torch.nan_to_num(batch["x"])  # the fix\n'
                      '        loss = nn.functional.mse_loss(model(x).squeeze(-1), batch["y"])\n        loss.backward()')
    assert "the fix" in src
    (fixed / "rk_mlp.py").write_text(src)
    assert not reprokit.replay(exc.bundle, code=fixed).reproduced
    assert reprokit.replay(exc.bundle).reproduced, "the bundle's own snapshot still fails"
    assert "the fix" not in (exc.bundle / "code" / "rk_mlp.py").read_text()


@pytest.mark.slow
def test_failure_driven_by_urandom_is_flaky_not_deterministic(projects, tmp_path):
    flaky = projects("rk_flaky")
    state = flaky.build({})
    rec = reprokit.Recorder(state, flaky.train_step, build=flaky.build, config={}, out_dir=tmp_path, snapshot_every=1)
    exc = None
    for b in flaky.batches(200):
        try:
            rec.step(b)
        except RuntimeError as e:
            exc = e
            break
    assert exc is not None
    report = reprokit.replay(bundle_of(exc), times=20)
    # One-step window, 50% failure per run: all-or-nothing has probability 2 * 2**-20.
    assert report.verdict == "flaky", report.to_json()
    assert 0 < report.failed_runs < 20 and report.reproduced


@pytest.mark.slow
def test_different_failure_is_not_reported_as_reproduced(projects, tmp_path):
    mlp = projects("rk_mlp")
    cfg = {"optimizer": "sgd"}
    _, exc = record(mlp, cfg, mlp.batches(cfg, 12, poison_step=8), tmp_path / "out", snapshot_every=4)
    broken = tmp_path / "checkout"
    shutil.copytree(exc.bundle / "code", broken)
    src = (broken / "rk_mlp.py").read_text().replace("def train_step(state, batch):\n",
                                                     "def train_step(state, batch):\n    raise KeyError('labels')\n")
    (broken / "rk_mlp.py").write_text(src)
    report = reprokit.replay(exc.bundle, code=broken)
    assert not report.reproduced
    assert report.runs[0].failure.kind == "exception" and report.runs[0].failure.exc_type == "KeyError"
    assert report.to_json()["per_run"][0]["different_failure"] is True


@pytest.mark.parametrize("kind,kw,step_name,batch_kw,expect_step", [
    ("nonfinite_grad", {}, "sqrt_step", {"zero_step": 6}, 6),
    ("nonfinite_param", {"check_params": True}, "corrupting_step", {"corrupt_step": 5}, 5),
    ("loss_spike", {"spike_factor": 50.0, "spike_window": 10}, None, {"spike_step": 14}, 14),
    ("predicate", {}, None, {"spike_step": 14}, 14),
])
@pytest.mark.slow
def test_detectors_fire_and_replay(projects, tmp_path, kind, kw, step_name, batch_kw, expect_step):
    mlp = projects("rk_mlp")
    cfg = {"optimizer": "sgd", "lr": 1e-3}
    if kind == "predicate":
        kw = {"detect": [mlp.loss_above]}
    step = getattr(mlp, step_name) if step_name else None
    _, exc = record(mlp, cfg, mlp.batches(cfg, 20, **batch_kw), tmp_path, step=step, snapshot_every=4, **kw)
    assert isinstance(exc, reprokit.TrainingFailure), exc
    assert exc.failure.kind == kind and exc.failure.step == expect_step
    report = reprokit.replay(exc.bundle)
    assert report.reproduced and report.runs[0].failure.step == expect_step


def test_scaler_collapse(projects, tmp_path):
    mlp = projects("rk_mlp")
    cfg = {"optimizer": "sgd", "scaler": True}

    def batches():
        for i, b in enumerate(mlp.batches(cfg, 60)):
            if i >= 20:
                b["grad_mult"] = float("inf")  # gradients overflow from step 20 on; the loss stays finite
            yield b

    _, exc = record(mlp, cfg, batches(), tmp_path, snapshot_every=8, scaler_patience=5)
    assert isinstance(exc, reprokit.TrainingFailure)
    assert exc.failure.kind == "scaler_collapse" and exc.failure.step == 24
    report = reprokit.replay(exc.bundle)
    assert report.reproduced and report.runs[0].failure.step == 24, "the skip streak is restored with the snapshot"


def test_windows_restart_at_each_snapshot(projects, tmp_path):
    mlp = projects("rk_mlp")
    cfg = {}
    _, exc = record(mlp, cfg, mlp.batches(cfg, 100, poison_step=71), tmp_path, snapshot_every=25)
    b = open_bundle(exc.bundle)
    assert b.steps[0] == 50 and b.steps[-1] == 71 and len(b.steps) == 22
    assert len(b.run["history"]) == 72, "loss history reaches back before the window, for inspect"


@pytest.mark.slow
def test_cpu_batch_edited_in_place_by_the_step_is_recorded_as_given(projects, tmp_path):
    mlp = projects("rk_mlp")
    cfg = {"optimizer": "sgd"}
    batches = list(mlp.batches(cfg, 6, poison_step=5))
    originals = [b["x"].clone() for b in batches]
    _, exc = record(mlp, cfg, batches, tmp_path, step=mlp.scribbling_step, snapshot_every=100)
    b = open_bundle(exc.bundle)
    for k in b.steps:
        torch.testing.assert_close(b.step(k)[0]["x"], originals[k], rtol=0, atol=0, equal_nan=True)
    report = reprokit.replay(b, times=3)
    assert report.verdict == "deterministic" and report.fidelity["runs_bit_identical"], report.fidelity


def test_bundle_written_atomically(projects, tmp_path, monkeypatch):
    from reprokit import bundle as B

    mlp = projects("rk_mlp")
    calls = {"n": 0}
    real = B.BundleWriter.write_bytes

    def dying_write(self, rel, data):
        calls["n"] += 1
        if calls["n"] == 6:
            raise OSError(28, "No space left on device")
        return real(self, rel, data)

    monkeypatch.setattr(B.BundleWriter, "write_bytes", dying_write)
    with pytest.warns(reprokit.RecorderWarning, match="could not write a bundle"):
        _, exc = record(mlp, {}, mlp.batches({}, 12, poison_step=9), tmp_path, snapshot_every=4)
    assert isinstance(exc, reprokit.TrainingFailure) and exc.bundle is None
    assert os.listdir(tmp_path) == [], "the half-written temp dir is removed, nothing else appears"


@pytest.mark.parametrize("part_bytes", [None, 1024])
@pytest.mark.slow
def test_spill_to_disk_snapshots_replay_bit_exact(projects, tmp_path, monkeypatch, part_bytes):
    """Spilled snapshots (in one file, or several at 1 KiB a file) are linked into the bundle, not copied."""
    if part_bytes:
        monkeypatch.setattr(tensorfile, "SHARD_BYTES", part_bytes)
    mlp = projects("rk_mlp")
    cfg = {"optimizer": "adamw", "scheduler": "cosine", "steps": 30}
    rec, exc = record(mlp, cfg, mlp.batches(cfg, 30, poison_step=23), tmp_path / "out", snapshot_every=10,
                      spill_dir=tmp_path / "spill")
    assert isinstance(exc.bundle, os.PathLike) and rec.snapshot_stats["spill_seconds"] > 0
    folders = list((tmp_path / "spill").iterdir())
    assert len(folders) == 1, f"only the last of 3 spilled snapshots is kept: {folders}"
    spilled = sorted(folders[0].glob("part-*.safetensors"), key=lambda p: int(p.stem.split("-")[1]))
    b = reprokit.open_bundle(exc.bundle)
    names = B.state_files(b.manifest["files"])
    assert len(names) == len(spilled) and (len(names) > 1) == bool(part_bytes), names
    for name, part in zip(names, spilled):
        assert (b.path / name).stat().st_ino == part.stat().st_ino, f"{name} is linked in, not copied a second time"
    assert reprokit.verify(exc.bundle) == [], "the digests taken while spilling are the files'"
    report = reprokit.replay(exc.bundle, times=2)
    assert report.fidelity["bit_exact"] and report.fidelity["runs_bit_identical"] and report.reproduced


def test_batches_whose_structure_changes_are_recorded_as_given(projects, tmp_path):
    """Same-keys dicts of tensors reuse the last step's tree; anything else must be encoded afresh."""
    mlp = projects("rk_mlp")
    cfg = {"optimizer": "sgd"}
    base = list(mlp.batches(cfg, 9, poison_step=8))
    given = [
        base[0], base[1],
        {"y": base[2]["y"], "x": base[2]["x"]},  # same keys, other order
        {**base[3], "grad_mult": 1.0},  # a float joins
        {**base[4], "w": torch.ones(3)},  # a third tensor
        {**base[5], "w": [1, 2]},  # a list where a tensor was
        {"x": base[6]["x"], "y": torch.nn.Parameter(base[6]["y"], requires_grad=False)},  # a tensor subclass
        base[7], base[8],
    ]
    given[6]["y"].requires_grad_(False)
    rec, exc = record(mlp, cfg, given, tmp_path, snapshot_every=100)
    ring = rec._ring
    assert ring[1].batch is ring[0].batch and ring[8].batch is ring[7].batch, "the reused-tree path ran"
    b = open_bundle(exc.bundle)
    assert b.steps == list(range(9))
    for k in b.steps:
        got = b.step(k)[0]
        want = given[k]
        assert sorted(got) == sorted(want), k  # (bundles store dict keys sorted)
        for key, value in want.items():
            if isinstance(value, torch.Tensor):
                torch.testing.assert_close(got[key], value.detach(), rtol=0, atol=0, equal_nan=True)
            else:
                assert got[key] == value, (k, key)


def test_step_returns_the_loss_detached_with_the_same_value(projects, tmp_path):
    mlp = projects("rk_mlp")
    cfg = {"optimizer": "adamw"}
    batches = list(mlp.batches(cfg, 4))
    bare = mlp.build(cfg)
    want = [mlp.train_step(bare, b) for b in batches]
    assert all(w.requires_grad for w in want), "the step function returns a loss with its graph"
    state = mlp.build(cfg)
    rec = reprokit.Recorder(state, mlp.train_step, build=mlp.build, config=cfg, out_dir=tmp_path)
    got = [rec.step(b) for b in batches]
    assert all(isinstance(g, torch.Tensor) and not g.requires_grad and g.grad_fn is None for g in got)
    assert [g.item() for g in got] == [w.item() for w in want]
    for p, q in zip(state.model.parameters(), bare.model.parameters()):
        assert torch.equal(p, q), "training is bit-identical with the recorder"
