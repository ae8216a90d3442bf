"""A tiny LightningModule language model on a synthetic dataset (tests of reprokit.integrations.lightning)."""

from __future__ import annotations

import dataclasses

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset


class TinyLit(pl.LightningModule):
    def __init__(self, vocab: int = 20, d: int = 8, lr: float = 0.05, manual: bool = False, warmup: int = 3,
                 guard: bool = False):
        super().__init__()
        self.save_hyperparameters()
        self.automatic_optimization = not manual
        self.tok = nn.Embedding(vocab, d)
        self.drop = nn.Dropout(0.1)  # draws from the global RNG: replay must restore it per step
        self.head = nn.Linear(d, vocab)

    def forward(self, ids):
        return self.head(torch.tanh(self.drop(self.tok(ids))))

    def loss(self, batch):
        logits, labels = self(batch["input_ids"]), batch["labels"]
        ce = nn.functional.cross_entropy(logits.transpose(1, 2), labels, ignore_index=-100, reduction="none")
        mask = (labels != -100).float()
        count = mask.sum(1)
        z = (logits.logsumexp(-1) ** 2 * mask).sum(1)  # a z-loss on the labelled positions
        per_sample = (ce.sum(1) + 1e-4 * z) / count  # a sample with every label ignored: 0 / 0 = nan
        if self.hparams.guard:  # the usual "fix": a finite loss, but 0 * (1 / 0) = nan in its backward
            per_sample = torch.where(count > 0, per_sample, 0.0)
        return per_sample.mean()

    def training_step(self, batch, batch_idx):
        loss = self.loss(batch)
        self.log("train_loss", loss)
        if self.automatic_optimization:
            return loss
        opt = self.optimizers()
        opt.zero_grad()
        self.manual_backward(loss)
        self.clip_gradients(opt, gradient_clip_val=1.0, gradient_clip_algorithm="norm")
        opt.step()
        self.lr_schedulers().step()
        return loss

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)
        warm = self.hparams.warmup
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warm))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class Tokens(Dataset):
    """``n`` sequences of ``seq`` ids; sample ``oov`` holds an id past the vocab, sample ``ignored`` has every label
    -100 (a batch of only that sample has no target: NaN loss). Each sample carries its dataset ``index``."""

    def __init__(self, n: int = 32, seq: int = 6, vocab: int = 20, oov: int | None = None, ignored: int | None = None):
        g = torch.Generator().manual_seed(3)
        self.ids = torch.randint(0, vocab, (n, seq), generator=g)
        self.labels = torch.randint(0, vocab, (n, seq), generator=g)
        if oov is not None:
            self.ids[oov, 2] = vocab + 5
        if ignored is not None:
            self.labels[ignored] = -100
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.labels[i], "index": i}


def loader(dataset, batch_size=4):
    return DataLoader(dataset, batch_size=batch_size, shuffle=False, num_workers=0)


def trainer(callbacks, devices=1, max_epochs=1, **kw):
    return pl.Trainer(accelerator="cpu", devices=devices, max_epochs=max_epochs, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks, **kw)


class Unsaved(TinyLit):
    """Takes a required argument but never saves it: replay could not rebuild it."""

    def __init__(self, width: int):
        super().__init__(d=width)


class EpochStepLR(TinyLit):
    """configure_optimizers in its shortest form: ``[opt], [sched]``, a scheduler Lightning steps once per epoch."""

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)
        return [opt], [torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.1)]


class WithVal(TinyLit):
    """A validation loop too: Lightning runs it between training batches."""

    def validation_step(self, batch, batch_idx):
        return self.loss(batch)


class PlateauLit(TinyLit):
    """ReduceLROnPlateau on the logged training loss (``mode="max"``, no patience: it cuts the LR every epoch end
    after the first); Lightning steps it between epochs, on the metric, outside any batch."""

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)
        sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, mode="max", factor=0.1, patience=0)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "monitor": "train_loss"}}


@dataclasses.dataclass
class Shape:
    d: int = 8


class ShapedLit(pl.LightningModule):
    """Takes a config dataclass, which save_hyperparameters keeps as it is (no JSON form)."""

    def __init__(self, shape: Shape = Shape()):  # noqa: B008 - a default instance, never mutated
        super().__init__()
        self.save_hyperparameters()
        self.head = nn.Linear(shape.d, 1)

    def training_step(self, batch, batch_idx):
        return self.head(torch.ones(1, self.hparams.shape.d)).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class ValPlateauLit(TinyLit):
    """ReduceLROnPlateau on the validation loss, stepped after each validation (``interval="step"``), which
    ``val_check_interval`` runs between training batches; no eval is an improvement (threshold), one cut."""

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self.loss(batch))

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)
        sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, threshold=10.0, patience=0, factor=0.1, cooldown=100)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "monitor": "val_loss", "interval": "step",
                                                   "frequency": 2}}  # after batches 1, 3...: after each validation


class PairLit(pl.LightningModule):
    """A regressor fed ``(x, y)`` tuples, the shape a ``TensorDataset`` collates to (automatic optimization)."""

    def __init__(self, d: int = 4, lr: float = 0.05):
        super().__init__()
        self.save_hyperparameters()
        self.lin = nn.Linear(d, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.lin(x).squeeze(-1), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)


def pairs(n: int = 32, d: int = 4, nan: int | None = None):
    """A ``TensorDataset`` of ``n`` ``(x, y)`` pairs; sample ``nan`` has a NaN feature."""
    from torch.utils.data import TensorDataset

    g = torch.Generator().manual_seed(5)
    x, y = torch.randn(n, d, generator=g), torch.randn(n, generator=g)
    if nan is not None:
        x[nan, 1] = float("nan")
    return TensorDataset(x, y)
