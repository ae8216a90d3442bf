"""A tiny MLP trained through accelerate's prepared model, optimizer, scheduler and dataloader."""

from __future__ import annotations

import torch
from accelerate import Accelerator
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import reprokit

ACCELERATOR: Accelerator | None = None


def build(config):
    global ACCELERATOR
    torch.manual_seed(config.get("seed", 0))
    ACCELERATOR = Accelerator(cpu=True)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Dropout(0.1), nn.Linear(8, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=config.get("lr", 0.01))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 4))
    model, opt, sched = ACCELERATOR.prepare(model, opt, sched)
    return reprokit.TrainState(model=model, optimizer=opt, scheduler=sched)


def train_step(state, batch):
    x, y = batch
    loss = nn.functional.mse_loss(state.model(x).squeeze(-1), y)
    ACCELERATOR.backward(loss)
    ACCELERATOR.clip_grad_norm_(state.model.parameters(), 1.0)
    state.optimizer.step()
    state.scheduler.step()
    state.optimizer.zero_grad()
    return loss


def loader(n=40, poison=None, bs=4):
    g = torch.Generator().manual_seed(5)
    x, y = torch.randn(n, 4, generator=g), torch.randn(n, generator=g)
    if poison is not None:
        x[poison, 1] = float("inf")  # tanh saturates (a finite loss), but inf * 0 in the backward: NaN gradients
    return ACCELERATOR.prepare(DataLoader(TensorDataset(x, y), batch_size=bs, shuffle=False))
