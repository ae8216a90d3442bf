"""An empty document under a masked-mean loss: 0/0 in one row turns the loss NaN.

The loss averages each document's token losses over its own mask, then over
documents: `((ce * mask).sum(1) / mask.sum(1)).mean()`. A document that is all
padding (an empty line in the corpus, say) has `mask.sum(1) == 0`, its mean is
0/0 = NaN, and so is the batch loss. Shrinking keeps that one document (checked
against a healthy control row, so that a cut which empties every row is not
mistaken for the same bug) and `bisect layers` names the division in the step
function.

    python examples/empty_document.py [--quick]
"""

from __future__ import annotations

import torch
from torch import nn

import reprokit

from tinylm import TinyLM, parse, run_example


def build(config):
    torch.manual_seed(config["seed"])
    model = TinyLM(vocab=config["vocab"], max_len=24)
    return reprokit.TrainState(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=config["lr"]))


def train_step(state, batch):
    ids, mask = batch["input_ids"], batch["mask"].float()
    logits = state.model(ids)
    ce = nn.functional.cross_entropy(logits[:, :-1].transpose(1, 2), ids[:, 1:], reduction="none")
    m = mask[:, 1:]
    loss = ((ce * m).sum(1) / m.sum(1)).mean()  # per-document mean: 0/0 for an empty document
    loss.backward()
    state.optimizer.step()
    state.optimizer.zero_grad(set_to_none=True)
    return loss


def batches(config, steps, bad_step):
    g = torch.Generator().manual_seed(config["seed"] + 1)
    for step in range(steps):
        lengths = torch.randint(6, 25, (8,), generator=g)
        if step == bad_step:
            lengths[3] = 0  # an empty document
        mask = torch.arange(24)[None, :] < lengths[:, None]
        ids = torch.randint(1, config["vocab"], (8, 24), generator=g) * mask
        yield {"input_ids": ids, "mask": mask.long(), "index": torch.arange(step * 8, step * 8 + 8)}


def main() -> int:
    args = parse(__doc__)
    steps, bad = (40, 29) if args.quick else (3000, 2207)
    config = {"seed": 0, "vocab": 32, "lr": 1e-3}
    return run_example(args, build(config), train_step, build, config, batches(config, steps, bad), snapshot_every=25)


if __name__ == "__main__":
    raise SystemExit(main())
