"""A failure that needs two rows of the batch at once (a cross-sample interaction)."""

from __future__ import annotations

import torch
from torch import nn

import reprokit


def build(config):
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    return reprokit.TrainState(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.01))


def train_step(state, batch):
    x = batch["x"]
    loss = nn.functional.mse_loss(state.model(x).squeeze(-1), batch["y"])
    # Marker rows 7 and 9 are harmless alone; together they poison the loss.
    if bool((x[:, 0] == 7).any()) and bool((x[:, 0] == 9).any()):
        loss = loss * float("nan")
    loss.backward()
    state.optimizer.step()
    state.optimizer.zero_grad()
    return loss


def batches(n_rows, steps, fail_step, rows):
    g = torch.Generator().manual_seed(2)
    for s in range(steps):
        x = torch.rand(n_rows, 4, generator=g)
        if s == fail_step:
            x[rows[0], 0], x[rows[1], 0] = 7.0, 9.0
        yield {"x": x, "y": x.sum(-1), "idx": torch.arange(s * n_rows, (s + 1) * n_rows)}
