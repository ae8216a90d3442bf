"""A model that returns a dict (as Hugging Face models return a ModelOutput); batch 4 carries an inf."""

from __future__ import annotations

import torch
from torch import nn

import reprokit


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 1)

    def forward(self, x):
        return {"pred": self.fc2(torch.relu(self.fc1(x))).squeeze(-1)}


def build(config):
    torch.manual_seed(0)
    model = Net()
    return reprokit.TrainState(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.01))


def train_step(state, batch):
    loss = nn.functional.mse_loss(state.model(batch["x"])["pred"], batch["y"])
    loss.backward()
    state.optimizer.step()
    state.optimizer.zero_grad(set_to_none=True)
    return loss


def batches(steps, bad=4):
    g = torch.Generator().manual_seed(2)
    for i in range(steps):
        x = torch.randn(4, 8, generator=g)
        if i == bad:
            x[1, 3] = float("inf")
        yield {"x": x, "y": torch.randn(4, generator=g)}
