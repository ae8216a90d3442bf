"""rk_accumulate's step with a loss that stays finite while its gradient goes NaN on a row whose first feature is 99
(0 * sqrt(|x - 99|): the sqrt's infinite slope at 0 times 0), so the failure shows only when the optimizer steps."""

from __future__ import annotations

import rk_accumulate as acc
import torch
from rk_accumulate import Rows, build, loader  # noqa: F401 - the project's build and data
from torch import nn


def train_step(state, batch):
    x, y = batch
    with acc.ACCELERATOR.accumulate(state.model):
        out = state.model(x).squeeze(-1).float()
        loss = nn.functional.mse_loss(out, y) + 0 * torch.sqrt(torch.abs(out * 0 + x[:, 0] - 99)).sum()
        acc.ACCELERATOR.backward(loss)
        state.optimizer.step()
        state.scheduler.step()
        state.optimizer.zero_grad()
    return loss


class GradOnly(Rows):
    """``n`` rows; row ``bad`` makes the gradient NaN (the loss stays finite)."""

    def __init__(self, n, bad):
        super().__init__(n)
        self.bad_row = bad

    def __getitem__(self, i):
        x, y = super().__getitem__(i)
        if i == self.bad_row:
            x = x.clone()
            x[0] = 99.0
        return x, y
