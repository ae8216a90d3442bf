"""A CUDA project: dropout (CUDA RNG), fp16 autocast with GradScaler, batches living on the GPU."""

from __future__ import annotations

import torch
from torch import nn

import reprokit


def build(config):
    torch.manual_seed(0)
    hidden = config.get("hidden", 64)
    model = nn.Sequential(nn.Linear(32, hidden), nn.Dropout(0.2), nn.GELU(), nn.Linear(hidden, 1)).to(config["device"])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cuda", init_scale=1024.0) if config.get("amp") else None
    return reprokit.TrainState(model=model, optimizer=opt, scaler=scaler)


def train_step(state, batch):
    x, y = batch["x"], batch["y"]
    if state.scaler is not None:
        with torch.autocast("cuda", dtype=torch.float16):
            loss = nn.functional.mse_loss(state.model(x).squeeze(-1).float(), y)
        state.scaler.scale(loss).backward()
        state.scaler.step(state.optimizer)
        state.scaler.update()
    else:
        loss = nn.functional.mse_loss(state.model(x).squeeze(-1), y)
        # grad_mult = 1e39 overflows float32 in backward: infinite gradients under a finite loss.
        (loss * batch.get("grad_mult", 1.0)).backward()
        state.optimizer.step()
    state.optimizer.zero_grad(set_to_none=True)
    return loss


def batches(steps, poison_step, device, inf_grad_step=None):
    g = torch.Generator(device=device).manual_seed(5)
    w = torch.randn(32, generator=g, device=device)
    for s in range(steps):
        x = torch.randn(64, 32, generator=g, device=device)
        if s == poison_step:
            x[7, 3] = float("nan")
        batch = {"x": x, "y": x @ w}
        if inf_grad_step is not None:
            batch["grad_mult"] = 1e39 if s == inf_grad_step else 1.0
        yield batch


def scribbling_step(state, batch):
    """Edits its (GPU) batch in place after using it, as some augmentation code does."""
    loss = train_step(state, batch)
    batch["x"].zero_()
    return loss


def build_fused(config):
    """``build`` with fused AdamW (its ``step`` lives on the GPU)."""
    state = build(config)
    state.optimizer = torch.optim.AdamW(state.model.parameters(), lr=1e-3, fused=True)
    return state
