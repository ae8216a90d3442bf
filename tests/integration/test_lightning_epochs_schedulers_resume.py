"""Lightning as a demanding user runs it: several epochs, a validation loop between batches, accumulation, clipping
and bf16 autocast, and the default per-epoch LR scheduler stepping inside the replayed window."""

from __future__ import annotations

import json

import lightning.pytorch as pl
import pytest
import torch
from click.testing import CliRunner
from rk_testing import bundle_of

import reprokit
from reprokit.bundle import open_bundle
from reprokit.cli import main

pytestmark = [
    pytest.mark.slow,  # importing Lightning alone takes seconds, and each case fits over epochs
    pytest.mark.filterwarnings("ignore::lightning.fabric.utilities.warnings.PossibleUserWarning"),
    pytest.mark.filterwarnings("ignore:.*isinstance\\(treespec, LeafSpec\\).*:FutureWarning"),
]


def late_tokens(L, n: int, bad: int, nth: int):
    """``L.Tokens(n)`` whose sample ``bad`` loses every label on its ``nth`` read only (a failure in a later epoch)."""

    class Late(L.Tokens):
        reads = 0

        def __getitem__(self, i):
            item = super().__getitem__(i)
            if i == bad:
                Late.reads += 1
                if Late.reads == nth:
                    item = {**item, "labels": torch.full_like(item["labels"], -100)}
            return item

    return Late(n=n)


def fit(L, module_cls, data, out, **trainer_kw):
    from reprokit.integrations.lightning import ReprokitCallback

    pl.seed_everything(0)
    module = module_cls()
    callbacks = [ReprokitCallback(out_dir=out, snapshot_every=5)] if out else []
    trainer = L.trainer(callbacks, **trainer_kw)
    trainer.fit(module, L.loader(data))
    return module


def replayed(bundle) -> dict:
    out = CliRunner().invoke(main, ["replay", str(bundle), "--json"])
    assert out.exit_code == 1, out.output
    return json.loads(out.output)


def test_a_per_epoch_scheduler_inside_the_window_replays_bit_exact(projects, tmp_path):
    """``[opt], [StepLR]`` steps after each epoch's last batch, outside Lightning's per-batch optimization: a window
    over an epoch boundary replayed the next epoch's steps at the old LR (losses diverged, a failure that depends on
    them could read "not reproduced")."""
    L = projects("rk_lightning")
    # 10 samples, batch 4: 3 batches an epoch (steps 0-2, 3-5, 6-8); sample 9's third read is step 8's batch.
    with pytest.raises(reprokit.TrainingFailure) as info:
        fit(L, L.EpochStepLR, late_tokens(L, 10, 9, 3), tmp_path / "repros", max_epochs=4)
    b = open_bundle(bundle_of(info.value))
    assert (b.failure.kind, b.failure.step, b.run["window"]["steps"]) == ("nonfinite_loss", 8, [5, 6, 7, 8])
    lrs = {h["step"]: h["lr"] for h in b.run["history"]}
    assert lrs[5] > lrs[6], "the window spans the epoch boundary where StepLR cuts the LR"
    d = replayed(b.path)
    assert d["verdict"] == "deterministic" and d["fidelity"]["bit_exact"] and d["fidelity"]["steps_compared"] == 4


def test_validation_accumulation_clipping_bf16_over_epochs_leave_training_unchanged_and_replay(projects, tmp_path):
    """Validation every 2 batches (eval between steps), accumulation over 2 (the epoch's odd last batch steps alone),
    clipping and bf16-mixed over 3 epochs: weights with the callback are those without it; the NaN of the second
    epoch is recorded at its batch and replays bit-exact."""
    L = projects("rk_lightning")

    kw = {"max_epochs": 3, "accumulate_grad_batches": 2, "gradient_clip_val": 0.5, "precision": "bf16-mixed",
          "val_check_interval": 2, "num_sanity_val_steps": 0}

    def fit_val(data, out):
        from reprokit.integrations.lightning import ReprokitCallback

        pl.seed_everything(0)
        module = L.WithVal()
        trainer = L.trainer([ReprokitCallback(out_dir=out, snapshot_every=3)] if out else [], **kw)
        trainer.fit(module, L.loader(data), L.loader(L.Tokens(n=4)))
        return module

    plain, recorded = fit_val(L.Tokens(n=10), None), fit_val(L.Tokens(n=10), tmp_path / "clean")
    assert all(torch.equal(a, b) for a, b in zip(plain.state_dict().values(), recorded.state_dict().values(),
                                                 strict=True))
    with pytest.raises(reprokit.TrainingFailure) as info:
        fit_val(late_tokens(L, 10, 9, 2), tmp_path / "repros")  # sample 9: the last batch of each epoch
    b = open_bundle(bundle_of(info.value))
    assert b.failure.step == 5 and b.step(5)[0]["lightning"] == {"batch_idx": 2, "optimizer_step": True,
                                                                 "epoch_end": True, "epoch": 1}
    d = replayed(b.path)
    assert d["verdict"] == "deterministic" and d["fidelity"]["bit_exact"] and d["fidelity"]["steps_compared"] == 3


