"""A tiny seeded language model (and classifier) whose batches may hold an id the model has no row for.

``task="lm"``: an ``nn.Embedding`` of ``VOCAB`` rows (``wte``), and one sample at the bad step holds the id
``VOCAB`` (a tokenizer that knows one more token than the model). ``task="cls"``: the same body with a
``CLASSES``-way head, and one sample's label is ``CLASSES`` (``cross_entropy`` with a target >= classes).

On the GPU both are a device-side assert. On the CPU they are a clean ``IndexError``; with ``RK_GPU_FACE=1`` in the
environment the step raises there what the GPU raises (``RuntimeError: CUDA error: device-side assert triggered``), in
place of the IndexError: how the tests record a device error on a machine without a GPU. Replay runs without it,
and the CPU replay meets the IndexError itself.

``python -c "import rk_vocab; rk_vocab.main(...)"`` records a run in a process of its own (the GPU tests: a
device-side assert poisons the CUDA context of the process it happens in) and prints one JSON line: the bundle, the
error, and the time from the error to the bundle on disk.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.nn.functional as F

import reprokit

VOCAB, CLASSES, DIM, SEQ, ROWS = 64, 10, 16, 8, 8
GPU_FACE = ("CUDA error: device-side assert triggered\nCUDA kernel errors might be asynchronously reported at some "
            "other API call, so the stacktrace below might be incorrect.\nFor debugging consider passing "
            "CUDA_LAUNCH_BLOCKING=1")


class TinyLM(torch.nn.Module):
    def __init__(self, task: str, pad_mb: int = 0):
        super().__init__()
        self.task = task
        self.wte = torch.nn.Embedding(VOCAB, DIM)
        self.mix = torch.nn.Linear(DIM, DIM)
        self.head = torch.nn.Linear(DIM, VOCAB if task == "lm" else CLASSES)
        # State that only makes the snapshot's copy long (a step's fault then comes while it is in flight).
        self.pad = torch.nn.Parameter(torch.zeros(pad_mb << 18), requires_grad=False) if pad_mb else None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mix(self.wte(ids))))


def build(config):
    if os.environ.get("RK_BUILD_NEEDS_GPU") and os.environ.get("CUDA_VISIBLE_DEVICES") == "":
        raise RuntimeError("No CUDA GPUs are available")  # what .to("cuda") says in a process that sees no GPU
    torch.manual_seed(0)
    model = TinyLM(config.get("task", "lm"), int(config.get("pad_mb", 0))).to(config.get("device", "cpu"))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    return reprokit.TrainState(model=model, optimizer=opt)


def train_step(state, batch):
    model = state.model
    try:
        logits = model(batch["input_ids"])
        if model.task == "lm":
            loss = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten())
        else:
            loss = F.cross_entropy(logits.mean(1), batch["labels"])
        loss.backward()
    except IndexError:
        if os.environ.get("RK_GPU_FACE"):
            raise RuntimeError(GPU_FACE) from None
        raise
    state.optimizer.step()
    state.optimizer.zero_grad(set_to_none=True)
    return loss


def batches(steps, bad_step=None, bad_row=5, bad_pos=3, task="lm", device="cpu"):
    """``steps`` seeded batches of ``ROWS`` rows; at ``bad_step`` the id ``VOCAB`` at (``bad_row``, ``bad_pos``) of
    ``input_ids`` (task "lm"), or the label ``CLASSES`` in row ``bad_row`` (task "cls"). Dataset indices are
    ``100 + step * ROWS + row``."""
    g = torch.Generator().manual_seed(1)
    for k in range(steps):
        ids = torch.randint(0, VOCAB, (ROWS, SEQ), generator=g)
        labels = ids.roll(-1, dims=1) if task == "lm" else torch.randint(0, CLASSES, (ROWS,), generator=g)
        if k == bad_step and task == "lm":
            ids[bad_row, bad_pos] = VOCAB
        elif k == bad_step:
            labels[bad_row] = CLASSES
        index = torch.arange(100 + k * ROWS, 100 + (k + 1) * ROWS)
        yield {"input_ids": ids.to(device), "labels": labels.to(device), "index": index}


def main(out_dir, device="cuda", task="lm", steps=12, bad_step=6, snapshot_every=4, pad_mb=0):
    """Record a run until its bad step, as a plain loop: the device error surfaces wherever the host next waits for
    the device (often the next batch's ``.to(device)``, outside ``rec.step``) and ends the process uncaught. The
    process's own exception hook, made before the Recorder (as a job's logging would), prints
    ``{"bundle", "error", "write_seconds"}`` after reprokit's hook has written the bundle and noted it."""
    config = {"task": task, "device": device, "pad_mb": pad_mb}
    state = build(config)

    def last_word(exc_type, e, tb):
        notes = [n for n in getattr(e, "__notes__", []) if n.startswith("reprokit: bundle written to ")]
        print(json.dumps({"bundle": notes[-1].removeprefix("reprokit: bundle written to ") if notes else None,
                          "error": f"{type(e).__name__}: {str(e).splitlines()[0]}",
                          "write_seconds": rec.dead_write_seconds}), flush=True)
        sys.__excepthook__(exc_type, e, tb)

    sys.excepthook = last_word
    rec = reprokit.Recorder(state, train_step, build=build, config=config, out_dir=out_dir,
                            snapshot_every=snapshot_every)
    for batch in batches(steps, bad_step, task=task, device=device):
        rec.step(batch)
    print(json.dumps({"bundle": None, "error": None}), flush=True)
