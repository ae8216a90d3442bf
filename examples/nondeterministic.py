"""A failure that does not recur: a (simulated) flaky accelerator flips a bit now and then.

Every so often a faulty device flips an exponent bit in an activation, turning
it into inf, and the loss is NaN. The fault does not come from anything the
recorder can capture: it is drawn from the operating system's entropy, like a
real hardware fault. Replaying the bundle three times almost never fails at the
recorded step: the verdict is "not_reproduced", "different_failure" (the fault
struck at another step) or "flaky", never "deterministic" -- and never a false
"fixed": it is information, the failure is not in the code, the data or the state.

    python examples/nondeterministic.py [--quick]
"""

from __future__ import annotations

import random

import torch
from torch import nn

import reprokit

from tinylm import MLP, parse, run_example

FAULT_RATE = 0.02           # per step
_DEVICE = random.SystemRandom()  # OS entropy: not a generator anyone can record or seed


class FlakyDevice(nn.Module):
    """Identity, except that now and then one value comes back as inf (a flipped exponent bit)."""

    def forward(self, x):
        if _DEVICE.random() < FAULT_RATE:
            x = x.clone()
            x.view(-1)[_DEVICE.randrange(x.numel())] = float("inf")
        return x


def build(config):
    torch.manual_seed(config["seed"])
    model = nn.Sequential(MLP(config["dim"], 32, 32), FlakyDevice(), nn.Linear(32, 1))
    return reprokit.TrainState(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=config["lr"]))


def train_step(state, batch):
    loss = nn.functional.mse_loss(state.model(batch["x"]).squeeze(-1), batch["y"])
    loss.backward()
    state.optimizer.step()
    state.optimizer.zero_grad(set_to_none=True)
    return loss


def batches(config, steps):
    g = torch.Generator().manual_seed(config["seed"] + 1)
    w = torch.randn(config["dim"], generator=g)
    for _ in range(steps):
        x = torch.randn(32, config["dim"], generator=g)
        yield {"x": x, "y": x @ w}


def main() -> int:
    args = parse(__doc__)
    config = {"seed": 0, "dim": 8, "lr": 1e-3}
    return run_example(args, build(config), train_step, build, config, batches(config, 3000), snapshot_every=25,
                       expect=lambda verdict: verdict != "deterministic")


if __name__ == "__main__":
    raise SystemExit(main())
