"""A project for the trust cases: owned generators, gradient accumulation, a weight renormalised in forward."""

from __future__ import annotations

import random

import numpy as np
import torch
from torch import nn

import reprokit


class Net(nn.Module):
    def __init__(self, d: int, max_norm: float | None):
        super().__init__()
        self.emb = nn.Embedding(64, d, max_norm=max_norm)  # max_norm: renormalises rows of its weight in forward
        self.fc = nn.Linear(d, 1)

    def forward(self, tokens, x):
        return self.fc(self.emb(tokens).mean(1) + x)


def build(config):
    torch.manual_seed(config.get("seed", 0))
    d = config.get("dim", 16)
    model = Net(d, config.get("max_norm")).to(config.get("device", "cpu"))
    opt = torch.optim.AdamW(model.parameters(), lr=config.get("lr", 1e-2))
    extra: dict = {"micro": 0}
    if config.get("generators"):
        device = config.get("device", "cpu")
        extra["gens"] = {"torch": torch.Generator(device=device).manual_seed(1),
                         "numpy": [np.random.default_rng(2)], "python": (random.Random(3),)}
    return reprokit.TrainState(model=model, optimizer=opt, extra=extra)


def train_step(state, batch):
    """Accumulates ``accumulate`` micro-batches per optimizer step; noise drawn from the run's own generators."""
    x = batch["x"]
    gens = state.extra.get("gens")
    if gens is not None:
        noise = torch.rand(x.shape, generator=gens["torch"], device=x.device)
        scale = float(gens["numpy"][0].uniform(0.5, 1.5)) * gens["python"][0].uniform(0.5, 1.5)
        x = x + 0.1 * scale * noise
    out = state.model(batch["tokens"], x).squeeze(-1)
    accumulate = int(batch["accumulate"])
    loss = nn.functional.mse_loss(out, batch["y"]) * batch["scale"]
    (loss / accumulate).backward()
    state.extra["micro"] += 1
    if state.extra["micro"] % accumulate == 0:
        state.optimizer.step()
        state.optimizer.zero_grad(set_to_none=True)
    return loss


def batches(steps, *, blow_up_step=None, accumulate=1, device="cpu", bs=32, d=16):
    g = torch.Generator().manual_seed(11)
    for s in range(steps):
        x = torch.randn(bs, d, generator=g)
        batch = {"tokens": torch.randint(0, 64, (bs, 5), generator=g), "x": x, "y": x.sum(1),
                 "scale": torch.tensor(1e39 if s == blow_up_step else 1.0), "accumulate": accumulate}
        yield {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
