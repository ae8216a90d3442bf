"""A small regression project for ``on_failure="skip"``: a dataset with poisoned samples, batches that carry their
dataset indices, dropout (so a step's RNG draws depend on its rows), AdamW and an LR schedule."""

from __future__ import annotations

import functools

import torch
from torch import nn

import reprokit

DIM, BATCH = 8, 8


def lr_factor(step: int, jump_at: int | None) -> float:
    """A warmup, and (the bug of one test) an LR multiplied by 1e24 from step ``jump_at`` on."""
    if jump_at is not None and step >= jump_at:
        return 1e24
    return min(1.0, (step + 1) / 10)


def build(config):
    torch.manual_seed(config.get("seed", 0))
    model = nn.Sequential(nn.Linear(DIM, 16), nn.Tanh(), nn.Dropout(0.1), nn.Linear(16, 1)).to(config.get("device", "cpu"))
    opt = torch.optim.AdamW(model.parameters(), lr=config.get("lr", 1e-2), weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, functools.partial(lr_factor, jump_at=config.get("jump_at")))
    return reprokit.TrainState(model=model, optimizer=opt, scheduler=sched)


def train_step(state, batch):
    loss = nn.functional.mse_loss(state.model(batch["x"]).squeeze(-1), batch["y"])
    loss.backward()
    state.optimizer.step()
    state.optimizer.zero_grad(set_to_none=True)
    state.scheduler.step()
    return loss


def dataset(size, poisoned=(), seed=0):
    """``(x, y)`` of ``size`` samples; each poisoned index holds a NaN feature."""
    g = torch.Generator().manual_seed(seed + 100)
    w = torch.randn(DIM, generator=g)
    x = torch.randn(size, DIM, generator=g)
    y = x @ w
    for i in poisoned:
        x[i, 1] = float("nan")
    return x, y


def batches(data, steps, drop=(), device="cpu"):
    """Step s feeds samples s*BATCH .. (s+1)*BATCH-1 in order, without the indices in ``drop``, on ``device``."""
    x, y = data
    for s in range(steps):
        idx = torch.tensor([i for i in range(s * BATCH, (s + 1) * BATCH) if i not in drop])
        yield {"x": x[idx].to(device), "y": y[idx].to(device), "index": idx.to(device)}


FLAKY_STEP = 12
_calls = {"n": 0}


def flaky_step(state, batch):
    """Fails (a NaN loss) at step FLAKY_STEP on its first two executions only: the training run's and the first
    replay's, and never again, like a fault of the hardware that stopped."""
    loss = train_step(state, batch)
    step = reprokit.detect.current_step()
    if step is not None and step[0] == FLAKY_STEP:
        _calls["n"] += 1
        if _calls["n"] <= 2:
            return loss * float("nan")
    return loss


VOCAB, SEQ = 50, 6


def build_lm(config):
    """A tiny token model: an id past the vocabulary raises IndexError in the embedding."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(VOCAB, 16), nn.Flatten(), nn.Linear(16 * SEQ, VOCAB))
    return reprokit.TrainState(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3))


def lm_step(state, batch):
    logits = state.model(batch["ids"])
    loss = nn.functional.cross_entropy(logits, batch["ids"][:, 0].clamp(max=VOCAB - 1))
    loss.backward()
    state.optimizer.step()
    state.optimizer.zero_grad()
    return loss


def lm_batches(steps, bad_step=None, drop=()):
    """Token batches; at ``bad_step`` row 5 holds an id past the vocabulary (a tokenizer that added tokens)."""
    g = torch.Generator().manual_seed(3)
    for s in range(steps):
        ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
        idx = torch.arange(s * BATCH, (s + 1) * BATCH)
        if s == bad_step:
            ids[5, 2] = VOCAB + 7
        keep = [i for i in range(BATCH) if int(idx[i]) not in drop]
        yield {"ids": ids[keep], "index": idx[keep]}
