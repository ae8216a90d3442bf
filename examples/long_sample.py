"""A rare sample longer than the position table: an index error deep into training.

TinyLM has 32 learned positions. The data pipeline packs documents into rows
and pads each batch to its longest row, but nothing truncates: one document in
the corpus is 40 tokens long. When it is drawn, the position embedding is asked
for position 32 and raises `IndexError: index out of range in self`. Shrinking
keeps one row and cuts the sequence to the minimal failing length, 33 = the
table size + 1.

    python examples/long_sample.py [--quick]
"""

from __future__ import annotations

import torch
from torch import nn

import reprokit

from tinylm import TinyLM, parse, run_example

MAX_LEN = 32  # the model's position table
PAD = 0


def build(config):
    torch.manual_seed(config["seed"])
    model = TinyLM(vocab=config["vocab"], max_len=MAX_LEN)
    return reprokit.TrainState(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=config["lr"]))


def train_step(state, batch):
    ids = batch["input_ids"]
    logits = state.model(ids)
    targets = ids[:, 1:].masked_fill(ids[:, 1:] == PAD, -100)  # no loss on padding
    loss = nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), targets.flatten(), ignore_index=-100)
    loss.backward()
    state.optimizer.step()
    state.optimizer.zero_grad(set_to_none=True)
    return loss


def batches(config, steps, rare_step):
    g = torch.Generator().manual_seed(config["seed"] + 1)
    for step in range(steps):
        lengths = torch.randint(8, MAX_LEN + 1, (8,), generator=g)
        if step == rare_step:
            lengths[5] = 40  # the one long document in the corpus
        ids = torch.full((8, int(lengths.max())), PAD)
        for row, n in enumerate(lengths.tolist()):
            ids[row, :n] = torch.randint(1, config["vocab"], (n,), generator=g)
        yield {"input_ids": ids, "index": torch.arange(step * 8, step * 8 + 8)}


def main() -> int:
    args = parse(__doc__)
    steps, rare = (40, 31) if args.quick else (3000, 2718)
    config = {"seed": 0, "vocab": 32, "lr": 1e-3}
    return run_example(args, build(config), train_step, build, config, batches(config, steps, rare), snapshot_every=25)


if __name__ == "__main__":
    raise SystemExit(main())
