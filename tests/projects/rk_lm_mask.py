"""A language model whose loss averages each document over its loss mask: an empty document gives 0/0."""

from __future__ import annotations

import torch
from torch import nn

import reprokit


class TinyLM(nn.Module):
    def __init__(self, vocab: int, d: int):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.head = nn.Linear(d, vocab)

    def forward(self, ids):
        return self.head(torch.tanh(self.tok(ids)))


def build(config):
    torch.manual_seed(config.get("seed", 0))
    model = TinyLM(config["vocab"], config.get("d", 16))
    return reprokit.TrainState(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2))


def train_step(state, batch):
    ids, mask = batch["input_ids"], batch["loss_mask"]
    logits = state.model(ids[:, :-1])
    ce = nn.functional.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none")
    m = mask[:, 1:].to(ce.dtype)
    per_doc = (ce * m).sum(1) / m.sum(1)  # THE BUG: a document with no target gives 0/0
    loss = per_doc.mean()
    loss.backward()
    state.optimizer.step()
    state.optimizer.zero_grad(set_to_none=True)
    return loss


def batches(config, steps, seq=32, bs=8, empty=None):
    """Documents of random length (at least half the sequence); ``empty=(step, row)`` has no target at all."""
    g = torch.Generator().manual_seed(config.get("seed", 0) + 11)
    for s in range(steps):
        ids = torch.randint(1, config["vocab"], (bs, seq), generator=g)
        lengths = torch.randint(seq // 2, seq + 1, (bs,), generator=g)
        mask = (torch.arange(seq) < lengths[:, None]).long()
        if empty is not None and s == empty[0]:
            mask[empty[1]] = 0
        yield {"input_ids": ids, "loss_mask": mask, "index": torch.arange(s * bs, (s + 1) * bs)}
