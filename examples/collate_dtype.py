"""A collate function that sometimes yields the wrong dtype: int32 labels in the ragged last batch.

The labels live in an int32 numpy array (as they came off disk). The collate
function builds full batches with `torch.tensor([...])` (int64), but pads the
ragged last batch of the epoch through `torch.from_numpy`, which keeps int32.
Cross-entropy wants int64 targets, so training dies at the end of the first
epoch with `RuntimeError: expected target dtype to be Long or Byte, but got Int`. Replay shows
it is deterministic; shrink cuts it to one step and one row (any row does it:
the bug is the batch's dtype, not a sample).

    python examples/collate_dtype.py [--quick]
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

import reprokit

from tinylm import MLP, parse, run_example


def build(config):
    torch.manual_seed(config["seed"])
    model = MLP(config["dim"], 32, config["classes"])
    return reprokit.TrainState(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=config["lr"]))


def train_step(state, batch):
    loss = nn.functional.cross_entropy(state.model(batch["x"]), batch["y"])
    loss.backward()
    state.optimizer.step()
    state.optimizer.zero_grad(set_to_none=True)
    return loss


def collate(x, y, idx, batch_size):
    if len(idx) == batch_size:
        return {"x": torch.from_numpy(x[idx]), "y": torch.tensor([int(v) for v in y[idx]]), "index": torch.from_numpy(idx)}
    # The ragged last batch: a "fast path" that keeps numpy's int32.
    return {"x": torch.from_numpy(x[idx]), "y": torch.from_numpy(y[idx]), "index": torch.from_numpy(idx)}


def batches(config, n):
    rng = np.random.default_rng(config["seed"])
    x = rng.standard_normal((n, config["dim"]), dtype=np.float32)
    y = (x[:, 0] > 0).astype(np.int32) + 2 * (x[:, 1] > 0).astype(np.int32)  # int32, as stored on disk
    order = rng.permutation(n)
    for start in range(0, n, config["batch_size"]):
        yield collate(x, y, order[start:start + config["batch_size"]], config["batch_size"])


def main() -> int:
    args = parse(__doc__)
    config = {"seed": 0, "dim": 8, "classes": 4, "lr": 1e-2, "batch_size": 32}
    n = 32 * 20 + 7 if args.quick else 32 * 1500 + 7  # one epoch: the ragged batch comes last
    return run_example(args, build(config), train_step, build, config, batches(config, n), snapshot_every=25)


if __name__ == "__main__":
    raise SystemExit(main())
