"""fp16 training without loss scaling or range checks: activations overflow, the loss goes inf.

A regression MLP predicts a quantity in raw units (targets up to ~1e5) under
`torch.autocast(dtype=torch.float16)`. fp16's largest value is 65504: early on
the predictions are small and all is well; once the model has learned the
scale, the largest predictions no longer fit, the last Linear returns inf, and
the loss is inf. `bisect precision` shows the fix: it fails under fp16, passes
under fp32 and bf16 (bf16 has fp32's range).

    python examples/fp16_overflow.py [--quick]
"""

from __future__ import annotations

import torch
from torch import nn

import reprokit

from tinylm import MLP, parse, run_example


def build(config):
    torch.manual_seed(config["seed"])
    model = MLP(config["dim"], 64, 1)
    return reprokit.TrainState(model=model, optimizer=torch.optim.Adam(model.parameters(), lr=config["lr"]))


def train_step(state, batch):
    with torch.autocast("cpu", dtype=torch.float16):
        pred = state.model(batch["x"]).squeeze(-1)
    loss = nn.functional.mse_loss(pred.float(), batch["y"]) / 1e6  # in (1e3 units)^2
    loss.backward()
    state.optimizer.step()
    state.optimizer.zero_grad(set_to_none=True)
    return loss


def batches(config, steps):
    g = torch.Generator().manual_seed(config["seed"] + 1)
    w = torch.rand(config["dim"], generator=g) * 2e4
    for step in range(steps):
        x = torch.rand(32, config["dim"], generator=g)
        yield {"x": x, "y": x @ w, "index": torch.arange(step * 32, step * 32 + 32)}


def main() -> int:
    args = parse(__doc__)
    config = {"seed": 0, "dim": 8, "lr": 3e-2}
    return run_example(args, build(config), train_step, build, config, batches(config, 300 if args.quick else 5000),
                       snapshot_every=25)


if __name__ == "__main__":
    raise SystemExit(main())
