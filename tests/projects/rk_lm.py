"""A tiny language model: token ids past the vocab and sequences past the position table."""

from __future__ import annotations

import torch
from torch import nn

import reprokit


class TinyLM(nn.Module):
    def __init__(self, vocab: int, max_len: int, d: int, pos_table: bool = False, min_len: int = 0):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.randn(max_len, d) * 0.02)  # learned positions, fixed table size
        self.pos_table = nn.Embedding(max_len, d) if pos_table else None
        self.head = nn.Linear(d, vocab)
        self.min_len = min_len

    def forward(self, ids):
        if ids.shape[1] < self.min_len:
            raise ValueError(f"sequence of {ids.shape[1]} tokens is shorter than {self.min_len}")
        if self.pos_table is not None:  # an index error past the table, like GPT-2's wpe
            h = self.tok(ids) + self.pos_table(torch.arange(ids.shape[1]))
        else:  # a shape error past the table
            h = self.tok(ids) + self.pos[: ids.shape[1]]
        return self.head(torch.tanh(h))


def build(config):
    torch.manual_seed(config.get("seed", 0))
    model = TinyLM(config["vocab"], config["max_len"], config.get("d", 16), config.get("pos_table", False),
                   config.get("min_len", 0))
    if "nan_token" in config:  # one corrupted embedding row: that token id turns everything NaN
        with torch.no_grad():
            model.tok.weight[config["nan_token"]] = float("nan")
    return reprokit.TrainState(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2))


def train_step(state, batch):
    ids, labels = batch["input_ids"], batch["labels"]
    logits = state.model(ids)
    loss = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100)
    loss.backward()
    state.optimizer.step()
    state.optimizer.zero_grad(set_to_none=True)
    return loss


def batches(config, steps, oov_step=None, long_step=None, seq=12, bs=8, long_len=None, bad=None):
    """``bad=(step, row, position)`` puts ``config["nan_token"]`` there; other ids avoid it."""
    g = torch.Generator().manual_seed(config.get("seed", 0) + 7)
    V = config["vocab"]
    for s in range(steps):
        n = (long_len or config["max_len"] + 4) if s == long_step else seq
        ids = torch.randint(1, V, (bs, n), generator=g)
        if "nan_token" in config:
            ids[ids == config["nan_token"]] = 1
        if bad is not None and s == bad[0]:
            ids[bad[1], bad[2]] = config["nan_token"]
        if s == oov_step:
            ids[5, 7] = V + 3  # a token the tokenizer added but the model never resized for
        labels = torch.roll(ids, -1, dims=1).clamp(max=V - 1)
        yield {"input_ids": ids, "labels": labels, "index": torch.arange(s * bs, (s + 1) * bs), "source": "synthetic"}


def stacked_step(state, batch):
    """nanoGPT's gradient accumulation: ``x`` and ``y`` are ``[accum, B, T]``, one micro-batch per ``x[k]``."""
    x, y = batch["x"], batch["y"]
    total = 0.0
    for k in range(x.shape[0]):
        logits = state.model(x[k])
        loss = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y[k].reshape(-1)) / x.shape[0]
        loss.backward()
        total = total + loss.detach()
    state.optimizer.step()
    state.optimizer.zero_grad(set_to_none=True)
    return total


def stacked_batches(config, steps, accum=4, bs=4, seq=8, bad=None, index=True):
    """``[accum, bs, seq]`` token batches; ``bad=(step, k, row)`` puts ``config["nan_token"]`` in that row of
    micro-batch ``k``. ``index``: a ``[accum, bs]`` leaf of dataset indices (far apart, as a shuffled corpus)."""
    g = torch.Generator().manual_seed(config.get("seed", 0) + 11)
    V = config["vocab"]
    for s in range(steps):
        ids = torch.randint(1, V, (accum, bs, seq + 1), generator=g)
        ids[ids == config["nan_token"]] = 1
        if bad is not None and s == bad[0]:
            ids[bad[1], bad[2], 3] = config["nan_token"]
        batch = {"x": ids[..., :-1].contiguous(), "y": ids[..., 1:].contiguous()}
        if index:
            batch["index"] = 30000000 + 32 * torch.arange(s * accum * bs, (s + 1) * accum * bs).reshape(accum, bs)
        yield batch
