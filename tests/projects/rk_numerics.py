"""Numerics failures: fp16 overflow under autocast, a naive softmax, an LR that explodes.

``config["dtype"]`` casts the model after it is made (``model.half()`` style: float16 without autocast, bfloat16
or float64 parameters); the step casts the batch to the parameters' dtype, as such loops do."""

from __future__ import annotations

import torch
from torch import nn

import reprokit


class NaiveSoftmax(nn.Module):
    """exp(x) / sum(exp(x)) without subtracting the max: overflows for large logits."""

    def forward(self, x):
        e = torch.exp(x)
        return e / e.sum(-1, keepdim=True)


class Net(nn.Module):
    def __init__(self, softmax: bool):
        super().__init__()
        self.fc1 = nn.Linear(8, 32)
        self.attn = NaiveSoftmax() if softmax else nn.Identity()
        self.fc2 = nn.Linear(32, 1)

    def forward(self, x):
        return self.fc2(self.attn(self.fc1(x)))


def build(config):
    torch.manual_seed(0)
    model = Net(config.get("softmax", False))
    if config.get("dtype"):
        model.to(getattr(torch, config["dtype"]))
    model.half_in_step = config.get("half_in_step", False)  # the step casts the model itself, every step
    if config.get("optimizer") == "adamw":  # moments in the parameters' dtype
        opt: torch.optim.Optimizer = torch.optim.AdamW(model.parameters(), lr=config.get("lr", 1e-3))
    else:
        opt = torch.optim.SGD(model.parameters(), lr=config.get("lr", 1e-3))
    sched = None
    if config.get("lr_growth"):
        sched = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=config["lr_growth"])
    scaler = torch.amp.GradScaler("cpu") if config.get("amp") else None
    return reprokit.TrainState(model=model, optimizer=opt, scheduler=sched, scaler=scaler)


def train_step(state, batch):
    amp = state.scaler is not None
    if state.model.half_in_step:
        state.model.half()
    dtype = next(state.model.parameters()).dtype  # the batch follows the model's dtype
    with torch.autocast("cpu", dtype=torch.float16, enabled=amp):
        out = state.model(batch["x"].to(dtype)).squeeze(-1)
    loss = nn.functional.mse_loss(out.to(dtype), batch["y"].to(dtype))
    if amp:
        state.scaler.scale(loss).backward()
        state.scaler.step(state.optimizer)
        state.scaler.update()
    else:
        loss.backward()
        state.optimizer.step()
    state.optimizer.zero_grad(set_to_none=True)
    if state.scheduler is not None:
        state.scheduler.step()
    return loss


def batches(steps, scale_from=None, scale=1.0):
    g = torch.Generator().manual_seed(4)
    for s in range(steps):
        x = torch.randn(16, 8, generator=g)
        if scale_from is not None and s >= scale_from:
            x = x * scale
        yield {"x": x, "y": torch.tanh(x.sum(-1))}
