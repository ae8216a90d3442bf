"""A project whose import leaves a mark: proves which commands import a bundle's code."""

from __future__ import annotations

import os
import pathlib

import torch

import reprokit

_MARK = os.environ.get("RK_IMPORT_MARKER")
if _MARK:
    with open(_MARK, "a") as f:
        f.write(f"imported {pathlib.Path(__file__).parent.name}\n")


def build(config):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    return reprokit.TrainState(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))


def train_step(state, batch):
    loss = torch.nn.functional.mse_loss(state.model(batch["x"]).squeeze(-1), batch["y"])
    loss.backward()
    state.optimizer.step()
    state.optimizer.zero_grad(set_to_none=True)
    return loss
