"""A tiny MLP trained through accelerate with ``accelerator.accumulate``, ``clip_grad_norm_`` and (optionally) bf16."""

from __future__ import annotations

import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState, GradientState
from torch import nn
from torch.utils.data import DataLoader, Dataset

import reprokit

ACCELERATOR: Accelerator | None = None


def build(config):
    global ACCELERATOR
    # One process runs several of these (the tests; a replay after the recording): accelerate keeps its state
    # process-wide and refuses another mixed precision, so each build starts it afresh.
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    torch.manual_seed(0)
    ACCELERATOR = Accelerator(cpu=True, gradient_accumulation_steps=config["accumulate"],
                              mixed_precision=config.get("precision", "no"))
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Dropout(0.1), nn.Linear(8, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 4))
    model, opt, sched = ACCELERATOR.prepare(model, opt, sched)
    return reprokit.TrainState(model=model, optimizer=opt, scheduler=sched)


def train_step(state, batch):
    x, y = batch
    with ACCELERATOR.accumulate(state.model):
        loss = nn.functional.mse_loss(state.model(x).squeeze(-1).float(), y)
        ACCELERATOR.backward(loss)
        if ACCELERATOR.sync_gradients:
            ACCELERATOR.clip_grad_norm_(state.model.parameters(), 0.5)
        state.optimizer.step()
        state.scheduler.step()
        state.optimizer.zero_grad()
    return loss


class Rows(Dataset):
    """``n`` rows; row ``bad`` holds a NaN on its ``nth`` read only (a failure in a later epoch)."""

    def __init__(self, n, bad=None, nth=1):
        g = torch.Generator().manual_seed(5)
        self.x, self.y = torch.randn(n, 4, generator=g), torch.randn(n, generator=g)
        self.bad, self.nth, self.reads = bad, nth, 0

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        x = self.x[i]
        if i == self.bad:
            self.reads += 1
            if self.reads == self.nth:
                x = x.clone()
                x[1] = float("nan")
        return x, self.y[i]


def loader(dataset, bs=4):
    return ACCELERATOR.prepare(DataLoader(dataset, batch_size=bs, shuffle=False))
