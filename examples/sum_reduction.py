"""Harness break: `reduction='sum'` after a batch-size change. The loss and the gradients jump 16x.

The loss was written with `reduction='sum'` when batches had 16 rows, and the
learning rate tuned for that. At step 40 a batch-size ramp moves to 256 rows:
the summed loss, and every gradient, is 16x larger at the same learning rate.
The recorder's spike trigger fires on that step; `bisect steps` shows the grad
norm jumping ~16x while the LR column stays put -- the scale came from the
batch, not the optimizer.

    python examples/sum_reduction.py [--quick]
"""

from __future__ import annotations

import torch
from torch import nn

import reprokit

from tinylm import MLP, parse, run_example


def build(config):
    torch.manual_seed(config["seed"])
    model = MLP(config["dim"], 32, 1)
    return reprokit.TrainState(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=config["lr"]))


def train_step(state, batch):
    loss = nn.functional.mse_loss(state.model(batch["x"]).squeeze(-1), batch["y"], reduction="sum")
    loss.backward()
    state.optimizer.step()
    state.optimizer.zero_grad(set_to_none=True)
    return loss


def batches(config, steps):
    g = torch.Generator().manual_seed(config["seed"] + 1)
    w = torch.randn(config["dim"], generator=g)
    for step in range(steps):
        rows = 16 if step < config["ramp_at"] else 256  # the batch-size ramp
        x = torch.randn(rows, config["dim"], generator=g)
        yield {"x": x, "y": x @ w + 0.1 * torch.randn(rows, generator=g)}


def main() -> int:
    args = parse(__doc__)
    config = {"seed": 0, "dim": 8, "lr": 2e-3, "ramp_at": 40}
    return run_example(args, build(config), train_step, build, config, batches(config, 80 if args.quick else 2000),
                       snapshot_every=25, spike_factor=3.0, spike_window=20)


if __name__ == "__main__":
    raise SystemExit(main())
