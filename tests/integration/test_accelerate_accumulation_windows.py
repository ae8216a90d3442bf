"""accelerate's gradient accumulation (``accelerator.accumulate``): its step counter is in no state_dict and replay
starts a fresh one, so a window must start right after a synced step and not run over a dataloader's early sync."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner
from rk_testing import bundle_of

import reprokit
from reprokit.bundle import open_bundle
from reprokit.cli import main


def train(acc, config, dataset, out, epochs=1, **recorder):
    state = acc.build(config)
    rec = reprokit.Recorder(state, acc.train_step, build=acc.build, config=config, out_dir=out, **recorder) \
        if out else None
    try:
        for _ in range(epochs):
            for batch in acc.loader(dataset):
                rec.step(batch) if rec else acc.train_step(state, batch)
    finally:
        if rec:
            rec.close()
    return state.model


def replayed(bundle) -> dict:
    out = CliRunner().invoke(main, ["replay", str(bundle), "--json"])
    assert out.exit_code == 1, out.output
    return json.loads(out.output)


@pytest.mark.parametrize("precision", ["no", "bf16"])
@pytest.mark.slow
def test_a_snapshot_due_mid_accumulation_waits_for_the_synced_step(projects, tmp_path, precision):
    """snapshot_every=3 with accumulation over 2: the snapshot due at step 3 (mid-accumulation) is taken at step 4,
    so replay's fresh Accelerator syncs where the run did (at 3 it replayed another update: not bit-exact)."""
    acc = projects("rk_accumulate")
    config = {"accumulate": 2, "precision": precision}
    plain = train(acc, config, acc.Rows(40), None)
    recorded = train(acc, config, acc.Rows(40), tmp_path / "clean", snapshot_every=3)
    assert all(torch.equal(a, b) for a, b in zip(plain.state_dict().values(), recorded.state_dict().values(),
                                                 strict=True))
    with pytest.raises(reprokit.TrainingFailure) as info:
        train(acc, config, acc.Rows(40, bad=21), tmp_path / "repros", snapshot_every=3)  # row 21: step 5
    b = open_bundle(bundle_of(info.value))
    d = replayed(b.path)
    assert d["verdict"] == "deterministic" and d["fidelity"]["bit_exact"], d["fidelity"]
    assert (b.failure.kind, b.failure.step, b.run["window"]["steps"]) == ("nonfinite_loss", 5, [4, 5])


@pytest.mark.slow
def test_a_window_restarts_after_the_early_sync_of_an_epochs_last_batch(projects, tmp_path):
    """10 batches an epoch, accumulation over 4: accelerate syncs at steps 3, 7 and early at 9 (the last batch),
    then at 13. A window from step 8 over step 9 replayed 9 without that sync (no dataloader in replay)."""
    acc = projects("rk_accumulate")
    with pytest.raises(reprokit.TrainingFailure) as info:  # row 13's second read: step 13 (epoch 2, batch 3)
        train(acc, {"accumulate": 4}, acc.Rows(40, bad=13, nth=2), tmp_path / "repros", epochs=2, snapshot_every=4)
    b = open_bundle(bundle_of(info.value))
    d = replayed(b.path)
    assert d["verdict"] == "deterministic" and d["fidelity"]["bit_exact"], d["fidelity"]
    assert (b.failure.step, b.run["window"]["steps"]) == (13, [10, 11, 12, 13])


def test_a_torn_snapshot_mid_accumulation_is_replaced_at_the_synced_step(projects, tmp_path):
    """A torn snapshot (a tensor written while its asynchronous copy was in flight: on a GPU only, simulated here by
    setting the engine's own ``torn``, which is what its version check sets) is replaced by a new one, but under
    accelerate's accumulation not mid-update: it was taken at once, at step 3 (mid-accumulation over 2), so replay's
    fresh Accelerator synced at other steps than the run. Now the new snapshot waits for step 4 (synced)."""
    acc = projects("rk_accumulate")
    config = {"accumulate": 2}
    state = acc.build(config)
    rec = reprokit.Recorder(state, acc.train_step, build=acc.build, config=config, out_dir=tmp_path / "repros",
                            snapshot_every=100)
    try:
        with pytest.warns(reprokit.RecorderWarning, match="not the state that step started from"), \
                pytest.raises(reprokit.TrainingFailure) as info:
            for k, batch in enumerate(acc.loader(acc.Rows(40, bad=21))):  # row 21: step 5
                if k == 3:
                    rec._engine.torn = "1 tensor(s) (simulated) were written while being copied"
                rec.step(batch)
    finally:
        rec.close()
    b = open_bundle(bundle_of(info.value))
    assert (b.failure.step, b.run["window"]["steps"]) == (5, [4, 5]), b.run["window"]
    d = replayed(b.path)
    assert d["verdict"] == "deterministic" and d["fidelity"]["bit_exact"], d["fidelity"]
