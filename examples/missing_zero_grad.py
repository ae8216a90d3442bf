"""Harness break: a missing `zero_grad`. Gradients pile up step after step until training diverges.

The step calls `backward()` and `optimizer.step()` but never clears the
gradients, so every step applies the sum of all gradients so far. The loss
first goes down (the sum points the right way for a while), then the grad norm
grows step after step and the run diverges. The recorder's spike trigger fires
on the first loss far above its running median; `bisect steps` shows the grad
norm history climbing into it.

    python examples/missing_zero_grad.py [--quick]
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
    loss = nn.functional.mse_loss(state.model(batch["x"]).squeeze(-1), batch["y"])
    loss.backward()
    state.optimizer.step()  # the bug: no state.optimizer.zero_grad() anywhere
    return loss


def batches(config, steps):
    g = torch.Generator().manual_seed(config["seed"] + 1)
    w = torch.randn(config["dim"], generator=g)
    for _ in range(steps):
        x = torch.randn(32, config["dim"], generator=g)
        yield {"x": x, "y": x @ w}


def main() -> int:
    args = parse(__doc__)
    config = {"seed": 0, "dim": 8, "lr": 3e-2}
    return run_example(args, build(config), train_step, build, config, batches(config, 300 if args.quick else 3000),
                       snapshot_every=25, spike_factor=5.0, spike_window=20)


if __name__ == "__main__":
    raise SystemExit(main())
