"""A tiny language model: token ids past the vocab and sequences past the position table."""

from __future__ import annotations

import torch
from torch import nn

import reprokit


class TinyLM(nn.Module):
    def __init__(self, vocab: int, max_len: int, d: int):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.randn(max_len, d) * 0.02)  # learned positions, fixed table size
        self.head = nn.Linear(d, vocab)

    def forward(self, ids):
        h = self.tok(ids) + self.pos[: ids.shape[1]]
        return self.head(torch.tanh(h))


def build(config):
    torch.manual_seed(config.get("seed", 0))
    model = TinyLM(config["vocab"], config["max_len"], config.get("d", 16))
    return reprokit.TrainState(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2))


def train_step(state, batch):
    ids, labels = batch["input_ids"], batch["labels"]
    logits = state.model(ids)
    loss = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100)
    loss.backward()
    state.optimizer.step()
    state.optimizer.zero_grad(set_to_none=True)
    return loss


def batches(config, steps, oov_step=None, long_step=None, seq=12, bs=8):
    g = torch.Generator().manual_seed(config.get("seed", 0) + 7)
    V = config["vocab"]
    for s in range(steps):
        n = config["max_len"] + 4 if s == long_step else seq
        ids = torch.randint(0, V, (bs, n), generator=g)
        if s == oov_step:
            ids[5, 7] = V + 3  # a token the tokenizer added but the model never resized for
        labels = torch.roll(ids, -1, dims=1).clamp(max=V - 1)
        yield {"input_ids": ids, "labels": labels, "index": torch.arange(s * bs, (s + 1) * bs), "source": "synthetic"}
