"""A hand-written softmax without max-subtraction: attention overflows, the forward turns NaN.

The attention of this TinyLM uses `exp(x) / exp(x).sum()` instead of
`torch.softmax`. It is the same function on paper, until training (a learning
rate on the high side) pushes an attention score past 88.7: `exp` overflows to
inf, its row sums to inf, and inf / inf is NaN. `bisect layers` names the module
(`blocks.0.softmax`, a NaiveSoftmax), the op that made the first inf (`exp`)
and the one that made the NaN (`div`); the causal mask's -inf in the module's
input is not the cause (exp turns it into 0 in every step), and `extract` cuts
the module out with the input that overflows.

The rate is high enough that the scores cross 88.7 quickly (step 25), so the
story is the same on every CPU: at half this rate the crossing comes some 60
steps later, at a step (and in a phase) that a CPU's last float bits decide.

    python examples/naive_softmax.py [--quick]
"""

from __future__ import annotations

import torch
from torch import nn

import reprokit

from tinylm import TinyLM, lm_loss, parse, run_example


class NaiveSoftmax(nn.Module):
    def forward(self, x):
        e = torch.exp(x)  # no x - x.max(): overflows once a score passes ~88.7
        return e / e.sum(dim=-1, keepdim=True)


def build(config):
    torch.manual_seed(config["seed"])
    model = TinyLM(vocab=config["vocab"], softmax=NaiveSoftmax)
    return reprokit.TrainState(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=config["lr"]))


def train_step(state, batch):
    loss = lm_loss(state.model(batch["input_ids"]), batch["input_ids"])
    loss.backward()
    state.optimizer.step()
    state.optimizer.zero_grad(set_to_none=True)
    return loss


def batches(config, steps):
    g = torch.Generator().manual_seed(config["seed"] + 1)
    for _ in range(steps):
        half = torch.randint(1, config["vocab"], (16, 16), generator=g)
        yield {"input_ids": torch.cat([half, half], 1)}  # a copy task: learn to attend to 16 tokens back


def main() -> int:
    args = parse(__doc__)
    config = {"seed": 0, "vocab": 16, "lr": 4e-2}
    return run_example(args, build(config), train_step, build, config, batches(config, 200 if args.quick else 5000),
                       snapshot_every=25)


if __name__ == "__main__":
    raise SystemExit(main())
