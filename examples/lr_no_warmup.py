"""A learning rate without warmup diverges: the loss climbs, the gradients explode, then NaN.

A two-layer linear regressor, initialised at twice PyTorch's default scale (as
weights ported from a framework with another init convention are), is trained
with SGD and momentum at lr 0.055. With a 100-step linear warmup that rate
trains fine (1500 steps to a loss of ~1e-13, checked): the small early steps
shrink the weights, and with them the curvature of the loss, before the rate is
at full strength. Someone set `warmup` to 0, and the full rate from step 0 is
past what the initial curvature can take: every step overshoots a little more,
the gradient norm grows by a constant factor, and only when it overflows does
the recorder see a NaN. `bisect steps` replays step by step and reports where
the gradients exploded, well before the NaN, with the learning rate used at
each step.

The margins are wide on purpose, so the story is the same on every CPU: 0.04
without warmup does not diverge, 0.065 diverges even with warmup.

    python examples/lr_no_warmup.py [--quick]
"""

from __future__ import annotations

import functools

import torch
from torch import nn

import reprokit

from tinylm import parse, run_example


def warmup(step, steps):
    return min(1.0, (step + 1) / steps) if steps else 1.0


def build(config):
    torch.manual_seed(config["seed"])
    model = nn.Sequential(nn.Linear(config["dim"], 64), nn.Linear(64, 1))
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(config["init_scale"])
    opt = torch.optim.SGD(model.parameters(), lr=config["lr"], momentum=0.9)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, functools.partial(warmup, steps=config["warmup"]))
    return reprokit.TrainState(model=model, optimizer=opt, scheduler=sched)


def train_step(state, batch):
    loss = nn.functional.mse_loss(state.model(batch["x"]).squeeze(-1), batch["y"])
    loss.backward()
    state.optimizer.step()
    state.scheduler.step()
    state.optimizer.zero_grad(set_to_none=True)
    return loss


def batches(config, steps):
    g = torch.Generator().manual_seed(config["seed"] + 1)
    w = torch.randn(config["dim"], generator=g)
    for _ in range(steps):
        x = torch.randn(64, config["dim"], generator=g)
        yield {"x": x, "y": x @ w}


def main() -> int:
    args = parse(__doc__)
    config = {"seed": 0, "dim": 16, "lr": 0.055, "warmup": 0, "init_scale": 2.0}  # warmup 100 trains fine
    return run_example(args, build(config), train_step, build, config, batches(config, 400 if args.quick else 5000),
                       snapshot_every=50)


if __name__ == "__main__":
    raise SystemExit(main())
