"""Harness break: the learning rate x100. A loss spike, caught by the recorder's spike trigger.

A classifier trains with AdamW at 1e-3; the schedule is meant to drop the rate
to 1e-5 at step 60 for fine-tuning, but the phase multiplies by 100 instead of
dividing. Nothing turns NaN: the loss jumps to many times its running median
and the model forgets what it learned. `Recorder(spike_factor=3)` catches the
spike; `bisect steps` shows the LR column jump from 0.001 to 0.1 right before.

    python examples/lr_x100.py [--quick]
"""

from __future__ import annotations

import functools

import torch
from torch import nn

import reprokit

from tinylm import MLP, parse, run_example


def schedule(step, phase_at):
    return 1.0 if step < phase_at else 100.0  # meant: 1 / 100


def build(config):
    torch.manual_seed(config["seed"])
    model = MLP(config["dim"], 64, config["classes"])
    opt = torch.optim.AdamW(model.parameters(), lr=config["lr"])
    sched = torch.optim.lr_scheduler.LambdaLR(opt, functools.partial(schedule, phase_at=config["phase_at"]))
    return reprokit.TrainState(model=model, optimizer=opt, scheduler=sched)


def train_step(state, batch):
    loss = nn.functional.cross_entropy(state.model(batch["x"]), batch["y"])
    loss.backward()
    state.optimizer.step()
    state.scheduler.step()
    state.optimizer.zero_grad(set_to_none=True)
    return loss


def batches(config, steps):
    g = torch.Generator().manual_seed(config["seed"] + 1)
    w = torch.randn(config["dim"], config["classes"], generator=g)
    for _ in range(steps):
        x = torch.randn(64, config["dim"], generator=g)
        yield {"x": x, "y": (x @ w).argmax(1)}


def main() -> int:
    args = parse(__doc__)
    config = {"seed": 0, "dim": 16, "classes": 8, "lr": 1e-3, "phase_at": 60}
    return run_example(args, build(config), train_step, build, config, batches(config, 120 if args.quick else 2000),
                       snapshot_every=25, spike_factor=3.0, spike_window=20)


if __name__ == "__main__":
    raise SystemExit(main())
