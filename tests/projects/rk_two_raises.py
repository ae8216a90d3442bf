"""Two different bugs that raise the same exception type in the same function: a shrink must keep the one recorded."""

from __future__ import annotations

import torch
from torch import nn

import reprokit


def build(config):
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    return reprokit.TrainState(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.01))


def check(x):
    if x.shape[0] < 4:
        raise ValueError(f"need at least 4 rows for the batch statistics, got {x.shape[0]}")
    if bool((x.abs() > 1e3).any()):
        raise ValueError("a value beyond 1e3 in the batch")


def train_step(state, batch):
    x = batch["x"]
    check(x)
    loss = nn.functional.mse_loss(state.model(x).squeeze(-1), batch["y"])
    loss.backward()
    state.optimizer.step()
    state.optimizer.zero_grad()
    return loss


def batches(n_rows, steps, fail_step, row):
    g = torch.Generator().manual_seed(2)
    for s in range(steps):
        x = torch.rand(n_rows, 4, generator=g)
        if s == fail_step:
            x[row, 0] = 1e4
        yield {"x": x, "y": x.sum(-1), "idx": torch.arange(s * n_rows, (s + 1) * n_rows)}
