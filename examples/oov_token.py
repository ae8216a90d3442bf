"""Token id >= vocab size: the tokenizer gained special tokens, the model was never resized.

A TinyLM built for a 64-token vocabulary is fed by a tokenizer that later got
two special tokens (ids 64 and 65). The failure is `IndexError: index out of
range in self` from the token embedding, raised only for the rare batch that
contains a new token. The recorder lets the exception through unchanged (with a
note naming the bundle); replay shows it is deterministic, and shrink cuts the
batch to one row with the offending token kept.

    python examples/oov_token.py [--quick]
"""

from __future__ import annotations

import torch

import reprokit

from tinylm import TinyLM, lm_loss, parse, run_example

VOCAB = 64           # what the model was built with
TOKENIZER_SIZE = 66  # what the tokenizer emits after adding two special tokens


def build(config):
    torch.manual_seed(config["seed"])
    model = TinyLM(vocab=VOCAB, max_len=32)
    return reprokit.TrainState(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=config["lr"]))


def train_step(state, batch):
    loss = lm_loss(state.model(batch["input_ids"]), batch["input_ids"])
    loss.backward()
    state.optimizer.step()
    state.optimizer.zero_grad(set_to_none=True)
    return loss


def batches(steps, rare_step):
    g = torch.Generator().manual_seed(3)
    for step in range(steps):
        ids = torch.randint(1, VOCAB, (8, 32), generator=g)
        if step == rare_step:
            ids[2, 11] = TOKENIZER_SIZE - 1  # the new special token shows up once
        yield {"input_ids": ids}


def main() -> int:
    args = parse(__doc__)
    steps, rare = (40, 33) if args.quick else (2000, 1717)
    config = {"seed": 0, "lr": 1e-3}
    return run_example(args, build(config), train_step, build, config, batches(steps, rare), snapshot_every=25)


if __name__ == "__main__":
    raise SystemExit(main())