@pytest.mark.filterwarnings("ignore:Be aware that when using `ckpt_path`:UserWarning")  # the resumed fit's own
def test_a_fit_resumed_from_a_checkpoint_numbers_its_steps_from_the_checkpoint(projects, tmp_path):
    """``fit(ckpt_path=...)`` goes on from the checkpoint's batch: the bundle's step is that batch's index in the whole
    run (the Trainer's global step here, no accumulation), not the count since the resumed fit started."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    from reprokit.integrations.lightning import ReprokitCallback

    L = projects("rk_lightning")
    data = late_tokens(L, 40, 30, 1)  # 10 batches an epoch; sample 30 first read in epoch 1, batch 7: batch 17
    quiet = {"accelerator": "cpu", "devices": 1, "logger": False, "enable_progress_bar": False,
             "enable_model_summary": False, "default_root_dir": tmp_path}
    pl.seed_everything(0)
    first = pl.Trainer(callbacks=[ModelCheckpoint(dirpath=tmp_path / "ck", every_n_train_steps=3)], max_steps=3,
                       **quiet)
    first.fit(L.TinyLit(), L.loader(data))
    (ckpt,) = (tmp_path / "ck").iterdir()
    seen = []

    class Steps(pl.Callback):
        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            seen.append(trainer.global_step)

    pl.seed_everything(0)
    resumed = pl.Trainer(callbacks=[ReprokitCallback(out_dir=tmp_path / "repros", snapshot_every=4), Steps()],
                         max_epochs=2, enable_checkpointing=False, **quiet)
    with pytest.raises(reprokit.TrainingFailure) as info:
        resumed.fit(L.TinyLit(), L.loader(data), ckpt_path=ckpt)
    assert seen[0] == 3 and info.value.failure.step == seen[-1] == 17
    d = replayed(bundle_of(info.value))
    assert d["verdict"] == "deterministic" and d["fidelity"]["bit_exact"]


def test_a_window_starts_again_after_a_plateau_schedulers_epoch_end(projects, tmp_path):
    """ReduceLROnPlateau steps on a metric between epochs, which replay cannot recompute: the recorder takes a new
    snapshot after each epoch end, so no window runs over a cut it would replay at the old LR."""
    L = projects("rk_lightning")
    with pytest.raises(reprokit.TrainingFailure) as info:
        fit(L, L.PlateauLit, late_tokens(L, 10, 9, 3), tmp_path / "repros", max_epochs=4)
    b = open_bundle(bundle_of(info.value))
    lrs = {h["step"]: h["lr"] for h in b.run["history"]}
    assert lrs[5] > lrs[6], "the plateau scheduler cut the LR after step 5, the end of epoch 1"
    d = replayed(b.path)
    assert d["verdict"] == "deterministic" and d["fidelity"]["bit_exact"], d["fidelity"]
    assert (b.failure.step, b.run["window"]["steps"]) == (8, [6, 7, 8])


def test_hyperparameters_without_a_json_form_are_refused_with_what_to_do(projects, tmp_path):
    from reprokit.errors import CaptureError
    from reprokit.integrations.lightning import ReprokitCallback

    L = projects("rk_lightning")
    with pytest.raises(CaptureError, match=r"type Shape.*Replay rebuilds ShapedLit.*save_hyperparameters\(ignore="):
        L.trainer([ReprokitCallback(out_dir=tmp_path / "r")]).fit(L.ShapedLit(), L.loader(L.Tokens()))


def test_a_window_starts_again_after_a_validation_that_steps_a_plateau_scheduler(projects, tmp_path):
    """With ``val_check_interval``, Lightning steps an ``interval="step"`` ReduceLROnPlateau after each validation,
    between training batches of an epoch: the batch after a validation starts a window of its own."""
    from reprokit.integrations.lightning import ReprokitCallback

    L = projects("rk_lightning")
    pl.seed_everything(0)
    trainer = L.trainer([ReprokitCallback(out_dir=tmp_path / "repros", snapshot_every=5)], val_check_interval=2,
                        num_sanity_val_steps=0)
    with pytest.raises(reprokit.TrainingFailure) as info:  # sample 17 in batch 4; validation after batches 1 and 3
        trainer.fit(L.ValPlateauLit(), L.loader(L.Tokens(ignored=17)), L.loader(L.Tokens(n=4)))
    b = open_bundle(bundle_of(info.value))
    lrs = {h["step"]: h["lr"] for h in b.run["history"]}
    assert lrs[1] > lrs[2] == lrs[3], lrs  # cut by the first validation, after batch 1
    d = replayed(b.path)
    assert d["verdict"] == "deterministic" and d["fidelity"]["bit_exact"], d["fidelity"]
    assert (b.failure.step, b.run["window"]["steps"]) == (4, [2, 3, 4])
