"""Harness break: labels shuffled independently of the inputs. Nothing crashes; nothing is learned.

The loader shuffles the inputs with one permutation and the labels with another
(two `randperm` calls where one index was meant). Every batch is well formed,
the loss is finite, the gradients are healthy, and the loss sits at chance,
ln(4) = 1.39, forever. A user predicate catches it: `train_step` keeps a running
mean of the loss in `state.extra` (recorded, so replay sees it too), and
`not_learning` fails the run when, after 40 steps, that mean is still within 5%
of chance. `bisect steps` then rules out the optimizer: no step with exploding
gradients or a spike, just a flat loss -- the data is the suspect.

    python examples/shuffled_labels.py [--quick]
"""

from __future__ import annotations

import math

import torch
from torch import nn

import reprokit

from tinylm import MLP, parse, run_example

CLASSES = 4


def build(config):
    torch.manual_seed(config["seed"])
    model = MLP(config["dim"], 32, CLASSES)
    opt = torch.optim.AdamW(model.parameters(), lr=config["lr"])
    return reprokit.TrainState(model=model, optimizer=opt, extra={"loss_avg": math.log(CLASSES), "steps": 0})


def train_step(state, batch):
    loss = nn.functional.cross_entropy(state.model(batch["x"]), batch["y"])
    loss.backward()
    state.optimizer.step()
    state.optimizer.zero_grad(set_to_none=True)
    state.extra["loss_avg"] = 0.9 * state.extra["loss_avg"] + 0.1 * loss.item()
    state.extra["steps"] += 1
    return loss


def not_learning(step, loss, state):
    """After 40 steps the running loss should be well below chance (ln 4); this task is easy."""
    return state.extra["steps"] >= 40 and state.extra["loss_avg"] > 0.95 * math.log(CLASSES)


def batches(config, steps):
    g = torch.Generator().manual_seed(config["seed"] + 1)
    x = torch.randn(steps * 32, config["dim"], generator=g)
    y = (x[:, 0] > 0).long() + 2 * (x[:, 1] > 0).long()
    xs = x[torch.randperm(len(x), generator=g)]
    ys = y[torch.randperm(len(y), generator=g)]  # the bug: its own permutation
    for step in range(steps):
        yield {"x": xs[step * 32:(step + 1) * 32], "y": ys[step * 32:(step + 1) * 32]}


def main() -> int:
    args = parse(__doc__)
    config = {"seed": 0, "dim": 8, "lr": 1e-2}
    return run_example(args, build(config), train_step, build, config, batches(config, 100 if args.quick else 2000),
                       snapshot_every=25, detect=[not_learning])


if __name__ == "__main__":
    raise SystemExit(main())
