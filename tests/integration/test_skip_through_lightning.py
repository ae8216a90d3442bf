"""``ReprokitCallback(on_failure="skip")`` on a real Lightning ``Trainer`` (tests/projects/rk_lightning.py: a tiny
LM with dropout on, AdamW, a per-step or per-epoch LR scheduler, CPU): two poisoned samples (every label ignored,
so their loss is 0/0 = NaN) are skipped, and the run ends bit-identical to one whose batches never held them (same
seed, same batches otherwise), with Lightning's counters where that run left them. What the callback cannot skip is
refused before the first batch; an exception inside a step is never skipped."""

from __future__ import annotations

import warnings

import lightning  # noqa: F401  the test extra installs it: a missing one must fail, not skip
import pytest
import torch
from rk_testing import bundle_of
from torch.utils.data import DataLoader

import reprokit
from reprokit.skip_journal import read_journal

pytestmark = [
    pytest.mark.slow,  # importing Lightning alone takes seconds
    pytest.mark.filterwarnings("ignore::lightning.fabric.utilities.warnings.PossibleUserWarning"),
    pytest.mark.filterwarnings("ignore:.*isinstance\\(treespec, LeafSpec\\).*:FutureWarning"),
]

N, BS = 32, 4
BAD = [6, 22]  # batch 1 row 2, batch 5 row 2


def _batches(drop: set[int]) -> list[list[int]]:
    """The same sequential batches of BS indices, less those in ``drop``: the batches of a run whose data never held
    them, in the same order."""
    return [[i for i in range(s, s + BS) if i not in drop] for s in range(0, N, BS)]


def _same_run(a, b):
    (ta, ma, rng_a), (tb, mb, rng_b) = a, b
    for (name, x), (_, y) in zip(ma.state_dict().items(), mb.state_dict().items(), strict=True):
        assert torch.equal(x, y), name
    oa, ob = ta.optimizers[0].state_dict(), tb.optimizers[0].state_dict()
    assert oa["param_groups"] == ob["param_groups"]
    for k, st in oa["state"].items():
        for n, v in st.items():
            assert torch.equal(v, ob["state"][k][n]), (k, n)
    assert ta.lr_scheduler_configs[0].scheduler.state_dict() == tb.lr_scheduler_configs[0].scheduler.state_dict()
    assert torch.equal(rng_a, rng_b)  # the dropout draws of the skipped batches: those of the smaller batch
    # Lightning's own counters: optimizer steps (global_step), batches, epochs, scheduler steps.
    la, lb = ta.fit_loop, tb.fit_loop
    assert ta.global_step == tb.global_step
    assert la.epoch_loop.automatic_optimization.optim_progress.state_dict() == \
        lb.epoch_loop.automatic_optimization.optim_progress.state_dict()
    assert la.epoch_loop.batch_progress.state_dict() == lb.epoch_loop.batch_progress.state_dict()
    assert la.epoch_loop.scheduler_progress.state_dict() == lb.epoch_loop.scheduler_progress.state_dict()
    assert la.epoch_progress.state_dict() == lb.epoch_progress.state_dict()
    assert la.epoch_loop._batches_that_stepped == lb.epoch_loop._batches_that_stepped


class _Losses(lightning.pytorch.Callback):
    """The loss Lightning hands ``on_train_batch_end`` after each batch."""

    def __init__(self):
        self.seen = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.seen.append(outputs["loss"].item())


@pytest.mark.parametrize("module_name, epochs, max_skips", [
    ("TinyLit", 1, 3),  # a per-step LambdaLR warmup: stepped once per batch by Lightning, the skipped ones too
    # A per-epoch StepLR over two epochs: the bad samples come back in the second, and batch 7 (sample 30) ends an
    # epoch, so its skip lands where Lightning steps the epoch scheduler.
    ("EpochStepLR", 2, 6),
])
def test_two_poisoned_samples_are_skipped_through_the_lightning_callback(projects, tmp_path, module_name, epochs,
                                                                         max_skips):
    from reprokit.integrations.lightning import ReprokitCallback

    L = projects("rk_lightning")
    bad = BAD if epochs == 1 else [*BAD, 30]
    cls = getattr(L, module_name)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cb = ReprokitCallback(out_dir=tmp_path / "repros", snapshot_every=3, on_failure="skip", max_skips=max_skips)
        losses, clean_losses = _Losses(), _Losses()
        skipping = _fit_with(L, cls, [cb, losses], bad, set(), max_epochs=epochs)
    clean = _fit_with(L, cls, [clean_losses], bad, set(bad), max_epochs=epochs)
    _same_run(skipping, clean)
    # A skipped batch's output, as Lightning hands it on, is the batch's without the culprit rows.
    assert losses.seen == clean_losses.seen and len(losses.seen) == epochs * N // BS
    assert skipping[0].global_step == epochs * N // BS

    entries = read_journal(tmp_path / "repros")
    assert [i for e in entries for i in e["dataset_indices"]] == bad * epochs
    assert all(len(e["rows"]) == 1 and e["evidence"]["without_culprits"]["verdict"] == "passed" for e in entries)
    assert reprokit.skip_list(tmp_path / "repros") == sorted(bad)
    said = [str(w.message) for w in caught if issubclass(w.category, reprokit.RecorderWarning)]
    assert sum("skipped dataset indices" in s for s in said) == len(bad) * epochs


