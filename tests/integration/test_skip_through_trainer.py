"""``ReprokitCallback(on_failure="skip")`` on a real Hugging Face ``Trainer`` (tiny GPT-2, CPU, dropout on, two
micro-batches per update): two poisoned samples are skipped row by row inside their micro-batches, and the Trainer
ends bit-identical to one whose collator never let those samples into their batches (same seed, same sampler order).
The Lightning callback refuses the option (see tests/unit/test_skip_options.py)."""

from __future__ import annotations

import warnings

import pytest
import rk_hf_guard  # noqa: F401 - skips this module where transformers has no torch
import torch
from rk_hf_data import SEQ, VOCAB, D, tiny
from transformers import Trainer, TrainingArguments

import reprokit
from reprokit.integrations.transformers import ReprokitCallback
from reprokit.skip_journal import read_journal

pytestmark = pytest.mark.slow

BAD = [100, 200]


class Rows(torch.utils.data.Dataset):
    """``inputs_embeds`` and labels; the rows in ``bad`` hold a NaN. Items carry their index for the collator."""

    def __init__(self, n: int, bad: list[int]):
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, SEQ, D, generator=g)
        self.y = torch.randint(0, VOCAB, (n, SEQ), generator=g)
        for i in bad:
            self.x[i, 2, 3] = float("nan")

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict:
        return {"inputs_embeds": self.x[i], "labels": self.y[i], "idx": i}


def collator(drop: set[int]):
    def collate(items: list[dict]) -> dict:
        kept = [it for it in items if it["idx"] not in drop]
        return {"inputs_embeds": torch.stack([it["inputs_embeds"] for it in kept]),
                "labels": torch.stack([it["labels"] for it in kept])}

    return collate


def fit(out, drop: set[int], callbacks: list) -> Trainer:
    args = TrainingArguments(output_dir=str(out), per_device_train_batch_size=8, gradient_accumulation_steps=2, seed=3,
                             max_steps=12, report_to=[], logging_strategy="no", save_strategy="no", disable_tqdm=True,
                             use_cpu=True, remove_unused_columns=False)
    trainer = Trainer(model=tiny(), args=args, train_dataset=Rows(256, BAD), data_collator=collator(drop),
                      callbacks=callbacks)
    trainer.train()
    return trainer


def test_two_poisoned_samples_are_skipped_through_the_trainer_callback(tmp_path):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        skipping = fit(tmp_path / "skip", set(), [ReprokitCallback(out_dir=tmp_path / "repros", snapshot_every=4,
                                                                   on_failure="skip")])
    clean = fit(tmp_path / "clean", set(BAD), [])
    for (name, a), (_, b) in zip(skipping.model.state_dict().items(), clean.model.state_dict().items()):
        assert torch.equal(a, b), name
    opt_a, opt_b = skipping.optimizer.state_dict()["state"], clean.optimizer.state_dict()["state"]
    assert all(torch.equal(v, opt_b[k][n]) for k, st in opt_a.items() for n, v in st.items())
    assert skipping.lr_scheduler.state_dict() == clean.lr_scheduler.state_dict()
    assert skipping.state.global_step == clean.state.global_step == 12

    entries = read_journal(tmp_path / "repros")
    assert sorted(i for e in entries for i in e["dataset_indices"]) == BAD
    assert all(len(e["rows"]) == 1 and len(e["rows"][0]) == 2 for e in entries)  # (micro-batch, row)
    assert reprokit.skip_list(tmp_path / "repros") == BAD
    said = [str(w.message) for w in caught if issubclass(w.category, reprokit.RecorderWarning)]
    assert sum("skipped dataset indices" in s for s in said) == 2
