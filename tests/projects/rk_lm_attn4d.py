"""A tiny attention language model fed a 4-D boolean attention mask ``[n, 1, S, S]`` (causal and padding), as
models that build their own masks take them; one corrupted embedding row turns a token NaN."""

from __future__ import annotations

import torch
from torch import nn

import reprokit


class TinyAttnLM(nn.Module):
    def __init__(self, vocab: int, d: int):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.qkv = nn.Linear(d, 3 * d)
        self.head = nn.Linear(d, vocab)

    def forward(self, ids, mask):
        h = self.tok(ids)
        q, k, v = self.qkv(h).unsqueeze(1).chunk(3, dim=-1)  # one head: [n, 1, S, d]
        a = nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # needs mask [n, 1, S, S]
        return self.head(torch.tanh(h + a.squeeze(1)))


def build(config):
    torch.manual_seed(config.get("seed", 0))
    model = TinyAttnLM(config["vocab"], config.get("d", 16))
    with torch.no_grad():
        model.tok.weight[config["nan_token"]] = float("nan")
    return reprokit.TrainState(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2))


def train_step(state, batch):
    ids, labels = batch["input_ids"], batch["labels"]
    logits = state.model(ids, batch["attention_mask"])
    loss = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
    loss.backward()
    state.optimizer.step()
    state.optimizer.zero_grad(set_to_none=True)
    return loss


def batches(config, steps, seq=48, bs=4, bad=None):
    """``bad=(step, row, position)`` puts ``config["nan_token"]`` there; other ids avoid it."""
    g = torch.Generator().manual_seed(config.get("seed", 0) + 5)
    V = config["vocab"]
    causal = torch.ones(seq, seq, dtype=torch.bool).tril()
    for s in range(steps):
        ids = torch.randint(1, V, (bs, seq), generator=g)
        ids[ids == config["nan_token"]] = 1
        if bad is not None and s == bad[0]:
            ids[bad[1], bad[2]] = config["nan_token"]
        labels = torch.roll(ids, -1, dims=1)
        mask = causal.expand(bs, 1, seq, seq).clone()
        yield {"input_ids": ids, "labels": labels, "attention_mask": mask}
