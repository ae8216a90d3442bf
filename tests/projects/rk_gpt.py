"""A nanoGPT-style loop: pre-LayerNorm blocks, AdamW, warmup set inside the step, ``clip_grad_norm_(1.0)``.

The learning rate is set inside ``train_step`` from a step counter in ``state.extra`` (as the docs ask: state
changes only inside the step), then the gradients are clipped to norm 1, then the optimizer steps. With
``config["lr"]`` far too high (1e3: AdamW moves every weight by about the LR each step, whatever the clipping) the
weights grow by orders of magnitude within a few steps, the loss leaves its starting level at once, and the
activations grow until one op overflows float32: the NaN comes long after the cause.
"""

from __future__ import annotations

import torch
from torch import nn

import reprokit


class Block(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.ln_1 = nn.LayerNorm(d)
        self.attn = nn.Linear(d, d)
        self.ln_2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, vocab: int, d: int, layers: int):
        super().__init__()
        self.transformer = nn.ModuleDict({"wte": nn.Embedding(vocab, d),
                                          "h": nn.ModuleList(Block(d) for _ in range(layers)),
                                          "ln_f": nn.LayerNorm(d)})
        self.lm_head = nn.Linear(d, vocab, bias=False)

    def forward(self, ids):
        x = self.transformer.wte(ids)
        for block in self.transformer.h:
            x = block(x)
        return self.lm_head(self.transformer.ln_f(x))


def build(config):
    torch.manual_seed(config.get("seed", 0))
    model = GPT(config.get("vocab", 32), config.get("d", 16), config.get("layers", 2))
    opt = torch.optim.AdamW(model.parameters(), lr=config["lr"], weight_decay=0.0)
    model.schedule = {k: config.get(k, d) for k, d in (("lr", None), ("warmup", 0), ("clip", 1.0))}
    state = reprokit.TrainState(model=model, optimizer=opt)
    state.extra["step"] = 0
    return state


def lr_at(schedule, step):
    """Linear warmup over ``schedule["warmup"]`` steps to ``schedule["lr"]``."""
    warmup = schedule["warmup"]
    return schedule["lr"] * min(1.0, (step + 1) / warmup) if warmup else schedule["lr"]


def train_step(state, batch):
    schedule = state.model.schedule
    for group in state.optimizer.param_groups:  # the LR this step uses, set inside the step
        group["lr"] = lr_at(schedule, state.extra["step"])
    logits = state.model(batch["input_ids"])
    loss = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch["labels"].reshape(-1))
    loss.backward()
    torch.nn.utils.clip_grad_norm_(state.model.parameters(), schedule["clip"])
    state.optimizer.step()
    state.optimizer.zero_grad(set_to_none=True)
    state.extra["step"] += 1
    return loss


def batches(config, steps, bs=8, seq=12):
    g = torch.Generator().manual_seed(config.get("seed", 0) + 1)
    vocab = config.get("vocab", 32)
    for _ in range(steps):
        ids = torch.randint(0, vocab, (bs, seq), generator=g)
        yield {"input_ids": ids, "labels": torch.roll(ids, -1, dims=1)}