def _fit_with(L, module_cls, callbacks, bad, drop, **trainer_kw):
    torch.manual_seed(7)
    module = module_cls()
    trainer = L.trainer(callbacks, **trainer_kw)
    ds = L.Tokens(n=N)
    for i in bad:
        ds.labels[i] = -100  # no target: the sample's loss is 0 / 0 = NaN, and so is its batch's mean
    trainer.fit(module, DataLoader(ds, batch_sampler=_batches(drop), num_workers=0))
    return trainer, module, torch.get_rng_state()


class _GradNorms(lightning.pytorch.Callback):
    """Reads the gradients inside the batch's optimization, as gradient-norm loggers do."""

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        pass


@pytest.mark.parametrize("module_kw, trainer_kw, extra, words", [
    ({"manual": True}, {}, None, "manual optimization (automatic_optimization = False)"),
    ({}, {"accumulate_grad_batches": 2}, None, "gradient accumulation (accumulate_grad_batches=2"),
    ({}, {}, _GradNorms, "callback hooks that run inside the batch's optimization "
                         "(_GradNorms.on_before_optimizer_step)"),
])
def test_what_a_skip_cannot_undo_is_refused_before_the_first_batch(projects, tmp_path, module_kw, trainer_kw, extra,
                                                                    words):
    from reprokit.integrations.lightning import ReprokitCallback

    L = projects("rk_lightning")
    cb = ReprokitCallback(out_dir=tmp_path / "repros", on_failure="skip")
    trainer = L.trainer([cb] + ([extra()] if extra else []), **trainer_kw)
    with pytest.raises(reprokit.ConfigError, match=r"on_failure=\"skip\" through the Lightning callback cannot skip "
                                                   r"in this run: ") as info:
        trainer.fit(L.TinyLit(**module_kw), L.loader(L.Tokens(n=N), BS))
    assert words in str(info.value) and "Record with on_failure=\"raise\" (the default)" in str(info.value)
    assert trainer.global_step == 0 and trainer.fit_loop.epoch_loop.batch_progress.total.ready == 0
    assert not (tmp_path / "repros").exists() or not any((tmp_path / "repros").iterdir())


def test_an_exception_inside_a_step_is_never_skipped(projects, tmp_path):
    from reprokit.integrations.lightning import ReprokitCallback

    L = projects("rk_lightning")
    cb = ReprokitCallback(out_dir=tmp_path / "repros", snapshot_every=3, on_failure="skip")
    trainer = L.trainer([cb])
    with pytest.raises(IndexError) as info:  # sample 21 (batch 5) holds an id past the vocab
        trainer.fit(L.TinyLit(), L.loader(L.Tokens(n=N, oov=21), BS))
    notes = "\n".join(getattr(info.value, "__notes__", []))
    assert "did not skip step 5 (kind)" in notes and "end_step(exc=...)" in notes
    assert bundle_of(info.value).exists()
    assert read_journal(tmp_path / "repros") == []


def test_skip_indices_leave_the_batches_lightning_trains_on(projects, tmp_path):
    # A run given the skipping run's skip_list trains on the batches it trained on: bit-identical to the clean run.
    from reprokit.integrations.lightning import ReprokitCallback

    L = projects("rk_lightning")
    cb = ReprokitCallback(out_dir=tmp_path / "repros", skip_indices=BAD)
    resumed = _fit_with(L, L.TinyLit, [cb], BAD, set())
    clean = _fit_with(L, L.TinyLit, [], BAD, set(BAD))
    _same_run(resumed, clean)
