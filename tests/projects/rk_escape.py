"""A step whose exception message carries terminal control sequences (as a hostile bundle's failure.json could)."""

from __future__ import annotations

import torch
from torch import nn

import reprokit

MESSAGE = "bad row\x1b[2J\x1b]0;owned\x07\rREPRODUCED: nothing \u202eevil"


def build(config):
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    return reprokit.TrainState(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))


def train_step(state, batch):
    if bool(batch["stop"]):
        raise ValueError(MESSAGE)
    loss = state.model(batch["x"]).pow(2).mean()
    loss.backward()
    state.optimizer.step()
    state.optimizer.zero_grad(set_to_none=True)
    return loss


def batches(steps, stop_at):
    for i in range(steps):
        yield {"x": torch.ones(2, 4) * i, "stop": torch.tensor(i == stop_at)}
