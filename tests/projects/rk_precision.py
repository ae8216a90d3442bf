"""A small MLP trained under per-backend float32 settings; batch 3 carries a NaN.

The step checks that it runs under the settings ``config["precision"]`` names (as a run's own sanity check
would): a replay that did not put them back fails with an AssertionError instead of the recorded NaN.
"""

from __future__ import annotations

import torch
from torch import nn

import reprokit


def build(config):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 1))
    model.expected_precision = config["precision"]  # CPU matmuls run in bf16 where this says "bf16"
    return reprokit.TrainState(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.05))


def train_step(state, batch):
    running = str(torch.backends.mkldnn.matmul.fp32_precision)
    assert running == state.model.expected_precision, f"matmul precision {running}, the run set it to " \
                                                       f"{state.model.expected_precision}"
    loss = nn.functional.mse_loss(state.model(batch["x"]).squeeze(-1), batch["y"])
    loss.backward()
    state.optimizer.step()
    state.optimizer.zero_grad(set_to_none=True)
    return loss


def batches(steps, poison_at=3):
    g = torch.Generator().manual_seed(1)
    for i in range(steps):
        x = torch.randn(16, 64, generator=g)
        if i == poison_at:
            x[0, 0] = float("nan")
        yield {"x": x, "y": torch.randn(16, generator=g)}
