"""A "bad batch" deep into training: one sample whose labels are all ignore_index.

A tiny token classifier trains happily until a batch arrives in which every
label is -100 (say, a document that was all padding). Cross-entropy with
reduction="mean" then divides 0 by 0 and the loss is NaN. The Recorder catches
it, writes a bundle, and we replay that bundle to show it fails the same way.

    python examples/bad_batch.py            # full run (a few seconds on CPU)
    python examples/bad_batch.py --quick    # the same story, fewer steps
"""

from __future__ import annotations

import argparse
import tempfile

import torch
from torch import nn

import reprokit


def build(config):
    torch.manual_seed(config["seed"])
    model = nn.Sequential(nn.Embedding(config["vocab"], 32), nn.ReLU(), nn.Linear(32, config["classes"]))
    opt = torch.optim.AdamW(model.parameters(), lr=config["lr"])
    return reprokit.TrainState(model=model, optimizer=opt)


def train_step(state, batch):
    logits = state.model(batch["input_ids"])
    loss = nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=-100)
    loss.backward()
    state.optimizer.step()
    state.optimizer.zero_grad(set_to_none=True)
    return loss


def batches(config, steps, bad_step):
    g = torch.Generator().manual_seed(config["seed"])
    for step in range(steps):
        ids = torch.randint(0, config["vocab"], (16, 24), generator=g)
        labels = ids % config["classes"]
        if step == bad_step:
            labels[:] = -100  # the poisoned batch: nothing to learn from
        yield {"input_ids": ids, "labels": labels, "index": torch.arange(step * 16, step * 16 + 16)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer steps, for the test suite")
    ap.add_argument("--out", default=None, help="bundle directory (default: a temp dir)")
    args = ap.parse_args()
    steps, bad = (60, 45) if args.quick else (3000, 2345)
    config = {"seed": 0, "vocab": 100, "classes": 5, "lr": 1e-3}
    out = args.out or tempfile.mkdtemp(prefix="reprokit-example-")
    rec = reprokit.Recorder(build(config), train_step, build=build, config=config, out_dir=out, snapshot_every=20)
    try:
        for batch in batches(config, steps, bad):
            rec.step(batch)
    except reprokit.TrainingFailure as e:
        print(f"training failed: {e.failure.describe()}")
        print(f"bundle: {e.bundle}")
        report = reprokit.replay(e.bundle, times=3)
        print(f"replay: {report.verdict}, {report.failed_runs}/{len(report.runs)} runs failed the same way")
        return 0 if report.verdict == "deterministic" else 1
    print("training finished without failing (unexpected)")
    return 1


if __name__ == "__main__":
    raise SystemExit(main())
