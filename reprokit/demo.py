"""The built-in demo: a tiny regression run that dies on one poisoned sample.

16,384 samples, batches of 32, an MLP trained with AdamW and a warmup
schedule. One sample has an ``inf`` feature; it comes up at step 250, the loss
turns NaN, and the recorder writes a bundle. ``reprokit demo`` then replays it.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from reprokit.state import TrainState

DEFAULT_CONFIG: dict[str, Any] = {
    "seed": 0,
    "samples": 16384,
    "dim": 16,
    "hidden": 64,
    "batch_size": 32,
    "lr": 3e-3,
    "warmup": 20,
    "poison_step": 250,  # the step at which the poisoned sample is drawn
}


def warmup(step: int, steps: int) -> float:
    return min(1.0, (step + 1) / steps)


def build(config: dict[str, Any]) -> TrainState:
    """The model, optimizer and scheduler for ``config``: what replay calls."""
    torch.manual_seed(config["seed"])
    model = nn.Sequential(nn.Linear(config["dim"], config["hidden"]), nn.GELU(), nn.Linear(config["hidden"], 1))
    opt = torch.optim.AdamW(model.parameters(), lr=config["lr"], weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, functools.partial(warmup, steps=config["warmup"]))
    return TrainState(model=model, optimizer=opt, scheduler=sched)


def train_step(state: TrainState, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Forward, backward, clip, step: returns the loss."""
    pred = state.model(batch["x"]).squeeze(-1)
    loss = nn.functional.mse_loss(pred, batch["y"])
    loss.backward()
    torch.nn.utils.clip_grad_norm_(state.model.parameters(), 1.0)
    state.optimizer.step()
    state.scheduler.step()
    state.optimizer.zero_grad(set_to_none=True)
    return loss


def batches(config: dict[str, Any]) -> Iterator[dict[str, torch.Tensor]]:
    """The data: ``{"x", "y", "index"}`` batches, one epoch, seeded; one sample poisoned."""
    g = torch.Generator().manual_seed(config["seed"] + 1)
    n, dim, bs = config["samples"], config["dim"], config["batch_size"]
    x = torch.randn(n, dim, generator=g)
    y = x @ torch.randn(dim, generator=g) + 0.1 * torch.randn(n, generator=g)
    order = torch.randperm(n, generator=g)
    poison = int(order[config["poison_step"] * bs + 7])
    x[poison, 3] = float("inf")
    for start in range(0, n - bs + 1, bs):
        idx = order[start:start + bs]
        yield {"x": x[idx], "y": y[idx], "index": idx}
