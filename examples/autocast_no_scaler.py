"""Harness break: fp16 autocast without a GradScaler. Gradients underflow to zero; training stalls silently.

An MLP autoencoder trains under `torch.autocast(dtype=torch.float16)` with Adam.
Its loss is divided by 100 (a "normalisation" kept from an older codebase):
harmless in fp32, since Adam does not care about the scale of the loss. In
fp16, gradients below 6e-8 round to zero, and as the reconstruction improves,
more and more of them do -- without a GradScaler to scale the loss up first.
Nothing is NaN; the loss just stops improving. A user predicate catches it:
`train_step` logs the fraction of gradient entries that are exactly zero in
`state.extra`, and `grads_underflow` fails the run when it passes 25%.
`bisect precision` confirms: fails under fp16, passes under fp32 and bf16.

    python examples/autocast_no_scaler.py [--quick]
"""

from __future__ import annotations

import torch
from torch import nn

import reprokit

from tinylm import parse, run_example


def build(config):
    torch.manual_seed(config["seed"])
    model = nn.Sequential(nn.Linear(128, 64), nn.ReLU(), nn.Linear(64, 128))
    opt = torch.optim.Adam(model.parameters(), lr=config["lr"])
    return reprokit.TrainState(model=model, optimizer=opt, extra={"zero_grad_frac": 0.0})


def train_step(state, batch):
    with torch.autocast("cpu", dtype=torch.float16):  # no GradScaler anywhere
        pred = state.model(batch["x"])
    loss = nn.functional.mse_loss(pred.float(), batch["x"]) / 100
    loss.backward()
    grads = [p.grad for p in state.model.parameters()]
    state.extra["zero_grad_frac"] = sum(int((g == 0).sum()) for g in grads) / sum(g.numel() for g in grads)
    state.optimizer.step()
    state.optimizer.zero_grad(set_to_none=True)
    return loss


def grads_underflow(step, loss, state):
    """More than a quarter of all gradient entries exactly zero: they underflowed."""
    return state.extra["zero_grad_frac"] > 0.25


def batches(config, steps):
    g = torch.Generator().manual_seed(config["seed"] + 1)
    basis = torch.randn(8, 128, generator=g) / 8  # the data lives on an 8-dim subspace
    for _ in range(steps):
        yield {"x": torch.randn(256, 8, generator=g) @ basis}


def main() -> int:
    args = parse(__doc__)
    config = {"seed": 0, "lr": 3e-3}
    return run_example(args, build(config), train_step, build, config, batches(config, 400 if args.quick else 5000),
                       snapshot_every=25, detect=[grads_underflow])


if __name__ == "__main__":
    raise SystemExit(main())
