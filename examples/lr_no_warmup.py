"""A learning rate without warmup diverges: the loss climbs, the gradients explode, then NaN.

An MLP regressor is trained with SGD and momentum at lr 0.16. With a 100-step
linear warmup that learning rate trains fine (1500 steps, checked); someone set
`warmup` to 0, and the full rate from step 0 is too much for the untrained
network. Nothing fails for a while: the loss creeps up, the gradient norm grows by a constant
factor every step, and only when it overflows does the recorder see a NaN.
`bisect steps` replays step by step and reports where the gradients exploded,
long before the NaN, with the learning rate used at each step.

    python examples/lr_no_warmup.py [--quick]
"""

from __future__ import annotations

import functools

import torch
from torch import nn

import reprokit

from tinylm import MLP, parse, run_example


def warmup(step, steps):
    return min(1.0, (step + 1) / steps) if steps else 1.0


def build(config):
    torch.manual_seed(config["seed"])
    model = MLP(config["dim"], 64, 1)
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
    config = {"seed": 0, "dim": 16, "lr": 0.16, "warmup": 0}  # warmup 100 trains fine
    return run_example(args, build(config), train_step, build, config, batches(config, 400 if args.quick else 5000),
                       snapshot_every=50)


if __name__ == "__main__":
    raise SystemExit(main())
