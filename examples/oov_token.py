"""Token id >= vocab size: the tokenizer gained special tokens, the model was never resized.

The failure is an `IndexError: index out of range in self` from nn.Embedding,
raised only for the rare batch that contains the new token. The Recorder lets
that exception through unchanged (with a note naming the bundle), and replay
shows it is deterministic.

    python examples/oov_token.py [--quick]
"""

from __future__ import annotations

import argparse
import tempfile

import torch
from torch import nn

import reprokit

VOCAB = 64          # what the model was built with
TOKENIZER_SIZE = 66  # what the tokenizer emits after adding two special tokens


def build(config):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(VOCAB, 16), nn.Linear(16, VOCAB))
    return reprokit.TrainState(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))


def train_step(state, batch):
    logits = state.model(batch["input_ids"][:, :-1])
    loss = nn.functional.cross_entropy(logits.flatten(0, 1), batch["input_ids"][:, 1:].flatten())
    loss.backward()
    state.optimizer.step()
    state.optimizer.zero_grad()
    return loss


def batches(steps, rare_step):
    g = torch.Generator().manual_seed(3)
    for step in range(steps):
        ids = torch.randint(0, VOCAB, (8, 32), generator=g)
        if step == rare_step:
            ids[2, 11] = TOKENIZER_SIZE - 1  # the special token shows up once
        yield {"input_ids": ids}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer steps, for the test suite")
    args = ap.parse_args()
    steps, rare = (40, 33) if args.quick else (2000, 1717)
    rec = reprokit.Recorder(build({}), train_step, build=build, config={},
                            out_dir=tempfile.mkdtemp(prefix="reprokit-example-"), snapshot_every=25)
    try:
        for batch in batches(steps, rare):
            rec.step(batch)
    except IndexError as e:
        print(f"training raised: IndexError: {e}")
        for note in getattr(e, "__notes__", []):
            print(note)
        report = reprokit.replay(rec.bundles[-1], times=2)
        print(f"replay: {report.verdict}; failure in {report.runs[0].failure.frame} at step {report.runs[0].failure.step}")
        return 0 if report.verdict == "deterministic" else 1
    print("training finished without failing (unexpected)")
    return 1


if __name__ == "__main__":
    raise SystemExit(main())
