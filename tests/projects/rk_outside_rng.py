"""A step that draws noise from its own torch.Generator, outside ``state.extra``: replay cannot be bit-exact."""

from __future__ import annotations

import torch
from torch import nn

import reprokit

# Module-level and never snapshotted: a replay imports the module afresh and starts it from the seed again.
NOISE = torch.Generator().manual_seed(1234)


def build(config):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    return reprokit.TrainState(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.05))


def train_step(state, batch):
    x = batch["x"] + 0.1 * torch.randn(batch["x"].shape, generator=NOISE)
    loss = nn.functional.mse_loss(state.model(x).squeeze(-1), batch["y"])
    loss.backward()
    state.optimizer.step()
    state.optimizer.zero_grad(set_to_none=True)
    return loss


def batches(steps, poison_step):
    g = torch.Generator().manual_seed(7)
    for s in range(steps):
        x = torch.randn(8, 4, generator=g)
        y = x.sum(-1)
        if s == poison_step:
            x[0, 0] = float("nan")
        yield {"x": x, "y": y}
