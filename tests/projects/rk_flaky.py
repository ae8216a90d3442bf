"""A step that fails at random, like a hardware fault: replay must call it flaky."""

from __future__ import annotations

import os

import torch
from torch import nn

import reprokit


def build(config):
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    return reprokit.TrainState(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.01),
                               extra={"calls": 0})


def train_step(state, batch):
    state.extra["calls"] += 1
    loss = nn.functional.mse_loss(state.model(batch["x"]).squeeze(-1), batch["y"])
    loss.backward()
    state.optimizer.step()
    state.optimizer.zero_grad()
    if state.extra["calls"] > 3 and os.urandom(1)[0] < 128:
        raise RuntimeError("ECC error (simulated)")
    return loss


def batches(steps):
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randn(8, 4, generator=g)
        yield {"x": x, "y": x.sum(-1)}
