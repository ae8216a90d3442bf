"""A tiny CPU attention model (F.scaled_dot_product_attention, value head dim != query head dim) whose loss
goes NaN on a poisoned batch. The flash backend has no kernel for unequal head dims ("No available kernel")."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

import reprokit


class Attn(nn.Module):
    def __init__(self, d: int = 8, heads: int = 2):
        super().__init__()
        self.qk = nn.Linear(d, 2 * d)
        self.v = nn.Linear(d, 2 * d)  # value head dim twice the query's
        self.out = nn.Linear(2 * d, 1)
        self.heads = heads

    def forward(self, x):  # x: [B, T, d]
        b, t, d = x.shape
        q, k = (z.view(b, t, self.heads, -1).transpose(1, 2) for z in self.qk(x).split(d, -1))
        v = self.v(x).view(b, t, self.heads, -1).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, t, -1)
        return self.out(y).squeeze(-1).mean(-1)


def build(config):
    torch.manual_seed(0)
    model = Attn()
    return reprokit.TrainState(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=1e-2))


def train_step(state, batch):
    loss = F.mse_loss(state.model(batch["x"]), batch["y"])
    loss.backward()
    state.optimizer.step()
    state.optimizer.zero_grad(set_to_none=True)
    return loss


def batches(steps, poison_step):
    g = torch.Generator().manual_seed(3)
    for s in range(steps):
        x = torch.randn(4, 6, 8, generator=g)
        if s == poison_step:
            x[1, 2, 3] = float("nan")
        yield {"x": x, "y": x.sum((1, 2))}
