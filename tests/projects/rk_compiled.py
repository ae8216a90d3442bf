"""A tiny MLP trained through ``torch.compile`` (tests of recording, replay and ``bisect layers`` under compile)."""

from __future__ import annotations

import torch
from torch import nn

import reprokit


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.lin = nn.Linear(d, d)

    def forward(self, h):
        return torch.sqrt(10.0 - self.lin(h))  # THE BUG: a large activation makes it sqrt(negative) = nan


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(4, 8)
        self.mid = Block(8)
        self.out = nn.Linear(8, 1)

    def forward(self, x):
        return self.out(self.mid(self.inp(x)))


def build(config):
    torch.manual_seed(0)
    model = Net()
    compiled = torch.compile(model, backend=config.get("backend", "eager"))
    return reprokit.TrainState(model=compiled, optimizer=torch.optim.SGD(model.parameters(), lr=0.01))


def train_step(state, batch):
    x, y = batch
    loss = nn.functional.mse_loss(state.model(x).squeeze(-1), y)
    loss.backward()
    state.optimizer.step()
    state.optimizer.zero_grad(set_to_none=True)
    return loss


def batches(steps, bad_step):
    g = torch.Generator().manual_seed(1)
    for s in range(steps):
        x, y = torch.randn(4, 4, generator=g), torch.randn(4, generator=g)
        if s == bad_step:
            x[2] = 1e4
        yield x, y
